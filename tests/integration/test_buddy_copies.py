"""State only one machine holds (issue 50, item 3), with real files and real HTTP on loopback: three machines'
RAM tiers, each written in parts (checkpoint.memory_placement = "buddy": each machine's ranks commit their own
share of the run's plan), each served by its daemon's RamServer. A buddy copies a peer's part into its own step
(checked by its checksums, a corrupt one refused); when a machine is lost, a survivor makes the step whole from
its own part, its buddy copy and the other survivor's — and every tensor of every rank is back, the lost
machine's included."""
import json
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from checkpointing import layout, parts, reader
from checkpointing.writer import ShardWriter
from daemon.machines.buddy_copies import BuddyCopies
from daemon.machines.ram_parts import copy_part, take
from daemon.machines.ram_peers import FetchError, RamServer

MACHINES, PER = 3, 2                       # 3 machines of 2 ranks: world 6


def _value(rank, step):
    return np.arange(500 * (rank + 1), dtype=np.float32) + 1000 * step


def _commit_part(root, step, slot):
    """Machine `slot`'s part of `step`, committed as its ranks commit it."""
    part = {"slot": slot, "slots": MACHINES, "ranks_per_slot": PER}
    ranks = list(parts.ranks_of(part))
    writers = {r: ShardWriter(root, rank=r, world=MACHINES * PER, checksum="crc32c", part=part) for r in ranks}
    for r in reversed(ranks):
        writers[r].save(step, {f"w{r}": _value(r, step)}, run_state={"step": step} if r == ranks[0] else None)
    assert all(w.wait(timeout_s=60) for w in writers.values()) and all(w.last_error is None for w in writers.values())


@pytest.fixture
def machines(tmp_path):
    roots = [tmp_path / f"ram-{n}" for n in range(MACHINES)]
    servers = [RamServer(lambda root=root: root, "run-a", "127.0.0.1").start() for root in roots]
    yield roots, servers
    for s in servers:
        s.close()


def test_a_machines_part_holds_its_own_ranks_shards_alone(machines):
    roots, _ = machines
    _commit_part(roots[1], 7, 1)
    manifest = reader.read_manifest(layout.step_dir(roots[1], 7))
    assert manifest["part"] == {"slots": [1], "of": 3, "ranks_per_slot": 2} and not parts.is_whole(manifest)
    assert sorted(manifest["tensors"]) == ["w2", "w3"] and reader.verify(layout.step_dir(roots[1], 7)) == []


def test_a_lost_machines_part_comes_back_from_its_buddys_copy(machines):
    roots, servers = machines
    for slot in range(MACHINES):
        _commit_part(roots[slot], 7, slot)
    # buddies (daemon.machines.buddies): 0's part is kept by 1, 1's by 2, 2's by 0
    assert copy_part(servers[2].url, "run-a", 2, roots[0], after=0, deadline_s=30) == 7
    assert copy_part(servers[1].url, "run-a", 1, roots[2], after=0, deadline_s=30) == 7
    assert parts.slots(reader.read_manifest(layout.step_dir(roots[0], 7))) == (frozenset({0, 2}), 3)
    assert copy_part(servers[2].url, "run-a", 2, roots[0], after=0, deadline_s=30) is None     # held already
    servers[1].close()                                  # machine 1 lost, with everything on it
    for p in layout.step_dir(roots[1], 7).iterdir():
        p.unlink()
    copied, given = take([servers[1].url, servers[2].url], "run-a", 7, roots[0], deadline_s=30)
    assert given == [servers[2].url] and copied > 0
    step = layout.step_dir(roots[0], 7)
    manifest = reader.read_manifest(step)
    assert parts.is_whole(manifest) and reader.verify(step) == [] and not list(roots[0].glob("*.tmp"))
    tensors = reader.load_tensors(step, manifest)
    assert sorted(tensors) == [f"w{r}" for r in range(6)]
    assert all(np.array_equal(tensors[f"w{r}"], _value(r, 7)) for r in range(6))     # machine 1's ranks' too
    assert take([servers[2].url], "run-a", 7, roots[0], deadline_s=30) == (0, [])     # whole here already


