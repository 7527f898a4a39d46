"""A rank's stop request by signal (engine/rank/stop_signal.py) against the kernel's real parent-death signal.

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

# A rank in miniature: steps until asked to stop, then "saves" for a while (a peer may be gone by then)
# and exits 0, having written how many SIGTERMs it saw.
RANK = textwrap.dedent("""
    import sys, time
    from engine.rank.stop_signal import StopSignal
    stop = StopSignal()
    out = sys.argv[1]
    open(out + ".up", "w").close()
    while not stop.requested:
        time.sleep(0.01)
    time.sleep(2.0)                     # the save
    with open(out, "w") as f:
        f.write(str(stop.signals))
""")

# The daemon in miniature: many threads, the rank spawned the daemon's way (daemon.generation.spawn) by
# a thread that then ends, once the rank is up. The kernel sends the parent-death signal when the rank's
# parent *thread* dies, and again at each reparenting after: so at least twice once the daemon is
# killed too, whatever order its threads die in.
DAEMON = textwrap.dedent("""
    import os, signal, sys, threading, time
    from pathlib import Path
    from daemon.generation import spawn
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
    assert out.exists(), "the rank exited before its save: " + Path(f"{out}.log").read_text()[-500:]
    # more than one SIGTERM came (so this is the case that lost saves), and none ended the save
    assert int(out.read_text()) >= 2


def test_a_second_ctrl_c_exits_at_once(tmp_path):
    rank = tmp_path / "rank.py"
    rank.write_text(RANK.replace("time.sleep(2.0)", "time.sleep(60)"))
    out = tmp_path / "saved"
    proc = subprocess.Popen([sys.executable, str(rank), str(out)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    _wait_for(lambda: Path(f"{out}.up").exists())
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    assert proc.poll() is None                        # the first asks for a save
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 128 + signal.SIGINT
    assert not out.exists()
