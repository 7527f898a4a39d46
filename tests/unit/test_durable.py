"""durable's writers put every part, in order, whatever the buffers and however many (writev takes
at most IOV_MAX a call), and write_over leaves a longer old file cut to the new length."""
import os

import numpy as np
import pytest

from durable import write_atomically, write_over


def _parts(count: int) -> list:
    rng = np.random.default_rng(count)
    parts = []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            parts.append(b"")                                               # empty parts are skipped
        elif kind == 1:
            parts.append(rng.bytes(int(rng.integers(1, 40))))
        elif kind == 2:
            parts.append(memoryview(rng.standard_normal(int(rng.integers(1, 30))).astype(np.float32)).cast("B"))
        else:
            parts.append(memoryview(np.arange(int(rng.integers(1, 9)), dtype=np.int64)))   # not a byte view
    return parts


@pytest.mark.parametrize("count", [0, 1, 7, 1024, 2500])
def test_every_part_is_written_in_order(tmp_path, count):
    parts = _parts(count)
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    write_atomically(tmp_path / "atomic", parts)
    assert (tmp_path / "atomic").read_bytes() == expected
    (tmp_path / "over").write_bytes(b"x" * (len(expected) + 5000))           # an older, longer file
    inode = (tmp_path / "over").stat().st_ino
    write_over(tmp_path / "over", parts)
    assert (tmp_path / "over").read_bytes() == expected
    assert (tmp_path / "over").stat().st_ino == inode                        # its pages written over
    assert sorted(os.listdir(tmp_path)) == ["atomic", "over"]                # no temporary left


def _big_parts() -> list:
    """Parts that straddle write_direct's chunks: a header, tensors of odd lengths, one over a chunk."""
    rng = np.random.default_rng(7)
    sizes = [13, 4096, 1 << 20, 3 * (1 << 20) + 5, 0, 777]
    return [b"header!!", *(memoryview(rng.standard_normal(n // 4 + 1).astype(np.float32)).cast("B")[:n]
                           for n in sizes)]


def _takes_direct(folder) -> bool:
    try:
        os.close(os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        return False
    finally:
        (folder / "probe").unlink(missing_ok=True)
    return True


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_a_direct_write_puts_every_byte_and_tells_each_one_in_order(tmp_path, where):
    """Past the page cache on a disk's file system; buffered on a tmpfs (it takes no O_DIRECT), said so."""
    from checkpointing import checksums
    from durable import write_direct

    if where == "tmpfs":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm tmpfs on this machine")
        import tempfile
        tmp_path = type(tmp_path)(tempfile.mkdtemp(dir="/dev/shm"))
    parts = _big_parts()
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    told = []
    try:
        direct = write_direct(tmp_path / "shard", parts, lambda b: told.append(bytes(b)))
        assert direct is _takes_direct(tmp_path)                              # a tmpfs: False; ext4, xfs: True
        assert (tmp_path / "shard").read_bytes() == expected                 # cut back from its padded block
        assert b"".join(told) == expected
        assert checksums.file_digest(tmp_path / "shard", "crc32c") == checksums.digest(parts, "crc32c")
        assert os.listdir(tmp_path) == ["shard"]                             # no temporary left
    finally:
        if where == "tmpfs":
            import shutil
            shutil.rmtree(tmp_path)


def test_a_direct_write_that_fails_leaves_no_file(tmp_path):
    from durable import write_direct

    def full(_):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_direct(tmp_path / "shard", _big_parts(), full)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("refused_at", ["open", "first write"])
def test_a_file_system_that_refuses_o_direct_gets_the_file_buffered_and_every_byte_told_once(tmp_path, monkeypatch,
                                                                                              refused_at):
    import errno

    import durable

    real_open, real_write = os.open, os.write

    def opening(path, flags, *mode):
        if flags & os.O_DIRECT and refused_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *mode)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def writing(fd, data):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    direct_fds: set[int] = set()
    monkeypatch.setattr(durable.os, "open", opening)
    monkeypatch.setattr(durable.os, "write", writing)
    parts = _big_parts()
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    told = []
    assert durable.write_direct(tmp_path / "shard", parts, lambda b: told.append(bytes(b))) is False
    assert (tmp_path / "shard").read_bytes() == expected and b"".join(told) == expected
    assert os.listdir(tmp_path) == ["shard"]


def test_a_disk_that_fills_mid_write_fails_the_write_and_leaves_no_file(tmp_path, monkeypatch):
    import errno

    import durable

    if not _takes_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s file system takes no O_DIRECT: its writes are writev's, tested above")
    real_write, calls = os.write, []

    def filling(fd, data):
        calls.append(len(data))
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(durable.os, "write", filling)
    with pytest.raises(OSError) as failed:
        durable.write_direct(tmp_path / "shard", _big_parts(), lambda b: None)
    assert failed.value.errno == errno.ENOSPC and os.listdir(tmp_path) == []
