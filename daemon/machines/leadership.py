"""The leadership core of a multi-node run, pure: who decides, when a machine campaigns, when a decider
is deposed or resigns, which machines a generation gathers, and when the run gives up.

Everything here is a function of what etcd said (a `View`: the coordinator's mirror, as of one moment),
this daemon's own identity (`Me`), the run's settings (`Rules`) and `now`; it returns the next `Role`
and the `Effect`s the driver carries out (campaign, lead, resign, follow, wait, give up). No etcd, no
clock, no sleeps: daemon.machines.coordinator (the election, leases and fencing against etcd) and
daemon.machines.membership (joining, waiting, the decider's gathering) are its thin driver. A role is
an Enum with a table of allowed transitions (`TRANSITIONS`), and an illegal one raises.

The election (etcd's pattern): the decider holds the `leader` key, created only where absent and bound
to its lease; the key's create_revision, as this daemon won it, is the fencing token every write that
acts on the run compares. When no leader key stands, the lowest-ranked live machine campaigns at once
and the others once every lower-ranked machine has been absent a while: two lease TTLs for one never
seen (a run starting: its daemon may still be booting), `prefer_lower_s` for one seen leaving (a lease
that expired is a machine gone). Quarantined machines (`passed_over`) neither campaign nor are waited for.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Mapping


class Role(enum.Enum):
    FOLLOWER = "follower"       # another decides, or none yet and a lower-ranked machine goes first
    CANDIDATE = "candidate"     # no decider, and this machine's turn: it campaigns
    LEADER = "leader"           # this daemon decides (its key stands, its lease renewed within the TTL)
    RESIGNED = "resigned"       # its machine is quarantined and another can decide: it stepped down
    CUT_OFF = "cut_off"         # etcd silent past run.coordinator_timeout_s: the run stops here (exit 75)


TRANSITIONS: dict[Role, frozenset[Role]] = {
    Role.FOLLOWER: frozenset({Role.FOLLOWER, Role.CANDIDATE, Role.LEADER, Role.CUT_OFF}),
    Role.CANDIDATE: frozenset({Role.CANDIDATE, Role.LEADER, Role.FOLLOWER, Role.CUT_OFF}),
    Role.LEADER: frozenset({Role.LEADER, Role.FOLLOWER, Role.CANDIDATE, Role.RESIGNED, Role.CUT_OFF}),
    Role.RESIGNED: frozenset({Role.RESIGNED, Role.FOLLOWER, Role.CANDIDATE, Role.LEADER, Role.CUT_OFF}),
    Role.CUT_OFF: frozenset({Role.CUT_OFF}),
}


class IllegalTransitionError(RuntimeError):
    """A role changed in a way the table does not allow: a defect in the core, never an input's fault."""


def check_transition(before: Role, after: Role) -> Role:
    if after not in TRANSITIONS[before]:
        raise IllegalTransitionError(f"leadership: {before.value} -> {after.value} is not allowed")
    return after


@dataclasses.dataclass(frozen=True)
class LeaderKey:
    """The `leader` key as the mirror holds it."""
    node: int
    daemon: str                 # the daemon that wrote it (a uuid per daemon process)
    create_revision: int        # the fencing token of whoever holds it
    lease: int


@dataclasses.dataclass(frozen=True)
class View:
    """What etcd said, as of `now`: the coordinator's mirror."""
    live: frozenset[int]                    # machines whose liveness key stands
    leader: LeaderKey | None
    seen: frozenset[int] = frozenset()      # machines this daemon has ever seen live
    absent_since: Mapping[int, float] = dataclasses.field(default_factory=dict)   # not live, since when
    contact_at: float = 0.0                 # etcd last answered
    renewed_at: float = 0.0                 # this daemon's lease was last renewed (the renewal's send time)


@dataclasses.dataclass(frozen=True)
class Me:
    node: int
    daemon: str
    lease: int                  # 0: none granted yet
    token: int = 0              # the leader key's create_revision as this daemon won it; 0: it never did


@dataclasses.dataclass(frozen=True)
class Rules:
    nodes: int                          # run.nodes
    ttl_s: float                        # run.node_lease_ttl_s
    quorum: int                         # run.min_nodes (resolved)
    coordinator_timeout_s: float        # run.coordinator_timeout_s
    join_timeout_s: float = 0.0         # run.node_join_timeout_s: a fresh run's first generation
    rejoin_timeout_s: float = 0.0       # run.node_rejoin_timeout_s: later generations
    prefer_lower_s: float = 0.25        # a lower-ranked machine seen leaving: how long it may come back first


