"""A generation's teardown (daemon.processes.generation.stop_all) against real processes."""
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from checkpointing import layout, reader
from daemon.processes import generation
from tests.integration.handover_writer import ELEMENTS, VALUE

ROOT = Path(__file__).resolve().parents[2]


def test_the_teardown_lets_a_ranks_writer_process_finish_the_ram_save_it_was_handed(tmp_path):
    """SIGTERM to the rank's process group ends the rank at once (Python's default), while its RAM-tier writer,
    handed step 2 just before, ignores it: stop_all waits for the writer to commit the save and exit before it
    SIGKILLs what is left, so the step lands and nothing of the group is left running."""
    root = tmp_path / "ram"
    worker = _handed_over(tmp_path, root)
    writer = int((tmp_path / "rank.log").read_text().split()[0])
    generation.stop_all([worker], grace_s=60)
    assert generation.checkpoint_writers({worker.pid}) == []
    assert _ended(writer)
    assert layout.committed_steps(root) == [1, 2]
    step = layout.step_dir(root, 2)
    assert reader.verify(step) == []
    (w,) = reader.load_tensors(step, reader.read_manifest(step)).values()
    assert w.shape == (ELEMENTS,) and np.all(w == VALUE)


@pytest.mark.parametrize("writers_s", [10.0, 0.0])
def test_after_a_crash_the_ranks_are_killed_at_once_and_their_writer_gets_its_own_grace(tmp_path, writers_s):
    """The crash path: no grace for the ranks (they sit in a collective), the rank SIGKILLed at once; its
    writer is given `writers_s` to land the save (teardown_graces: 2 s after a crash or hang), none after a
    numerical incident — then it is killed, and what it left is a temporary directory, never a step."""
    root = tmp_path / "ram"
    worker = _handed_over(tmp_path, root)
    generation.stop_all([worker], grace_s=0.0, writers_s=writers_s)
    assert worker.popen.returncode is not None                       # the rank: gone at once
    assert generation.checkpoint_writers({worker.pid}) == []
    assert layout.committed_steps(root) == ([1, 2] if writers_s else [1])
    if writers_s:
        assert reader.verify(layout.step_dir(root, 2)) == []


def _handed_over(tmp_path: Path, root: Path) -> generation.Worker:
    """A rank (handover_writer "stay") that has handed step 2 to its RAM-tier writer process."""
    worker = generation.spawn([sys.executable, "-m", "tests.integration.handover_writer", str(root), "stay"],
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), log_path=tmp_path / "rank.log",
                              role="rank", rank=0, cwd=str(ROOT))
    deadline = time.monotonic() + 60
    while not (tmp_path / "rank.log").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.001)
    return worker


def _ended(pid: int) -> bool:
    """Gone, or a zombie its new parent (init) has not reaped: it runs nothing."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_new_daemon_lets_a_dead_ranks_writer_land_its_save_before_it_goes_on(tmp_path):
    """A killed daemon's rank died too, its writer still writing step 2: the next daemon's kill_orphans waits
    (within its grace) for that orphaned writer, so the step is there when it decides where to resume."""
    root = tmp_path / "ram"
    worker = _handed_over(tmp_path, root)
    record = {"pid": worker.pid, "pgid": worker.pid, "start_ticks": generation.start_ticks(worker.pid),
              "role": "rank", "log": str(tmp_path / "rank.log"), "log_start": 0}
    worker.popen.kill()
    worker.popen.wait()
    assert generation.kill_orphans([record], grace_s=60) == []         # nothing of it left to kill
    assert generation.checkpoint_writers({worker.pid}) == []
    assert layout.committed_steps(root) == [1, 2]
