"""The leadership core (daemon.machines.leadership), fed literal times and etcd snapshots: no etcd, no sleeps.

Each case is a scene of a multi-node run as one daemon sees it: who is live, who holds the leader key,
since when a machine is gone, when etcd last answered and when this daemon's lease was last renewed."""
import pytest

from daemon.machines import leadership as L
from daemon.machines.leadership import (
    Campaign,
    Follow,
    GiveUp,
    Lead,
    LeaderKey,
    Me,
    Resign,
    Role,
    Rules,
    View,
    Wait,
)

pytestmark = pytest.mark.unit

RULES = Rules(nodes=3, ttl_s=5.0, quorum=2, coordinator_timeout_s=30.0, join_timeout_s=60.0, rejoin_timeout_s=10.0,
              prefer_lower_s=0.25)


def me(node: int, *, token: int = 0) -> Me:
    """Node n's daemon holds lease 100 + n, as the keys below are written by default."""
    return Me(node=node, daemon=f"daemon-{node}", lease=100 + node, token=token)


def key(node: int, revision: int, *, daemon: str | None = None, lease: int | None = None) -> LeaderKey:
    return LeaderKey(node=node, daemon=daemon or f"daemon-{node}", create_revision=revision,
                     lease=100 + node if lease is None else lease)


def view(live, leader=None, *, seen=(), absent=None, contact=0.0, renewed=0.0) -> View:
    return View(live=frozenset(live), leader=leader, seen=frozenset(seen), absent_since=absent or {},
                contact_at=contact, renewed_at=renewed)


