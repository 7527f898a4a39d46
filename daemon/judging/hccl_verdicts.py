"""HCCL's own verdicts on a failed collective, read from an Ascend rank's output and plog (HCCL_DFS_CONFIG turns
its detection on: daemon/processes/run_files.py). Pure: text in, verdicts out.

With cluster heartbeat and stuck detection on, every rank's log names the fault's root — the rank that stopped,
hung, or lost its network — whichever rank reports it (CANN's HCCL user guide, "cluster fault location"):

    [ERROR] HCCL(835695,python):2025-10-23-17:28:06.049.385 [task_exception_handler.cc:610][835695]Cluster
    Exception Location[IP/ID]:[127.10.0.1/1], Arrival Time:[Thu Oct 23 17:25:58 2025], Discoverer:[127.10.0.1/2],
    ExceptionType:[Heartbeat Lost Occurred], Possible Reason:1. Process has exited, 2. Network Disconnected

    [INFO] HCCL(686,python):... [heartbeat.cc:951] [8970][HCCL_TRACE]rank [127.10.0.1/1]: rank [127.10.0.1/9]
    status[LOST] by rank [127.10.0.1/1]

and the error codes of a collective that timed out or a link that never formed: EI0002 (a notify wait timed
out: a rank did not reach the collective), EI0006 ("wait socket establish timeout"), EI0015 (ranks that never
reached the server: "topo exchange server get socket timeout"). The daemon puts what it finds in the incident
(`hccl`), so the culprit HCCL named is there beside the daemon's own phase-board verdict.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable

_LOCATION = re.compile(r"Cluster Exception Location\[IP/ID\]:\[(?P<ip>[^/\]]*)/(?P<rank>\d+)\]")
_DISCOVERER = re.compile(r"Discoverer:\[[^/\]]*/(?P<rank>\d+)\]")
_TYPE = re.compile(r"ExceptionType:\[(?P<type>[^\]]+)\]")
_REASON = re.compile(r"Possible Reason:(?P<reason>.*)")
_TRACE = re.compile(r"rank \[[^/\]]*/\d+\]: rank \[(?P<ip>[^/\]]*)/(?P<rank>\d+)\] "
                    r"status\[(?P<status>[A-Z_]+)\] by rank \[[^/\]]*/(?P<by>\d+)\]")
# codes whose lines say something a reader needs, with what they mean
_CODES = {
    "EI0002": "a collective timed out waiting for a rank (HCCL_EXEC_TIMEOUT): one rank did not reach it",
    "EI0006": "a link between ranks was not set up in time (HCCL_CONNECT_TIMEOUT)",
    "EI0015": "some ranks never reached the communicator's server",
}
_CODE_TEXT = {"wait socket establish timeout": "EI0006", "topo exchange server get socket timeout": "EI0015",
              "Notify register has not received the Notify record": "EI0002"}
_STATUS = {"LOST": "Heartbeat Lost Occurred", "STUCK": "Stuck Occurred", "CQE_ERR": "Error cqe Occurred"}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One fault HCCL located: the root rank (its id in the communicator) and what happened to it."""
    rank: int
    address: str
    exception: str                  # "Heartbeat Lost Occurred", "Stuck Occurred", "Error cqe Occurred", or a code
    discoverer: int | None = None
    reason: str = ""

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, "")}


def verdicts(lines: Iterable[str]) -> list[Verdict]:
    """Every distinct located fault in `lines` (the Cluster Exception lines first, then the heartbeat traces
    that name a root no such line did), then each error code seen once (rank -1: HCCL names no rank there)."""
    located: dict[tuple[int, str], Verdict] = {}
    traced: dict[tuple[int, str], Verdict] = {}
    codes: dict[str, Verdict] = {}
    for line in lines:
        if (m := _LOCATION.search(line)) is not None:
            by, kind, why = _DISCOVERER.search(line), _TYPE.search(line), _REASON.search(line)
            v = Verdict(rank=int(m["rank"]), address=m["ip"], exception=kind["type"].strip() if kind else "unknown",
                        discoverer=int(by["rank"]) if by else None,
                        reason=why["reason"].strip().rstrip(".") if why else "")
            located.setdefault((v.rank, v.exception), v)
        elif (m := _TRACE.search(line)) is not None:
            exception = _STATUS.get(m["status"], m["status"])
            traced.setdefault((int(m["rank"]), exception),
                              Verdict(rank=int(m["rank"]), address=m["ip"], exception=exception,
                                      discoverer=int(m["by"])))
        else:
            code = next((c for c in _CODES if c in line), None) or next(
                (c for text, c in _CODE_TEXT.items() if text in line), None)
            if code is not None:
                codes.setdefault(code, Verdict(rank=-1, address="", exception=code, reason=_CODES[code]))
    out = list(located.values())
    out += [v for key, v in traced.items() if key not in located]
    return out + list(codes.values())


def culprits(found: Iterable[Verdict]) -> list[int]:
    """The ranks HCCL blames, in the order found."""
    return list(dict.fromkeys(v.rank for v in found if v.rank >= 0))
