"""The etcd client against a real etcd: keys, compare-and-swap, leases that expire, watches, and an
etcd that is gone or frozen (an error in bounded time, never a hang)."""
import threading
import time

import pytest

from daemon.machines.etcd_client import Etcd, EtcdUnavailableError, prefix_end
from tests.etcd_server import EtcdServer


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd").start()
    yield server
    server.stop()


def test_keys_round_trip_and_a_prefix_reads_only_its_own_keys(etcd):
    c = Etcd.from_url(etcd.url)
    c.put("/run/a/x", "1")
    c.put("/run/a/y", b"\xff\x00")
    c.put("/run/ab", "not under /run/a/")
    kvs, revision = c.get_prefix("/run/a/")
    assert [(kv.key, kv.value) for kv in kvs] == [(b"/run/a/x", b"1"), (b"/run/a/y", b"\xff\x00")]
    assert revision >= kvs[-1].mod_revision
    assert c.delete_prefix("/run/a/") == 2 and c.get("/run/a/x") is None and c.get("/run/ab").value == b"not under /run/a/"


def test_compare_and_swap_lets_exactly_one_of_many_writers_win(etcd):
    c = Etcd.from_url(etcd.url)
    wins = []
    threads = [threading.Thread(target=lambda i=i: wins.append(i) if c.put_if("/gen", f"node {i}", mod_revision=0)
                                else None) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and c.get("/gen").value == f"node {wins[0]}".encode()
    current = c.get("/gen")
    assert c.put_if("/gen", "next", mod_revision=current.mod_revision)
    assert not c.put_if("/gen", "stale", mod_revision=current.mod_revision)     # a writer that read too early
    assert c.get("/gen").value == b"next"


def test_a_lease_not_kept_alive_takes_its_keys_with_it(etcd):
    c = Etcd.from_url(etcd.url)
    kept, dropped = c.grant(3), c.grant(3)
    c.put("/nodes/0", "alive", lease=kept)
    c.put("/nodes/1", "alive", lease=dropped)
    deadline = time.monotonic() + 60            # etcd expires a lease at its TTL; this only bounds a failure
    while c.get("/nodes/1") is not None:
        assert time.monotonic() < deadline, "the lease not kept alive never expired"
        assert c.keep_alive(kept) > 0
        time.sleep(0.2)
    # the kept lease was granted first with the same TTL: its own expiry has passed too
    assert c.get("/nodes/0") is not None
    assert c.keep_alive(dropped) == 0                    # gone: renewing it says so
    c.revoke(kept)
    assert c.get("/nodes/0") is None
    c.revoke(kept)                                       # twice: nothing to revoke, no error


def test_a_watch_sees_every_change_from_its_revision_and_returns_when_idle(etcd):
    c = Etcd.from_url(etcd.url)
    _, revision = c.get_prefix("/w/")
    c.put("/w/before-the-watch", "1")                    # after the revision read: still seen
    seen, start, changed = [], revision + 1, False
    deadline = time.monotonic() + 60
    while len(seen) < 3:                                 # as the coordinator does: watch again from the next revision
        assert time.monotonic() < deadline, seen
        for batch in c.watch_prefix("/w/", start_revision=start, idle_timeout_s=1.0):
            seen += [(e.type, e.kv.key) for e in batch]
            start = batch[-1].kv.mod_revision + 1
            if not changed:                              # changes made while the watch is open
                c.put("/w/a", "2")
                c.delete_prefix("/w/a")
                c.put("/elsewhere", "x")
                changed = True
    assert seen == [("PUT", b"/w/before-the-watch"), ("PUT", b"/w/a"), ("DELETE", b"/w/a")]
    # with nothing more to come it returns (when idle) rather than blocking: in a thread, so a watch that
    # never returns fails the test instead of hanging it
    rest = []
    idle = threading.Thread(target=lambda: rest.extend(c.watch_prefix("/w/", start_revision=start, idle_timeout_s=1.0)))
    idle.start()
    idle.join(timeout=60)
    assert not idle.is_alive() and rest == []


def test_an_etcd_that_is_gone_or_frozen_is_an_error_in_bounded_time(etcd):
    c = Etcd.from_url(f"etcd://127.0.0.1:1,{etcd.url[len('etcd://'):]}", timeout_s=1.0)
    c.put("/k", "v")                                     # the dead first endpoint is skipped
    etcd.pause()
    started = time.monotonic()
    with pytest.raises(EtcdUnavailableError):
        c.get("/k")
    assert time.monotonic() - started < 30               # an error after timeout_s (1 s), never a hang
    etcd.resume()
    assert c.get("/k").value == b"v"
    etcd.stop()
    with pytest.raises(EtcdUnavailableError, match="unreachable"):
        c.get("/k")


@pytest.mark.parametrize("prefix, end", [(b"/a/", b"/a0"), (b"a\xff", b"b"), (b"\xff\xff", b"\0")])
def test_prefix_end_covers_exactly_the_prefix(prefix, end):
    assert prefix_end(prefix) == end


def _coordinator(etcd, node: int, clock):
    from contracts.config import load_config
    from daemon.machines.coordinator import Coordinator

    cfg = load_config(None, ["run.nodes=2", f"run.node_rank={node}", "parallel.dp=2", "train.micro_batch=4",
                             f'run.coordinator="{etcd.url}"', "run.master_port=29500", "run.node_lease_ttl_s=2"])
    return Coordinator(cfg, Etcd.from_url(etcd.url), clock=clock)


def test_a_decider_seen_leaving_is_replaced_a_second_after_its_key_goes_whichever_daemon_joined_first(etcd):
    """Node 1's daemon joined before node 0's (its first read held no key of node 0): once node 0, the
    decider, is gone, node 1 waits PREFER_LOWER_S from the deletion, not two lease TTLs from its own join."""
    from daemon.machines.coordinator import PREFER_LOWER_S

    now = [1000.0]
    follower = _coordinator(etcd, 1, lambda: now[0])
    follower.join()
    decider = _coordinator(etcd, 0, lambda: now[0])
    decider.join()
    assert decider.campaign(now[0])
    _until(lambda: 0 in follower.live_nodes() and follower.leader() is not None)
    now[0] += 60.0                                   # it has trained a minute
    decider.leave()                                  # its lease revoked: its keys go
    _until(lambda: 0 not in follower.live_nodes() and follower.leader() is None)
    assert not follower.campaign(now[0] + PREFER_LOWER_S / 2)       # a moment for node 0 to come back first
    assert follower.campaign(now[0] + PREFER_LOWER_S + 0.1)         # then node 1 decides
    follower.leave()


def test_a_quarantined_decider_resigns_and_a_live_machine_after_it_decides_at_once_passing_it_over(etcd):
    now = [1000.0]
    decider, follower = _coordinator(etcd, 0, lambda: now[0]), _coordinator(etcd, 1, lambda: now[0])
    decider.join()
    follower.join()
    assert decider.campaign(now[0])
    _until(lambda: follower.leader() is not None and 0 in follower.live_nodes())
    assert not follower.campaign(now[0], frozenset({0}))     # a leader key stands: none
    assert decider.resign() and not decider.holds_leadership(now[0])
    _until(lambda: follower.leader() is None)
    assert not decider.campaign(now[0], frozenset({0}))      # quarantined: it does not campaign
    assert not follower.campaign(now[0])                     # node 0 is live: without the lemon list, it waits
    assert follower.campaign(now[0], frozenset({0}))         # with it: node 0 is passed over, node 1 decides
    assert not decider.resign()                              # no longer its to give up
    decider.leave()
    follower.leave()


def _until(ready, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline
        time.sleep(0.05)
