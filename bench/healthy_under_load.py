"""A healthy run under load raises no hang (issue 48's acceptance): the daemon as shipped, default health settings,
tiny with two data-parallel ranks, trained for --minutes while --busy processes spin on the same cores; then a
stop by control file. Counts every incident and warning the run raised: a hang, a stall or a crash here is a
false alarm (nothing was wrong but the load), and the script exits 1 on one. Writes
bench/results/healthy_under_load.json with the steps trained and the
tokens/s the progress lines saw (median, slowest).

    python bench/healthy_under_load.py [--minutes 20] [--busy 2]

Not a timed test: it runs for as long as it is asked, on whatever else the host runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_file  # bench/results_file.py: the one writer of bench/results

ROOT = Path(__file__).resolve().parent.parent
FALSE_ALARMS = ("hang", "stall", "crash", "straggler")
SPIN = "while True:\n    pass\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--busy", type=int, default=2, help="processes spinning on the cores beside the run")
    args = ap.parse_args()
    env = {**os.environ, "GLOG_v": "3", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="healthy-") as tmp:
        run_dir = Path(tmp) / "healthy"
        busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
        try:
            daemon = subprocess.Popen([sys.executable, "-m", "cli", "run", "--log-format", "json",
                                       "--set", f"run.dir={str(run_dir)!r}", "--set", "train.steps=10000000",
                                       "--set", "parallel.dp=2", "--set", "train.micro_batch=4"],
                                      cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            started = time.monotonic()
            while time.monotonic() - started < args.minutes * 60 and daemon.poll() is None:
                time.sleep(5)
            subprocess.run([sys.executable, "-m", "cli", "stop", str(run_dir), "--reason", "bench done"], cwd=ROOT,
                           env=env, capture_output=True, timeout=60)
            code = daemon.wait(timeout=600)
        finally:
            for p in busy:
                p.kill()
                p.wait()
        events = [json.loads(line) for line in (run_dir / "logs" / "events.jsonl").read_text().splitlines()]
    incidents = [e for e in events if e["event"] in ("incident", "incident_detected", "health_warning", "hang", "crash")]
    kinds = sorted({e.get("kind") or e["event"] for e in incidents})
    alarms = [e for e in incidents if (e.get("kind") or e["event"]) in FALSE_ALARMS]
    progress = [e for e in events if e["event"] == "progress"]
    rates = [e["tokens_per_s"] for e in progress if isinstance(e.get("tokens_per_s"), (int, float))]
    last_step = max((e.get("step", 0) for e in progress), default=0)
    result = {"minutes": args.minutes, "busy_processes": args.busy, "daemon_exit": code, "steps": last_step,
              "generations": sum(e["event"] == "generation_start" for e in events),
              "incident_kinds": kinds, "false_alarms": len(alarms),
              "false_alarm_events": alarms[:10],
              "tokens_per_s": {"median": statistics.median(rates), "min": min(rates)} if rates else None}
    path = results_file.write("healthy_under_load", result)
    print(f"{args.minutes:g} min under {args.busy} busy processes: {last_step} steps, exit {code}, "
          f"{result['generations']} generation(s), incidents/warnings {kinds or 'none'}, false alarms "
          f"{len(alarms)}; tokens/s {result['tokens_per_s']}; wrote {path}")
    return 0 if code == 0 and not alarms and result["generations"] == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
