"""The operators' requests as the daemon judges them: the one table of control verbs, what each asks,
the command it becomes for the ranks and the validation of its body; a request taken from the control
directory (`Request`) or refused (`Rejected`); a body's grammar. Pure: no files, no clock — the
directory and its intake are daemon.processes.control's.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from contracts.protocol import InjectRequest

MAX_BODY_BYTES = 65536


def _no_args(body: dict[str, Any], cfg) -> dict[str, Any]:
    return {}


def _inject_args(body: dict[str, Any], cfg) -> dict[str, Any]:
    if not cfg.health.allow_fault_injection:
        raise ValueError("fault drills are off: set health.allow_fault_injection = true")
    return InjectRequest.from_dict(body, world=cfg.parallel.world_size, dp=cfg.parallel.dp).to_dict()


@dataclasses.dataclass(frozen=True)
class Verb:
    """A control request: what it asks (the CLI's help), the command it becomes for the ranks, and the
    validation of its body (raises ValueError, naming what is wrong) into that command's args."""

    help: str
    command: str
    validate: Callable[[dict[str, Any], Any], dict[str, Any]] = _no_args

    def command_args(self, body: dict[str, Any], *, cfg) -> dict[str, Any]:
        return self.validate(body, cfg)


# The one table of control verbs: adding one is a line here and its handling in daemon.judging.watch.
VERBS = {
    "pause": Verb("checkpoint, then hold every rank at the same step", "pause"),
    "resume": Verb("continue a paused run", "resume"),
    "checkpoint": Verb("checkpoint now and keep training", "checkpoint"),
    "stop": Verb("checkpoint, then end the daemon with exit 0", "stop"),
    "inject": Verb("fault drill: a fault in a rank (needs health.allow_fault_injection = true)", "inject",
                   _inject_args),
}
CONTROL_NAMES = tuple(VERBS)


@dataclasses.dataclass(frozen=True)
class Request:
    name: str
    body: dict[str, Any]
    file: str


@dataclasses.dataclass(frozen=True)
class Rejected:
    file: str
    reason: str


def parse_body(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_BODY_BYTES:
        raise ValueError(f"body longer than {MAX_BODY_BYTES} bytes")
    text = raw.decode("utf-8", errors="strict").strip() if raw else ""
    if not text:
        return {}
    body = json.loads(text)
    if not isinstance(body, dict):
        raise ValueError("the body must be empty or a JSON object")
    return body
