"""Which machine keeps a copy of which machine's RAM-tier part (checkpoint.memory_placement = "buddy").

Gemini's placement: each member's part is copied to one other member, in another failure domain where
run.failure_domains names them (machines that share a rack, a switch or a power feed are lost together: a copy
beside the original is lost with it), else the next member. Members are a generation's, in its order; the
buddy is the first member after it (cyclically) in another domain, so with domains of equal size the copies
spread evenly and no machine holds more than a few. Pure.
"""
from __future__ import annotations

from typing import Sequence


def holders(members: Sequence[int], domains: Sequence[str] = ()) -> dict[int, int]:
    """{member: the member that keeps a copy of its part}; `domains`: run.failure_domains by node (empty: each
    machine its own). One member: none."""
    if len(members) < 2:
        return {}
    domain = (lambda n: domains[n] if n < len(domains) else f"node-{n}") if domains else (lambda n: f"node-{n}")
    out = {}
    for i, node in enumerate(members):
        after = [members[(i + k) % len(members)] for k in range(1, len(members))]
        out[node] = next((m for m in after if domain(m) != domain(node)), after[0])
    return out


def kept_by(node: int, members: Sequence[int], domains: Sequence[str] = ()) -> list[int]:
    """The members whose part `node` keeps a copy of."""
    return [m for m, holder in holders(members, domains).items() if holder == node]