# Effects: what the driver does ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Campaign:
    """Try to create the leader key (absent only), bound to this daemon's lease."""


@dataclasses.dataclass(frozen=True)
class Lead:
    """This daemon decides: its writes go fenced by `token`."""
    token: int


@dataclasses.dataclass(frozen=True)
class Resign:
    """Delete this daemon's leader key (fenced): its machine is quarantined and another can decide."""


@dataclasses.dataclass(frozen=True)
class Follow:
    """Another machine decides: apply what it publishes."""
    node: int


@dataclasses.dataclass(frozen=True)
class Wait:
    """Nothing to do yet: `reason` says for what."""
    reason: str


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """The run cannot go on from here: `code` is the exit code (contracts.protocol.ExitCode's value)."""
    code: int
    reason: str


Effect = Campaign | Lead | Resign | Follow | Wait | GiveUp
TEMP_FAIL, CONFIG_ERROR = 75, 78        # contracts.protocol.ExitCode.TEMP_FAIL / CONFIG_ERROR


@dataclasses.dataclass(frozen=True)
class Step:
    role: Role
    token: int                  # the fencing token after this step (0: none)
    effects: tuple[Effect, ...]
    deposed: bool = False       # it decided before this step and no longer does


# The rules -------------------------------------------------------------------------------------------------
def is_ours(key: LeaderKey | None, me: Me) -> bool:
    """A leader key this daemon wrote with its current lease: a key naming this machine but written by
    another daemon (its predecessor on this machine, or a second machine given the same node rank) is not."""
    return key is not None and bool(me.lease) and key.lease == me.lease and key.daemon == me.daemon


def holds(view: View, me: Me, now: float, rules: Rules) -> tuple[bool, int]:
    """(this daemon decides now, its fencing token after looking). It decides while its own leader key stands
    with the token it won, and its lease was renewed within the TTL (etcd may already have expired it
    otherwise: unsure, it does not decide until renewed). A leader key with another create_revision means
    another won since: deposed, the token is dropped."""
    token = me.token
    if is_ours(view.leader, me):
        token = view.leader.create_revision        # its own key, whose campaign's answer was lost
    if not token or view.leader is None:           # not seen (a mirror behind): unsure, the token stands
        return False, token
    if view.leader.create_revision != token:
        return False, 0
    return now - view.renewed_at <= rules.ttl_s, token


def absent_for(view: View, node: int, now: float) -> float:
    """How long `node` has been absent in this daemon's view (0 for a live one, or one first missed now)."""
    if node in view.live:
        return 0.0
    return max(0.0, now - view.absent_since.get(node, now))


def turn_to_campaign(view: View, me: Me, now: float, rules: Rules, passed_over: frozenset[int] = frozenset()) -> bool:
    """No leader key stands, this machine is live and not passed over, and every lower-ranked machine that
    is not passed over has been absent long enough (two TTLs if never seen, prefer_lower_s if seen leaving)."""
    if view.leader is not None or me.node in passed_over or me.node not in view.live:
        return False
    for n in range(me.node):
        if n in passed_over:
            continue
        wait_s = rules.prefer_lower_s if n in view.seen else max(rules.prefer_lower_s, 2.0 * rules.ttl_s)
        if n in view.live or absent_for(view, n, now) < wait_s:
            return False
    return True


def is_cut_off(view: View, now: float, rules: Rules) -> bool:
    return now - view.contact_at > rules.coordinator_timeout_s


