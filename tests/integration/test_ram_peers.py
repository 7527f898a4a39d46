"""A machine's RAM tier served to its peers over real HTTP on loopback, and a step taken from one (issue 50,
item 2): the copy is the peer's, verified before it is committed; a request without the run's id, a step the
peer does not hold, a corrupt or broken transfer fail in one FetchError and leave nothing behind."""
import numpy as np
import pytest
from safetensors.numpy import load_file

from checkpointing import layout, reader
from checkpointing.writer import ShardWriter
from daemon.machines.ram_parts import take
from daemon.machines.ram_peers import FetchError, RamServer



def _commit(root, step, world=2):
    """Step `step` of a run whose machines have `world` ranks each, committed as its ranks commit it."""
    writers = [ShardWriter(root, rank=r, world=world, checksum="crc32c") for r in range(world)]
    for r in reversed(range(world)):
        writers[r].save(step, {f"w{r}": np.arange(1000 * (r + 1), dtype=np.float32) + step},
                        run_state={"step": step} if r == 0 else None)
    assert all(w.wait(timeout_s=60) for w in writers)
    return layout.step_dir(root, step)


@pytest.fixture
def peer(tmp_path):
    root = tmp_path / "peer"
    server = RamServer(lambda: root, "run-a", "127.0.0.1").start()
    yield root, server
    server.close()


def test_a_step_is_copied_whole_verified_and_committed(tmp_path, peer):
    root, server = peer
    _commit(root, 7)
    mine = tmp_path / "mine"
    copied, given = take([server.url], "run-a", 7, mine, deadline_s=30)
    assert given == [server.url]
    assert layout.committed_steps(mine) == [7] and reader.verify(layout.step_dir(mine, 7)) == []
    assert copied == sum(f.stat().st_size for f in layout.step_dir(root, 7).glob("*.safetensors"))
    got = load_file(layout.step_dir(mine, 7) / layout.shard_name(1, 2))
    assert np.array_equal(got["w1"], np.arange(2000, dtype=np.float32) + 7)


def test_another_runs_request_a_step_not_held_and_a_corrupt_copy_fail_and_leave_nothing(tmp_path, peer):
    root, server = peer
    step = _commit(root, 7)
    mine = tmp_path / "mine"
    with pytest.raises(FetchError, match="403"):
        take([server.url], "run-b", 7, mine, deadline_s=30)
    with pytest.raises(FetchError, match="404"):
        take([server.url], "run-a", 8, mine, deadline_s=30)
    shard = step / layout.shard_name(0, 2)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF                               # a bit flipped on the peer (or on the wire)
    shard.write_bytes(bytes(data))
    with pytest.raises(FetchError, match="fails verification"):
        take([server.url], "run-a", 7, mine, deadline_s=30)
    assert layout.committed_steps(mine) == [] and not list(mine.glob("*.tmp"))


def test_a_peer_gone_mid_transfer_fails_within_the_deadline(tmp_path, peer):
    root, server = peer
    _commit(root, 7)
    server.close()                                 # the peer's daemon is gone
    with pytest.raises(FetchError, match="no peer gave"):
        take([server.url], "run-a", 7, tmp_path / "mine", deadline_s=5)
    assert not list((tmp_path / "mine").glob("step-*"))


def test_a_step_of_another_history_here_is_replaced_by_the_peers(tmp_path, peer):
    """A machine back after the run went on without it holds a step of the same number, trained before: asked to
    take the run's (it did not run the last generation), it ends with the peer's, not its own."""
    root, server = peer
    _commit(root, 7)
    mine = tmp_path / "mine"
    writer = ShardWriter(mine, rank=0, world=1, checksum="crc32c")
    writer.save(7, {"w0": np.zeros(3, dtype=np.float32)}, run_state={"step": 7})
    assert writer.wait(timeout_s=60)
    assert take([server.url], "run-a", 7, mine, deadline_s=30) == (0, [])      # its own counts as the run's
    copied, given = take([server.url], "run-a", 7, mine, deadline_s=30, trust_own=False)
    assert given == [server.url] and reader.verify(layout.step_dir(mine, 7)) == []
    got = reader.load_tensors(layout.step_dir(mine, 7))
    assert sorted(got) == ["w0", "w1"] and np.array_equal(got["w0"], np.arange(1000, dtype=np.float32) + 7)
    assert not list(mine.glob("step-*.deleting")) and not list(mine.glob("*.tmp"))
