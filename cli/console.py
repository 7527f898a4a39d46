"""Events as people read them: one short line each, for a terminal and for `llm-pretrain logs`.

Owns the human rendering of an event record — time, level, event, then its fields with floats
rounded and long values folded — with a dedicated line for `progress` (step/total, loss, lr,
tokens/s, ETA) and level colours on a terminal; the same for a worker's own events (`train` run
by hand: steps, phases, checkpoints, its exit); and `ConsoleStream`, the stream the daemon and
`train` write their JSON lines to when they render them for a terminal (events.jsonl and the
ranks' logs under the daemon stay JSON).
"""
from __future__ import annotations

import json
import time
from collections import deque
from typing import Any, TextIO

_COMMON = ("ts", "level", "event", "run", "generation")
_COLOURS = {"debug": "\x1b[2m", "warning": "\x1b[33m", "error": "\x1b[31m", "critical": "\x1b[1;31m"}
_RESET = "\x1b[0m"
FOLD = 100          # characters of a long value shown before "…"
_PROSE = ("reason", "detail", "error")      # fields that say why, in words: never folded


def _value(v: Any, fold: bool = True, words: bool = False) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    if isinstance(v, str):
        text = v
    else:
        text = json.dumps(_rounded(v), separators=(",", ":"))
    if len(text) <= FOLD or not fold:
        return text
    cut = text.rfind(" ", 0, FOLD) if words and isinstance(v, str) else -1
    return (text[:cut] if cut > 0 else text[:FOLD]) + "…"


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
    if r.get("checkpoint"):
        parts.append(f"saved {r['checkpoint']}")
    return "  ".join(parts)


def human(record: dict[str, Any], *, colour: bool = False, full_time: bool = False) -> str:
    ts = str(record.get("ts", ""))
    when = ts if full_time else ts[11:19]
    level = str(record.get("level", "info"))
    event = str(record.get("event", ""))
    if event == "progress":
        rest = _progress(record)
    else:
        # why the daemon gave up or ended is said in full (a rank's error, its refusal); other prose is folded
        # at a word, evidence and other values at FOLD characters
        whole = event in ("daemon_exit", "gave_up")
        rest = " ".join(f"{k}={_value(v, fold=not (whole and k in _PROSE), words=k in _PROSE)}"
                        for k, v in record.items() if k not in _COMMON and v not in (None, ""))
    line = f"{when} {level.upper():<7} g{record.get('generation', '')} {event:<18} {rest}".rstrip()
    if colour and level in _COLOURS:
        return f"{_COLOURS[level]}{line}{_RESET}"
    return line


_PHASE_TEXT = {"restore": "restoring (the newest checkpoint, if any) and forming the cluster",
               "compile": "compiling the step: the first one takes a while",
               "paused": "paused", "train": "training", "checkpoint": "saving the final checkpoint",
               "exiting": "exiting"}


class WorkerLines:
    """A worker's events (records with a `kind`, as `train` prints them) as people read them: a
    progress line per logged step, its ETA from the wall time between the recent progress lines (so
    never the compiled first step, and with data waits and saves in it); a commit, not its stages."""

    def __init__(self, total_steps: int | None = None, window: int = 10, clock=time.monotonic):
        self.total_steps, self.clock = total_steps, clock
        self._seen: deque[tuple[float, int]] = deque(maxlen=window)     # (when, step) of progress lines

    def line(self, r: dict[str, Any]) -> tuple[str, str] | None:
        """(level, text) for one record; None: nothing to say."""
        kind = r.get("kind")
        if kind == "step":
            step = int(r.get("step", 0))
            if self._seen and self._seen[-1][1] >= step:      # a replay: measure afresh
                self._seen.clear()
            self._seen.append((self.clock(), step))
            eta = None
            (t0, s0), (t1, s1) = self._seen[0], self._seen[-1]
            if self.total_steps and s1 > s0:
                eta = max(0, self.total_steps - step) * (t1 - t0) / (s1 - s0)
            return ("warning" if r.get("skipped") else "info",
                    _progress({**r, "total_steps": self.total_steps, "eta_s": eta}))
        if kind == "phase":
            text = _PHASE_TEXT.get(str(r.get("phase")), str(r.get("phase")))
            return "info", f"{text} (step {r.get('step', 0)})" if r.get("step") else text
        if kind == "checkpoint":
            stage, step = r.get("stage"), r.get("step")
            if stage in ("staged", "written"):
                return None
            level = "error" if stage in ("failed", "corrupt") else "info"
            seconds = f" in {r['seconds']:.1f} s" if r.get("seconds") else ""
            detail = f": {_value(r['detail'])}" if r.get("detail") else ""
            return level, f"checkpoint step {step} {stage}{seconds}{detail}"
        if kind == "exit":
            return "info", f"{r.get('reason')} at step {r.get('step')}"
        if kind == "eval" and isinstance(r.get("loss"), (int, float)):
            return "info", (f"validation loss {r['loss']:.4f} (perplexity {r.get('perplexity', float('nan')):.2f}) "
                            f"after step {r.get('step')}, {r.get('sequences')} sequences in {r.get('seconds', 0):.1f} s")
        if kind == "data_fault":
            return "error", f"corrupt data before step {r.get('step')}: {_value(r.get('detail', ''))}"
        rest = " ".join(f"{k}={_value(v)}" for k, v in r.items() if k not in ("kind", "rank", "generation"))
        return "info", f"{kind} {rest}".rstrip()


class ConsoleStream:
    """A text stream that renders the JSON lines written to it for people (other text passes through):
    the daemon's events, and a worker's (those with a `kind`) through `WorkerLines`."""

    def __init__(self, stream: TextIO, *, colour: bool | None = None, total_steps: int | None = None):
        self.stream = stream
        self.colour = stream.isatty() if colour is None else colour
        self.worker = WorkerLines(total_steps)
        self._partial = ""
        self._committed: dict[str, Any] | None = None     # a commit not said yet: on the next progress line

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            shown = self._render(record) if isinstance(record, dict) else line
            if shown is not None:
                self.stream.write(shown + "\n")
        return len(text)

    def _render(self, record: dict[str, Any]) -> str | None:
        if "event" in record or "kind" not in record:
            return self._daemon_line(record)
        said = self.worker.line(record)
        if said is None:
            return None
        level, text = said
        line = f"{time.strftime('%H:%M:%S')} {level.upper():<7} rank {record.get('rank', 0)} {text}"
        return f"{_COLOURS[level]}{line}{_RESET}" if self.colour and level in _COLOURS else line

    def _daemon_line(self, record: dict[str, Any]) -> str | None:
        """A save is said on the next progress line (`checkpoint step N`), not on a line of its own: a run
        saving every 50 steps would print ten commits between two progress lines. A commit no progress line
        follows (the final save, or one before a warning) gets its own line before the next event."""
        event = record.get("event")
        if event == "checkpoint_committed" and record.get("level", "info") == "info":
            self._committed = record
            return None
        committed, self._committed = self._committed, None
        if event == "progress" and committed is not None:
            return human({**record, "checkpoint": f"step {committed.get('step')}"}, colour=self.colour)
        line = human(record, colour=self.colour)
        return line if committed is None else human(committed, colour=self.colour) + "\n" + line

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()