def step(role: Role, view: View, me: Me, now: float, rules: Rules, passed_over: frozenset[int] = frozenset()) -> Step:
    """One look at the run: the role after it, the fencing token and what to do. A quarantined decider
    resigns when a machine that is not quarantined is live to decide instead; with none it stays (and
    the caller says so)."""
    if role is Role.CUT_OFF or is_cut_off(view, now, rules):
        silent = now - view.contact_at
        return Step(check_transition(role, Role.CUT_OFF), 0, (GiveUp(TEMP_FAIL, (
            f"etcd has been unreachable for {silent:.1f} s, more than run.coordinator_timeout_s = "
            f"{rules.coordinator_timeout_s:g} s")),))
    decides, token = holds(view, me, now, rules)
    if decides:
        if me.node in passed_over and view.live - passed_over - {me.node}:
            return Step(check_transition(role, Role.RESIGNED), token, (Resign(),))
        return Step(check_transition(role, Role.LEADER), token, (Lead(token),))
    deposed = role is Role.LEADER
    if view.leader is not None and not is_ours(view.leader, me):
        return Step(check_transition(role, Role.FOLLOWER), token, (Follow(view.leader.node),), deposed)
    if view.leader is not None:        # its own key, unrenewed past the TTL: not deciding until renewed
        return Step(check_transition(role, Role.FOLLOWER), token,
                    (Wait("this daemon's lease went unrenewed past the TTL"),), deposed)
    if turn_to_campaign(view, me, now, rules, passed_over):
        return Step(check_transition(role, Role.CANDIDATE), 0, (Campaign(),), deposed)
    after = Role.RESIGNED if role is Role.RESIGNED else Role.FOLLOWER
    return Step(check_transition(role, after), 0, (Wait(_why_not_campaigning(view, me, passed_over)),), deposed)


def _why_not_campaigning(view: View, me: Me, passed_over: frozenset[int]) -> str:
    if me.node in passed_over:
        return "this machine is quarantined: it does not decide"
    if me.node not in view.live:
        return "this machine's liveness key is not seen yet"
    lower = sorted(n for n in range(me.node) if n not in passed_over)
    return f"no decider; lower-ranked machines {lower} campaign first"


# The decider's gathering -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Gathering:
    """What the decider gathers for a generation: `members` (None: keep waiting, since `waiting_since`),
    or `give_up`."""
    members: tuple[int, ...] | None
    waiting_since: float | None
    give_up: GiveUp | None = None


def gather(live: frozenset[int] | set[int], now: float, rules: Rules, *, waiting_since: float | None,
           first_generation: bool) -> Gathering:
    """Every machine; or, once the decider has waited with some missing — run.node_join_timeout_s for a fresh
    run's first generation (machines boot at different times), else run.node_rejoin_timeout_s (a lost
    machine's return) — the live ones if they are at least run.min_nodes, else the run gives up."""
    present = tuple(sorted(n for n in live if 0 <= n < rules.nodes))
    if len(present) == rules.nodes:
        return Gathering(present, None)
    since = now if waiting_since is None else waiting_since
    knob, limit_s = (("run.node_join_timeout_s", rules.join_timeout_s) if first_generation
                     else ("run.node_rejoin_timeout_s", rules.rejoin_timeout_s))
    if now - since < limit_s:
        return Gathering(None, since)
    if len(present) >= rules.quorum:
        return Gathering(present, None)
    return Gathering(None, since, GiveUp(TEMP_FAIL, (
        f"only {len(present)} of run.nodes = {rules.nodes} nodes are up (nodes {list(present)}) after {knob} "
        f"= {limit_s:g} s, fewer than run.min_nodes = {rules.quorum}")))


@dataclasses.dataclass(frozen=True)
class Members:
    """A generation's machines once the quarantined sit out: `members`, those `left_out`, whether the decider
    must `resign` first (its own machine is quarantined and another can decide) or stays though quarantined
    (`deferred`: no one else can decide), or `give_up`."""
    members: tuple[int, ...]
    left_out: tuple[int, ...] = ()
    resign: bool = False
    deferred: bool = False
    give_up: GiveUp | None = None


def without_quarantined(gathered: tuple[int, ...], quarantined: frozenset[int] | set[int], me: Me,
                        rules: Rules) -> Members:
    held = set(quarantined) & set(gathered)
    deferred = False
    if me.node in held:
        if set(gathered) - held:
            return Members(gathered, resign=True)
        held.discard(me.node)
        deferred = True
    members = tuple(m for m in gathered if m not in held)
    if held and len(members) < rules.quorum:
        return Members(members, tuple(sorted(held)), deferred=deferred, give_up=GiveUp(CONFIG_ERROR, (
            f"nodes {sorted(held)} are quarantined and the {len(members)} left are fewer than run.min_nodes "
            f"= {rules.quorum}; replace them, or take them back by removing their entries from the lemon list "
            "(state.json `lemons`)")))
    return Members(members, tuple(sorted(held)), deferred=deferred)