# (what it was, the view, this daemon, now, quarantined) -> (the role after, its first effect)
SCENES = {
    # a fresh start with a slow lower-ranked machine: node 1 is up first; node 0 has never been seen
    "fresh start: node 0 not up yet, node 1 lets it campaign first (two TTLs)":
        (Role.FOLLOWER, view({1}, absent={0: 0.0}, contact=9.0, renewed=9.0), me(1), 9.0, set(),
         Role.FOLLOWER, Wait),
    "fresh start: node 0 never came within two TTLs, node 1 campaigns":
        (Role.FOLLOWER, view({1}, absent={0: 0.0}, contact=10.5, renewed=10.5), me(1), 10.5, set(),
         Role.CANDIDATE, Campaign),
    "fresh start: node 0 came up late, node 1 waits for it to campaign":
        (Role.FOLLOWER, view({0, 1}, seen={0, 1}, contact=3.0, renewed=3.0), me(1), 3.0, set(),
         Role.FOLLOWER, Wait),
    "fresh start: node 0 campaigns at once":
        (Role.FOLLOWER, view({0, 1}, contact=0.1, renewed=0.1), me(0), 0.1, set(), Role.CANDIDATE, Campaign),
    "fresh start: node 0 won; node 1 follows it":
        (Role.FOLLOWER, view({0, 1}, key(0, 7), contact=0.2, renewed=0.2), me(1), 0.2, set(), Role.FOLLOWER, Follow),
    "node 0 won: its key with its token, lease renewed": (Role.CANDIDATE, view({0, 1}, key(0, 7), contact=1, renewed=1),
                                                           me(0, token=7), 1.0, set(), Role.LEADER, Lead),
    "node 0's campaign answer was lost: its own key seen in the mirror, it decides":
        (Role.CANDIDATE, view({0, 1}, key(0, 7), contact=1, renewed=1), me(0), 1.0, set(), Role.LEADER, Lead),
    # the decider lost: node 0's lease expired at t=20 (its keys deleted), the survivors elect the next one
    "decider lost: node 1 lets it come back for prefer_lower_s":
        (Role.FOLLOWER, view({1, 2}, seen={0, 1, 2}, absent={0: 20.0}, contact=20.1, renewed=20.1), me(1), 20.1, set(),
         Role.FOLLOWER, Wait),
    "decider lost: then node 1 campaigns":
        (Role.FOLLOWER, view({1, 2}, seen={0, 1, 2}, absent={0: 20.0}, contact=20.3, renewed=20.3), me(1), 20.3,
         set(), Role.CANDIDATE, Campaign),
    "decider lost: node 2 waits while node 1 is live":
        (Role.FOLLOWER, view({1, 2}, seen={0, 1, 2}, absent={0: 20.0}, contact=25.0, renewed=25.0), me(2), 25.0,
         set(), Role.FOLLOWER, Wait),
    "decider and node 1 lost: node 2 campaigns":
        (Role.FOLLOWER, view({2}, seen={0, 1, 2}, absent={0: 20.0, 1: 20.0}, contact=21, renewed=21), me(2), 21.0,
         set(), Role.CANDIDATE, Campaign),
    # a partitioned decider: its lease unrenewed past the TTL (etcd may have expired it), then another won
    "partitioned decider: unrenewed past the TTL, it stops deciding":
        (Role.LEADER, view({0, 1, 2}, key(0, 7), contact=10.0, renewed=4.0), me(0, token=7), 10.0, set(),
         Role.FOLLOWER, Wait),
    "partitioned decider: renewed within the TTL, it still decides":
        (Role.LEADER, view({0, 1, 2}, key(0, 7), contact=8.0, renewed=4.0), me(0, token=7), 8.0, set(),
         Role.LEADER, Lead),
    "partitioned decider: another leader key seen, deposed":
        (Role.LEADER, view({0, 1, 2}, key(1, 12), contact=30.0, renewed=29.0), me(0, token=7), 30.0, set(),
         Role.FOLLOWER, Follow),
    "deposed decider: its key gone, it is still the lowest and campaigns again":
        (Role.LEADER, view({0, 1, 2}, contact=30.0, renewed=29.0), me(0, token=7), 30.0, set(),
         Role.CANDIDATE, Campaign),
    # an impostor: a leader key that names this machine but was written by another daemon
    "impostor: a key naming node 0 by another daemon (a second machine given rank 0) is followed, not held":
        (Role.FOLLOWER, view({0, 1}, key(0, 9, daemon="someone-else", lease=555), contact=1, renewed=1), me(0),
         1.0, set(), Role.FOLLOWER, Follow),
    "impostor: the previous daemon's key on this machine (another lease) is not this daemon's":
        (Role.FOLLOWER, view({0, 1}, key(0, 9, lease=99), contact=1, renewed=1), me(0), 1.0, set(),
         Role.FOLLOWER, Follow),
    # a quarantined decider
    "quarantined decider: another machine can decide, it resigns":
        (Role.LEADER, view({0, 1, 2}, key(0, 7), contact=5, renewed=5), me(0, token=7), 5.0, {0},
         Role.RESIGNED, Resign),
    "quarantined decider: no one else is live, it stays":
        (Role.LEADER, view({0}, key(0, 7), contact=5, renewed=5), me(0, token=7), 5.0, {0}, Role.LEADER, Lead),
    "quarantined decider resigned: it does not campaign again":
        (Role.RESIGNED, view({0, 1, 2}, seen={0, 1, 2}, contact=6, renewed=6), me(0), 6.0, {0}, Role.RESIGNED, Wait),
    "quarantined node 0 is passed over: node 1 campaigns at once":
        (Role.FOLLOWER, view({0, 1, 2}, seen={0, 1, 2}, contact=6, renewed=6), me(1), 6.0, {0},
         Role.CANDIDATE, Campaign),
    # etcd unreachable
    "etcd silent past run.coordinator_timeout_s: a decider gives up (75)":
        (Role.LEADER, view({0, 1}, key(0, 7), contact=10.0, renewed=10.0), me(0, token=7), 40.5, set(),
         Role.CUT_OFF, GiveUp),
    "etcd silent past the timeout: a follower gives up too":
        (Role.FOLLOWER, view({0, 1}, key(0, 7), contact=10.0, renewed=10.0), me(1), 40.5, set(), Role.CUT_OFF, GiveUp),
    "etcd silent, within the timeout: a decider unrenewed past the TTL does not decide, nor gives up":
        (Role.LEADER, view({0, 1}, key(0, 7), contact=10.0, renewed=10.0), me(0, token=7), 39.0, set(),
         Role.FOLLOWER, Wait),
}


@pytest.mark.parametrize("scene", SCENES)
def test_one_look_at_the_run(scene):
    before, v, who, now, quarantined, after, effect = SCENES[scene]
    step = L.step(before, v, who, now, RULES, frozenset(quarantined))
    assert step.role is after
    assert type(step.effects[0]) is effect, step.effects
    assert step.deposed is (before is Role.LEADER and after not in (Role.LEADER, Role.RESIGNED, Role.CUT_OFF))


