"""A rank's stop request by signal (contracts/stop_signal.py) against the kernel's real parent-death signal.

A daemon killed with SIGKILL dies thread by thread, and its child, handed from
one dying thread to the next, gets the parent-death signal each time: a rank
that exited on the second SIGTERM lost the save the first one asked for (one
daemon kill in three, in the e2e tier)."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

# A rank in miniature: steps until asked to stop, then "saves" (a peer may be gone by then) and exits 0,
# having written how many SIGTERMs it saw. The save lasts until the test ends it (a file) or, as the rank of
# a killed daemon, until the daemon is gone: its parent is then another process, so the kernel has sent every
# parent-death signal by then. Meanwhile it reports each signal it has handled (`.seen`), so a test can send
# the next only once the last was handled: never two pending at once, which the kernel merges into one.
RANK = textwrap.dedent("""
    import os, sys, time
    from contracts.stop_signal import StopSignal
    stop = StopSignal()
    out = sys.argv[1]
    parent = os.getppid()
    open(out + ".up", "w").close()
    while not stop.requested:
        time.sleep(0.01)
    seen, deadline = 0, time.monotonic() + 120
    while not os.path.exists(out + ".finish") and os.getppid() == parent:       # the save
        if stop.signals != seen:
            seen = stop.signals
            with open(out + ".seen.tmp", "w") as f:
                f.write(str(seen))
            os.replace(out + ".seen.tmp", out + ".seen")
        if time.monotonic() > deadline:
            sys.exit("the save was never ended")
        time.sleep(0.01)
    with open(out, "w") as f:
        f.write(str(stop.signals))
""")

# The daemon in miniature: many threads, the rank spawned the daemon's way (daemon.processes.generation.spawn) by
# a thread that then ends, once the rank is up. The kernel sends the parent-death signal when the rank's
# parent *thread* dies, and again at each reparenting after: so at least twice once the daemon is
# killed too, whatever order its threads die in.
DAEMON = textwrap.dedent("""
    import os, signal, sys, threading, time
    from pathlib import Path
    from daemon.processes.generation import spawn
    for _ in range(16):
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    def start():
        w = spawn([sys.executable, sys.argv[1], sys.argv[2]], env={"PYTHONPATH": sys.argv[3]}, role="rank",
                  rank=0, log_path=Path(sys.argv[2] + ".log"), parent_death_signal=signal.SIGTERM)
        while not os.path.exists(sys.argv[2] + ".up"):
            time.sleep(0.01)
        print(w.pid, flush=True)
    spawner = threading.Thread(target=start)
    spawner.start()
    spawner.join()
    time.sleep(600)
""")


def _wait_for(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _seen(out: Path) -> int:
    path = Path(f"{out}.seen")
    return int(path.read_text()) if path.exists() else 0


def test_a_rank_of_a_killed_daemon_saves_however_many_parent_death_signals_it_gets(tmp_path):
    rank, daemon = tmp_path / "rank.py", tmp_path / "supervisor_like.py"
    rank.write_text(RANK)
    daemon.write_text(DAEMON)
    out = tmp_path / "saved"
    proc = subprocess.Popen([sys.executable, str(daemon), str(rank), str(out), str(ROOT)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    _wait_for(lambda: Path(f"{out}.up").exists())
    proc.kill()
    proc.wait()
    _wait_for(lambda: not Path(f"/proc/{child}").exists() or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z")
    # how many SIGTERMs arrive is the kernel's timing (one per thread the rank was handed to, merged while
    # one is pending): whatever the count, none ended the save
    assert out.exists(), "the rank exited before its save: " + Path(f"{out}.log").read_text()[-500:]
    assert int(out.read_text()) >= 1


@pytest.mark.parametrize("sigterms", [1, 2, 17])
def test_a_rank_saves_and_exits_0_however_many_sigterms_come_during_its_save(tmp_path, sigterms):
    """The case the parent-death signal makes (2 to 17 of them, measured), each one handled before the next."""
    rank = tmp_path / "rank.py"
    rank.write_text(RANK)
    out = tmp_path / "saved"
    proc = subprocess.Popen([sys.executable, str(rank), str(out)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    _wait_for(lambda: Path(f"{out}.up").exists())
    for n in range(1, sigterms + 1):
        proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: _seen(out) == n or proc.poll() is not None)
        assert proc.poll() is None, f"SIGTERM {n} ended the rank during its save"
    Path(f"{out}.finish").touch()
    assert proc.wait(timeout=60) == 0
    assert int(out.read_text()) == sigterms


def test_a_second_ctrl_c_exits_at_once(tmp_path):
    rank = tmp_path / "rank.py"
    rank.write_text(RANK)
    out = tmp_path / "saved"
    proc = subprocess.Popen([sys.executable, str(rank), str(out)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    _wait_for(lambda: Path(f"{out}.up").exists())
    proc.send_signal(signal.SIGINT)
    _wait_for(lambda: _seen(out) == 1 or proc.poll() is not None)
    assert proc.poll() is None                        # the first asks for a save
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 128 + signal.SIGINT    # the save never ends by itself: the signal ended it
    assert not out.exists()