def test_a_step_whose_lost_part_nobody_copied_is_not_made_whole(machines):
    roots, servers = machines
    for slot in (0, 2):
        _commit_part(roots[slot], 7, slot)
    with pytest.raises(FetchError, match=r"slot\(s\) \[1\]"):
        take([servers[2].url], "run-a", 7, roots[0], deadline_s=30)
    assert parts.slots(reader.read_manifest(layout.step_dir(roots[0], 7))) == (frozenset({0}), 3)   # its part kept
    assert not list(roots[0].glob("*.tmp"))


def test_a_corrupt_copy_is_refused_and_the_part_left_as_it_was(machines):
    roots, servers = machines
    _commit_part(roots[0], 7, 0)
    _commit_part(roots[2], 7, 2)
    shard = layout.step_dir(roots[2], 7) / layout.shard_name(4, 6)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF                                    # a bit flipped on the peer
    shard.write_bytes(bytes(data))
    with pytest.raises(FetchError, match="checksum"):
        copy_part(servers[2].url, "run-a", 2, roots[0], after=0, deadline_s=30)
    step = layout.step_dir(roots[0], 7)
    assert parts.slots(reader.read_manifest(step)) == (frozenset({0}), 3) and reader.verify(step) == []
    assert sorted(p.name for p in step.iterdir() if p.name.startswith(".")) == []


def test_the_copies_follow_the_newest_step_while_the_ranks_train(machines):
    roots, servers = machines
    urls = {n: s.url for n, s in enumerate(servers)}
    seen = []
    copies = BuddyCopies(root=roots[0], run_id="run-a", node=0, members=[0, 1, 2], domains=(),
                         urls=lambda: urls, on_kept=seen.append).start()
    try:
        assert copies.peers == [2]
        for step in (1, 2, 3):
            for slot in (0, 2):
                _commit_part(roots[slot], step, slot)
            deadline = time.monotonic() + 30
            while copies.newest() < step and time.monotonic() < deadline:
                time.sleep(0.02)
            assert copies.newest() == step
    finally:
        copies.stop()
    # retention keeps the step being copied and the newest copied: at the end, step 3 alone
    assert seen[-1] == frozenset({3})
    assert copies.failures == 0 and copies.count == 3
    for step in (1, 2, 3):
        manifest = json.loads((layout.step_dir(roots[0], step) / layout.MANIFEST).read_text())
        assert parts.slots(manifest) == (frozenset({0, 2}), 3)
        got = load_file(layout.step_dir(roots[0], step) / layout.shard_name(5, 6))
        assert np.array_equal(got["w5"], _value(5, step))


def test_retiring_a_step_recycles_this_machines_own_shards_and_deletes_the_copies(machines):
    roots, servers = machines
    _commit_part(roots[0], 7, 0)
    _commit_part(roots[2], 7, 2)
    assert copy_part(servers[2].url, "run-a", 2, roots[0], after=0, deadline_s=30) == 7
    layout.retire(roots[0], 7, recycle={layout.shard_name(r, 6) for r in (0, 1)})
    assert sorted(p.name for p in (roots[0] / layout.SPARE).iterdir()) == [layout.shard_name(0, 6),
                                                                           layout.shard_name(1, 6)]
    assert layout.committed_steps(roots[0]) == []


def test_a_peer_that_never_answers_does_not_hold_up_the_end_of_a_generation(machines):
    """A host lost with its link cut: a copy under way waits on a connection that never answers. The generation's
    end (its copies stopped before the daemon says what it holds) does not wait out the copy's 30-s timeout."""
    import socket

    roots, _ = machines
    _commit_part(roots[0], 7, 0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)                                    # connections queue, nothing is ever answered
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    copies = BuddyCopies(root=roots[0], run_id="run-a", node=0, members=[0, 1, 2], domains=(),
                         urls=lambda: {2: url}, on_kept=lambda steps: None).start()
    time.sleep(0.5)                                     # the copier is waiting on the silent peer
    began = time.monotonic()
    copies.stop()
    assert time.monotonic() - began < 10                # not the copy's timeout (30 s)
    silent.close()
    assert parts.slots(reader.read_manifest(layout.step_dir(roots[0], 7))) == (frozenset({0}), 3)
