"""How the daemons of a multi-node run act as one, through etcd (one run: keys under run.key_prefix).

Owns the run's keys and what each means:

    identity          the run: {run_id, trajectory}: a daemon of another run (another run directory,
                      another trajectory) is refused before it writes a key (daemon.machines.membership)
    nodes/<n>         node n's daemon is alive: {node, addr, host, pid, daemon}, bound to its lease
                      (TTL run.node_lease_ttl_s); one daemon per node rank
    leader            the decider: {node, addr, daemon}, created only where absent and bound to the
                      decider's lease (etcd's election pattern); its create_revision is the fencing
                      token that every write acting on the run compares, so a deposed decider, or one
                      that only believes it decides, writes nothing
    generation        {number, members, addr, port, resume_step, config_changes}: the decider's, fenced
    end/<g>           why generation g ends: the first node to know writes it (create-only), every
                      node tears its ranks down when it appears
    decision/<g>      the decider's recovery decision for the incident that ended g: fenced
    held/<n>          the RAM-tier steps node n holds once its ranks of generation `after` are gone
                      {after, steps, url, taken[, fetching | failed]}, bound to its lease: the decider
                      resumes from the newest all members hold (daemon.machines.memory_agreement)
    take/<n>          the decider asks node n to take RAM step {generation, step, urls} from a peer
                      (daemon.machines.ram_peers) before the next generation
    requests/<id>     an operator request dropped on any node; the decider takes it (a fenced delete)
    run               how the run ended {code, status, run_id}, by the decider (fenced): the others follow

The election, the leases and the fencing that act on these keys are daemon.machines.coordinator's;
when a machine campaigns, decides or is deposed is daemon.machines.leadership's (pure).
"""
from __future__ import annotations

import json
from typing import Any

from daemon.machines.etcd_client import EtcdError


class NotLeaderError(EtcdError):
    """A fenced write was refused: this daemon no longer decides for the run."""


def node_of(key: str) -> int | None:
    """The node whose liveness key `key` (after the prefix) is: nodes/<n>; None for any other key."""
    name, _, rest = key.partition("/")
    return int(rest) if name == "nodes" and rest.isdigit() else None


def decode(value: bytes) -> Any:
    """A stored value as JSON; None when it is not JSON."""
    try:
        return json.loads(value)
    except ValueError:
        return None
