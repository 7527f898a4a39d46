"""A warm standby's imports on idle CPU only (engine/rank/idle_cpu.py): in a real process, as root, a thread
started inside the block runs under SCHED_IDLE, and after it every thread of the process is back to SCHED_OTHER;
as an unprivileged user without the RLIMIT_NICE the systemd units give (`LimitNICE=+0`), or as root without
CAP_SYS_NICE (a container's default), which could not come back, the process never leaves normal scheduling. (That limit itself is not set here: raising RLIMIT_NICE's hard
limit needs CAP_SYS_RESOURCE, which this sandbox's root lacks; systemd, as PID 1 on a host, has it.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# run as `nobody` too, who may not read this checkout: the module's source travels in the command line
PROBE = """
import json, os, sys, threading, time, types
idle_cpu = types.ModuleType("idle_cpu")
exec(sys.argv[1], idle_cpu.__dict__)

def policies():
    seen = set()
    for t in os.listdir("/proc/self/task"):
        try:
            seen.add(os.sched_getscheduler(int(t)))
        except ProcessLookupError:    # a thread that ended after the listing (one of the block's own)
            pass
    return sorted(seen)

done = threading.Event()
limit_s, dwell_s = float(sys.argv[2]), float(sys.argv[3])
with idle_cpu.only(limit_s) as idle:
    inside = os.sched_getscheduler(0)
    worker = threading.Thread(target=done.wait, daemon=True)    # as MindSpore's pools start theirs, while importing
    worker.start()
    started = os.sched_getscheduler(worker.native_id)
    time.sleep(dwell_s)
    late = policies()
after = policies()
done.set()
print(json.dumps({"idle": idle, "inside": inside, "thread_started_inside": started, "late": late, "after": after}))
"""


def _probe(*prefix: str, limit_s: float = 60.0, dwell_s: float = 0.0) -> dict:
    source = (ROOT / "engine" / "rank" / "idle_cpu.py").read_text()
    python = os.path.realpath(sys.executable)       # the interpreter itself, not the venv's link to it
    out = subprocess.run([*prefix, python, "-I", "-c", PROBE, source, str(limit_s), str(dwell_s)], capture_output=True, text=True, timeout=60,
                         cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_as_root_the_block_runs_idle_and_every_thread_comes_back():
    if os.geteuid() != 0:
        pytest.fail("the tests run as root (CI does): this one checks the path a root daemon takes")
    seen = _probe()
    assert seen == {"idle": True, "inside": os.SCHED_IDLE, "thread_started_inside": os.SCHED_IDLE,
                    "late": [os.SCHED_IDLE], "after": [os.SCHED_OTHER]}


def test_past_its_limit_the_block_goes_on_at_normal_priority():
    """A machine the training keeps busy would starve the imports: after the limit, every thread is normal again
    while the block still runs."""
    seen = _probe(limit_s=0.2, dwell_s=2.0)
    assert seen["idle"] and seen["thread_started_inside"] == os.SCHED_IDLE
    assert seen["late"] == [os.SCHED_OTHER] and seen["after"] == [os.SCHED_OTHER]


def test_unprivileged_without_it_the_process_never_leaves_normal_scheduling():
    seen = _probe("prlimit", "--nice=0", "setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")  # cannot come back
    assert seen == {"idle": False, "inside": os.SCHED_OTHER, "thread_started_inside": os.SCHED_OTHER,
                    "late": [os.SCHED_OTHER], "after": [os.SCHED_OTHER]}


def test_root_without_cap_sys_nice_never_leaves_normal_scheduling():
    """A container's root lacks CAP_SYS_NICE by default: it could enter SCHED_IDLE but not come back."""
    if os.geteuid() != 0:
        pytest.fail("the tests run as root (CI does): this one drops a capability root has")
    seen = _probe("prlimit", "--nice=0", "setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice")
    assert seen == {"idle": False, "inside": os.SCHED_OTHER, "thread_started_inside": os.SCHED_OTHER,
                    "late": [os.SCHED_OTHER], "after": [os.SCHED_OTHER]}
