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
