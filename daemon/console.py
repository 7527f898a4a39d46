"""Events as people read them: one short line each, for a terminal and for `llm-pretrain logs`.

Owns the human rendering of an event record — time, level, event, then its fields with floats
rounded and long values folded — with a dedicated line for `progress` (step/total, loss, lr,
tokens/s, ETA) and level colours on a terminal; and `ConsoleStream`, the stream the daemon writes
its JSON lines to when it renders them for a terminal (events.jsonl stays JSON).
"""
from __future__ import annotations

import json
from typing import Any, TextIO

_COMMON = ("ts", "level", "event", "run", "generation")
_COLOURS = {"debug": "\x1b[2m", "warning": "\x1b[33m", "error": "\x1b[31m", "critical": "\x1b[1;31m"}
_RESET = "\x1b[0m"
FOLD = 100          # characters of a long value shown before "…"


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    if isinstance(v, str):
        text = v
    else:
        text = json.dumps(_rounded(v), separators=(",", ":"))
    return text if len(text) <= FOLD else text[:FOLD] + "…"


def _rounded(v: Any) -> Any:
    if isinstance(v, float):
        return float(f"{v:.4g}")
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def _progress(r: dict[str, Any]) -> str:
    total = f"/{r['total_steps']}" if r.get("total_steps") else ""
    parts = [f"step {r.get('step')}{total}"]
    if isinstance(r.get("loss"), (int, float)):
        parts.append(f"loss {r['loss']:.4f}")
    if isinstance(r.get("lr"), (int, float)):
        parts.append(f"lr {r['lr']:.2e}")
    if isinstance(r.get("tokens_per_s"), (int, float)):
        parts.append(f"{r['tokens_per_s']:,.0f} tokens/s")
    if r.get("eta_s") is not None:
        parts.append(f"ETA {duration(r['eta_s'])}")
    if r.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return "  ".join(parts)


def human(record: dict[str, Any], *, colour: bool = False, full_time: bool = False) -> str:
    ts = str(record.get("ts", ""))
    when = ts if full_time else ts[11:19]
    level = str(record.get("level", "info"))
    event = str(record.get("event", ""))
    if event == "progress":
        rest = _progress(record)
    else:
        rest = " ".join(f"{k}={_value(v)}" for k, v in record.items() if k not in _COMMON and v not in (None, ""))
    line = f"{when} {level.upper():<7} g{record.get('generation', '')} {event:<18} {rest}".rstrip()
    if colour and level in _COLOURS:
        return f"{_COLOURS[level]}{line}{_RESET}"
    return line


class ConsoleStream:
    """A text stream that renders the JSON lines written to it for people (other text passes through)."""

    def __init__(self, stream: TextIO, *, colour: bool | None = None):
        self.stream = stream
        self.colour = stream.isatty() if colour is None else colour
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            self.stream.write((human(record, colour=self.colour) if isinstance(record, dict) else line) + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()