def test_a_decider_leads_with_the_token_it_won_and_drops_it_when_another_wins():
    won = L.step(Role.CANDIDATE, view({0, 1}, key(0, 7), contact=1, renewed=1), me(0), 1.0, RULES)
    assert won.effects == (Lead(7),) and won.token == 7
    deposed = L.step(Role.LEADER, view({0, 1}, key(1, 12), contact=2, renewed=2), me(0, token=7), 2.0, RULES)
    assert deposed.token == 0 and deposed.effects == (Follow(1),) and deposed.deposed


def test_a_mirror_behind_keeps_the_token_but_does_not_decide_on_it():
    """Right after its campaign won, the mirror may not hold the key yet: the token stands, it does not decide."""
    decides, token = L.holds(view({0}, None, renewed=1), me(0, token=7), 1.0, RULES)
    assert (decides, token) == (False, 7)


def test_an_illegal_transition_raises():
    with pytest.raises(L.IllegalTransitionError):
        L.check_transition(Role.CUT_OFF, Role.LEADER)
    with pytest.raises(L.IllegalTransitionError):
        L.check_transition(Role.FOLLOWER, Role.RESIGNED)


def test_the_cut_off_is_final():
    step = L.step(Role.CUT_OFF, view({0, 1}, key(0, 7), contact=50, renewed=50), me(0, token=7), 50.0, RULES)
    assert step.role is Role.CUT_OFF and isinstance(step.effects[0], GiveUp) and step.effects[0].code == 75


# The decider's gathering: (live, now, waiting since, first generation) -> (members, still waiting since, gives up)
GATHERINGS = {
    "every machine is up: all of them, at once": ({0, 1, 2}, 0.0, None, True, (0, 1, 2), None, False),
    "a fresh run, node 2 booting: wait (run.node_join_timeout_s)": ({0, 1}, 5.0, None, True, None, 5.0, False),
    "a fresh run, node 2 still missing at the join timeout: go on with two": ({0, 1}, 65.0, 5.0, True, (0, 1), None,
                                                                             False),
    "a later generation waits run.node_rejoin_timeout_s only": ({0, 1}, 16.0, 5.0, False, (0, 1), None, False),
    "a later generation, within the rejoin timeout: still waiting": ({0, 1}, 14.0, 5.0, False, None, 5.0, False),
    "fewer machines than run.min_nodes after the timeout: the run gives up": ({0}, 16.0, 5.0, False, None, 5.0, True),
    "fewer than run.min_nodes, within the timeout: waiting": ({0}, 6.0, 5.0, False, None, 5.0, False),
    "a node rank outside the run is not a member": ({0, 1, 2, 7}, 0.0, None, False, (0, 1, 2), None, False),
}


@pytest.mark.parametrize("case", GATHERINGS)
def test_the_decider_gathers_its_machines(case):
    live, now, since, first, members, waiting, gives_up = GATHERINGS[case]
    got = L.gather(live, now, RULES, waiting_since=since, first_generation=first)
    assert got.members == members and got.waiting_since == waiting
    assert (got.give_up is not None) is gives_up
    if gives_up:
        assert got.give_up.code == 75 and "run.min_nodes = 2" in got.give_up.reason
        assert "run.node_rejoin_timeout_s = 10 s" in got.give_up.reason


# The quarantined sit out: (gathered, quarantined, this node) -> (members, left out, resign, deferred, gives up)
QUARANTINES = {
    "nobody quarantined": ((0, 1, 2), set(), 0, (0, 1, 2), (), False, False, False),
    "node 2 sits out its probation": ((0, 1, 2), {2}, 0, (0, 1), (2,), False, False, False),
    "the decider's own machine, another can decide: it resigns first": ((0, 1, 2), {0}, 0, (0, 1, 2), (), True,
                                                                        False, False),
    "the decider's own machine and no one else: it stays, deferred": ((0,), {0}, 0, (0,), (), False, True, False),
    "too few left after the quarantine: the run gives up (78)": ((0, 1, 2), {1, 2}, 0, (0,), (1, 2), False, False,
                                                                  True),
    "a quarantined machine that is not gathered changes nothing": ((0, 1), {2}, 0, (0, 1), (), False, False, False),
}


@pytest.mark.parametrize("case", QUARANTINES)
def test_quarantined_machines_sit_out_a_generation(case):
    gathered, held, node, members, left_out, resign, deferred, gives_up = QUARANTINES[case]
    got = L.without_quarantined(gathered, frozenset(held), me(node), RULES)
    assert (got.members, got.left_out, got.resign, got.deferred) == (members, left_out, resign, deferred)
    assert (got.give_up is not None) is gives_up
    if gives_up:
        assert got.give_up.code == 78
