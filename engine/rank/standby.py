"""A warm standby rank: started while the previous generation still trains, it imports MindSpore and
forms its generation's cluster, then waits for the supervisor to make it a rank. A late one (several
machines: the next generation's scheduler is not known yet) imports and waits, and forms the cluster
once activated, on the usual path.

Owns: the worker's half of a standby (the supervisor's is daemon/processes/standby.py). A
restart then skips what dominates it on CPU: the interpreter and MindSpore's
import and the dynamic cluster's formation (a fixed sleep inside MindSpore's CPU
collectives among it; the figures are bench/recovery.py's, in the README).
"""
from __future__ import annotations

import os
import sys

from contracts.config import Config
from contracts.protocol import (
    ENV_EVENT_SOCKET,
    ENV_GENERATION,
    ENV_STANDBY_LATE,
    PhaseEvent,
    await_activation,
    take_environment,
)
from engine.rank import runtime, startup
from contracts.event_sink import EventSink
from engine.training.gradient_sum import local_group


def hold(cfg: Config, fd: int) -> None:
    """Forms the cluster (a late standby: only imports), then blocks until activated: takes the
    activation's environment as this process's and restarts the start-up clock. Retired (the pipe closed): exits 0 at once, without
    MindSpore's finalisation, which would wait for a cluster that is going away."""
    spawned = set(os.environ)                  # what the supervisor gave; MindSpore may add its own
    if os.environ.get(ENV_STANDBY_LATE) == "1":
        import mindspore  # noqa: F401  (what a late standby saves: the imports, not the cluster)

        from engine.rank import trainer  # noqa: F401

        group = local_group()         # a local group across machines names its rank itself
        rank = group.rank if group is not None else int(os.environ.get("MS_NODE_ID", "0"))
    else:
        rank = runtime.setup(cfg).rank
    ready = PhaseEvent(rank=rank, generation=int(os.environ.get(ENV_GENERATION, "0")), phase="standby")
    EventSink(sys.stdout, os.environ.get(ENV_EVENT_SOCKET)).emit(ready, log=False)     # to the supervisor
    env = await_activation(fd)
    if env is None:
        sys.stdout.flush()
        os._exit(0)
    take_environment(env, spawned)
    startup.restart()
