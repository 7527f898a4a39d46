"""A rank's stop request by signal: SIGTERM or SIGINT set a flag the step loop feeds into the next step.

Owns: what a repeated signal means. stdlib only (the fast tests run it where
MindSpore cannot be imported).

A second SIGINT — Ctrl-C pressed twice at a terminal — exits at once, as
people expect. A repeated SIGTERM does not, because none of its usual senders
is a person asking twice, and exiting on it throws away the save the first one
asked for:
- the kernel's parent-death signal (daemon/processes/generation.py) is sent each time
  the rank is reparented: a daemon killed with SIGKILL dies thread by thread,
  and a child of one thread is handed to the next live one, with the signal
  again (prctl(2); measured: 2 to 17 SIGTERMs to a child of a 16-thread
  parent, and 2 to the ranks of a killed daemon, one kill in three);
- MindSpore's cluster SIGTERMs a rank once a peer has exited (cluster/init.cc,
  "Kill this process with SIGTERM"): after a stop, the first rank done
  triggers it in the others while they still write their shards.
Whoever must end a rank now sends SIGKILL (the supervisor does after its grace,
systemd after TimeoutStopSec).
"""
from __future__ import annotations

import os
import signal


class StopSignal:
    """Installs the handlers; `requested` turns true at the first SIGTERM or SIGINT."""

    def __init__(self) -> None:
        self.requested = False
        self.signals = 0                   # how many arrived (a repeated SIGTERM is counted, not obeyed)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signals += 1
        if self.requested and signum == signal.SIGINT:
            os._exit(128 + signum)
        self.requested = True
