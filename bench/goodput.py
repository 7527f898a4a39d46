"""Goodput under random rank kills: how much of an uninterrupted run's progress a run keeps.

Tiny config, two real ranks, the daemon as shipped (warm standby on) plus the
RAM tier (checkpoint.memory_interval_steps=1; disk every 50). For each mean kill
interval: a soak of `--faults` × interval seconds in which a random rank is
SIGKILLed at exponential intervals (measured from the previous kill), then
SIGTERM (the run saves and stops); beside it, interleaved, an uninterrupted run
of the same wall time. Goodput = the soak's final step / the uninterrupted
run's final step — both pay the same start-up and compile, so only the faults
differ. Per fault: recovery (kill → the next generation's first step) and steps
lost (the step the daemon last saw − the step restored). Targets (issue 17):
≥ 0.90 at a kill a minute, ≥ 0.97 at one every 5 minutes; issue 50: ≥ 0.98 at one every ~25 s
(`--intervals 25 --faults 9`). Writes
bench/results/goodput.json.

Beside it, the daemon's own goodput ledger (daemon.judging.goodput: productive seconds over the run's
wall seconds, in state.json) of both runs. The ledger's figure is absolute — an uninterrupted run's is
below 1 too (its start, compile, checkpoint stalls) — so it is compared with this bench's figure as
the ledger's goodput of the run with kills over the ledger's goodput of the uninterrupted run:
both then say what the faults cost. The ratio of final steps also counts the two runs' pace, which
differs between runs on a shared host (4 % between two 180 s runs, measured); so the ledger is held to
the bench's *paced* figure — each run's steps times its own median step period (rank 0's step lines),
over its wall time, faulty over clean — and printed beside both, with the differences in points.

With --mix (issue 35): a kill at exponential intervals of 60 s plus a bitflip (a transient device fault: one
rank's gradients overflow once) every 300 s (the first at 150 s), for --mix-wall-s (600) — once with reruns
(the default: a rerun from the RAM tier finds the flip transient and training goes on), once with today's
policy (`health.rerun = false`: roll back to a disk checkpoint before the margin, skip the window, cut the
lr), both on the same kill schedule, and an uninterrupted run of the same wall time beside them. Goodput
of each against it, and per bitflip: the action, the verdict, the steps lost and the recovery.

    python bench/goodput.py [--intervals 25,60,300] [--faults 5] [--seed 0]
    python bench/goodput.py --mix [--mix-wall-s 600] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import results_file  # bench/results_file.py: the one writer of bench/results

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from recovery import _at, _daemon, _events, _stop  # noqa: E402

from daemon.judging.goodput import RESTART  # noqa: E402
from daemon.records.state import RunState  # noqa: E402

TARGETS = {25: 0.98, 60: 0.90, 300: 0.97}    # 25: issue 50's soak, a kill every 15-40 s
EXTRA = ["checkpoint.memory_interval_steps=1", "checkpoint.interval_steps=50"]


def _final_step(run: Path) -> int:
    exits = [json.loads(l) for l in (run / "logs" / "rank-0.log").read_text().splitlines()
             if l.startswith('{"generation"') and '"exit"' in l]
    return exits[-1]["step"] if exits else 0


def _period_s(run: Path) -> float | None:
    """The run's own steady pace: the median time from one step's end to the next's (rank 0's step lines,
    every step at tiny's log interval; each generation's first, compiling step left out)."""
    periods, seen = [], set()
    for line in (run / "logs" / "rank-0.log").read_text().splitlines():
        if not line.startswith("{") or '"kind": "step"' not in line:
            continue
        e = json.loads(line)
        if e["generation"] in seen:
            periods.append(e["host_s"] - e["data_wait_s"] + e["step_s"])
        seen.add(e["generation"])
    return statistics.median(periods) if periods else None


def soak(workdir: Path, corpus: Path, *, wall_s: float, interval_s: float | None, rng: random.Random,
         bitflip_s: float | None = None, extra: tuple = ()) -> dict:
    from daemon.processes import control

    run = workdir / f"{'faults' if interval_s else 'clean'}-{time.monotonic_ns()}"
    daemon = _daemon(run, corpus, cache=True, standby=True, extra=(*EXTRA, *extra))
    started = time.time()
    kills, flips = [], []
    try:
        next_kill = started + rng.expovariate(1 / interval_s) if interval_s else float("inf")
        next_flip = started + bitflip_s / 2 if bitflip_s else float("inf")
        while time.time() < started + wall_s:
            time.sleep(0.05)
            if time.time() >= next_flip:
                control.write_request(run / "control", "inject", {"fault": "bitflip", "rank": rng.randrange(2)})
                flips.append(time.time())
                next_flip += bitflip_s
            if time.time() < next_kill:
                continue
            try:
                ranks = [p for p in RunState.load(run).processes if p["role"] == "rank" and not p.get("standby")]
            except (OSError, ValueError):            # not written yet
                ranks = []
            if ranks:
                victim = rng.choice(ranks)
                try:
                    os.kill(victim["pid"], signal.SIGKILL)
                    kills.append(time.time())
                except ProcessLookupError:
                    pass
            next_kill = time.time() + rng.expovariate(1 / interval_s)
    finally:
        _stop(daemon)
    events = _events(run)
    faults = []
    for killed_at in kills:
        crash = next((e for e in events if e["event"] == "crash" and _at(e) >= killed_at - 0.5), None)
        if crash is None:
            continue
        nxt = lambda name: next((e for e in events if e["event"] == name and e.get("generation") == crash["generation"] + 1),
                                None)
        back, restored, start = nxt("first_step"), nxt("checkpoint_restored"), nxt("generation_start")
        faults.append({"killed_at_s": round(killed_at - started, 2),
                       "recovery_s": round(_at(back) - killed_at, 2) if back else None,
                       "lost_steps": crash["step"] - restored["step"] if restored else None,
                       "standby": bool(start and start.get("standby"))})
    return {"final_step": _final_step(run), "period_s": _period_s(run), "wall_s": wall_s, "faults": faults,
            "bitflips": [_flipped(events, at, started) for at in flips], "ledger": _ledger(run)}


def _ledger(run: Path) -> dict:
    """The daemon's goodput ledger of the run as its last daemon saved it: the ratio, its seconds, the largest losses."""
    g = RunState.load(run).goodput
    badput = g.get("badput_s") or {}
    return {"ratio": g.get("ratio"), "productive_s": g.get("productive_s"), "wall_s": g.get("wall_s"),
            "retrained_steps": g.get("retrained_steps"), "badput_s": {c: s for c, s in badput.items() if s}}


def paced(faulty: dict, clean: dict) -> float | None:
    """Goodput with each run's steps counted at its own steady pace: steps × median step period / wall, the
    run with kills over the uninterrupted one. Two runs side by side on a shared host differ in pace (4 %
    measured between two 180 s runs), which the ratio of final steps takes for the faults' cost."""
    if not faulty.get("period_s") or not clean.get("period_s") or not clean["final_step"]:
        return None
    return (faulty["final_step"] * faulty["period_s"]) / (clean["final_step"] * clean["period_s"])


def compared(bench: float, faulty: dict, clean: dict) -> dict:
    """The ledger's figure on this bench's footing (faulty over clean) and its difference from the bench's paced
    figure (and from its ratio of final steps), in points."""
    f, c = faulty["ledger"].get("ratio"), clean["ledger"].get("ratio")
    relative = f / c if f is not None and c else None
    at_pace = paced(faulty, clean)
    points = lambda b: None if relative is None or b is None else round(100 * (relative - b), 2)
    return {"faulty": f, "clean": c, "relative": relative, "paced": at_pace, "difference_points": points(at_pace),
            "difference_from_steps_points": points(bench), "restarts": restart_share(faulty, clean)}


def restart_share(faulty: dict, clean: dict) -> float | None:
    """1 - what the kills cost in restarts alone, by the ledger: the run with kills' teardown, start, restore,
    compile and steps trained again, less the clean run's own (its one start), over the wall time. Unlike
    the ratio of steps and the paced figure, the host's pace moving between the two runs does not enter
    it; the slower steps after a recovery do not either (they are in the others)."""
    bad_f, bad_c = faulty["ledger"].get("badput_s"), clean["ledger"].get("badput_s")
    wall = faulty["ledger"].get("wall_s")
    if not bad_f or bad_c is None or not wall:
        return None
    causes = (*RESTART, "retrained")
    return 1.0 - (sum(bad_f.get(k, 0.0) for k in causes) - sum(bad_c.get(k, 0.0) for k in causes)) / wall


def _flipped(events: list[dict], at: float, started: float) -> dict:
    """What a bitflip injected at `at` cost: the incident, its action, the rerun's verdict, steps lost, recovery."""
    incident = next((e for e in events if e["event"] == "incident" and e.get("kind") == "non_finite"
                     and _at(e) >= at), None)
    if incident is None:
        return {"at_s": round(at - started, 2), "detected": False}
    nxt = lambda name: next((e for e in events if e["event"] == name and e.get("generation") == incident["generation"] + 1),
                            None)
    back, restored = nxt("first_step"), nxt("checkpoint_restored")
    verdict = next((e["verdict"] for e in events if e["event"] == "triage" and _at(e) >= _at(incident)), None)
    return {"at_s": round(at - started, 2), "detected": True, "action": incident["action"]["type"], "verdict": verdict,
            "lost_steps": incident["first_step"] - restored["step"] if restored else None,
            "recovery_s": round(_at(back) - _at(incident), 2) if back else None,
            "skip": incident["action"].get("skip"), "lr_overrides": incident["action"].get("lr_overrides")}


def mix(corpus: Path, workdir: Path, *, wall_s: float, seed: int, bitflip_s: float = 300.0) -> dict:
    """Kills a minute apart on average plus a bitflip every 5 minutes: reruns against today's policy."""
    runs = {}
    for name, extra in (("reruns", ("health.rerun=true",)), ("today", ("health.rerun=false",))):
        runs[name] = soak(workdir, corpus, wall_s=wall_s, interval_s=60.0, rng=random.Random(seed), bitflip_s=bitflip_s,
                          extra=extra)
    clean = soak(workdir, corpus, wall_s=wall_s, interval_s=None, rng=random.Random(seed))
    return {"wall_s": wall_s, "kill_every_s": 60.0, "bitflip_every_s": bitflip_s, "clean": clean,
            **{name: {**r, "goodput": r["final_step"] / max(1, clean["final_step"])} for name, r in runs.items()}}


def _print_mix(m: dict) -> None:
    print(f"goodput, a kill a minute plus a bitflip every {m['bitflip_every_s']:.0f} s ({m['wall_s']:.0f} s each; tiny, 2 ranks, warm "
          f"standby, RAM tier every step); uninterrupted: {m['clean']['final_step']} steps")
    print(f"{'policy':>8} {'steps':>7} {'goodput':>8} {'kills':>6} {'flips':>6}  per bitflip: action/verdict, lost steps, "
          "recovery s")
    for name in ("reruns", "today"):
        r = m[name]
        flips = "; ".join(f"{f.get('action')}/{f.get('verdict') or '-'}, {f.get('lost_steps')}, {f.get('recovery_s')}"
                          if f.get("detected") else "not detected" for f in r["bitflips"])
        print(f"{name:>8} {r['final_step']:>7} {r['goodput']:>8.3f} {len(r['faults']):>6} {len(r['bitflips']):>6}  {flips}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals", default="25,60,300", help="mean seconds between kills, comma-separated")
    parser.add_argument("--faults", type=int, default=5, help="soak length in mean intervals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mix", action="store_true", help="kills plus bitflips: reruns against today's policy")
    parser.add_argument("--mix-wall-s", type=float, default=600.0)
    parser.add_argument("--bitflip-s", type=float, default=300.0, help=argparse.SUPPRESS)   # a quick check
    args = parser.parse_args()
    from engine.data.prepare import STDLIB, prepare

    if args.mix:
        with tempfile.TemporaryDirectory() as tmp:
            corpus = Path(tmp) / "stdlib"
            prepare([STDLIB], corpus, log=open(os.devnull, "w"))
            m = mix(corpus, Path(tmp), wall_s=args.mix_wall_s, seed=args.seed, bitflip_s=args.bitflip_s)
        _print_mix(m)
        data = results_file.read("goodput")
        data["mix"] = {**m, "created": results_file.now()}
        results_file.write("goodput", data)
        return

    rng, results = random.Random(args.seed), []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "stdlib"
        prepare([STDLIB], corpus, log=open(os.devnull, "w"))
        for interval in (float(i) for i in args.intervals.split(",")):
            wall = args.faults * interval
            faulty = soak(Path(tmp), corpus, wall_s=wall, interval_s=interval, rng=rng)
            clean = soak(Path(tmp), corpus, wall_s=wall, interval_s=None, rng=rng)
            goodput = faulty["final_step"] / max(1, clean["final_step"])
            results.append({"interval_s": interval, "goodput": goodput, "ledger": compared(goodput, faulty, clean),
                            "faulty": faulty, "clean": clean, "target": TARGETS.get(int(interval))})

    print("goodput under random rank kills (tiny, 2 ranks, warm standby, RAM tier every step)")
    print(f"{'kill every':>11} {'soak s':>7} {'kills':>6} {'steps':>7} {'clean':>7} {'goodput':>8} {'target':>7} "
          f"{'recovery s':>11} {'lost':>5}")
    for r in results:
        f = r["faulty"]["faults"]
        rec = [x["recovery_s"] for x in f if x["recovery_s"] is not None]
        lost = [x["lost_steps"] for x in f if x["lost_steps"] is not None]
        target = f"{r['target']:.2f}" if r["target"] else "-"
        print(f"{r['interval_s']:>10.0f}s {r['faulty']['wall_s']:>7.0f} {len(f):>6} {r['faulty']['final_step']:>7} "
              f"{r['clean']['final_step']:>7} {r['goodput']:>8.3f} {target:>7} "
              f"{statistics.median(rec) if rec else float('nan'):>11.2f} {statistics.median(lost) if lost else '-':>5}")
    print("the daemon's goodput ledger of the same runs (productive s / wall s; relative: faulty / clean)")
    print("beside the bench's goodput at each run's own pace (steps × median step period, faulty / clean) and its "
          "ratio of steps")
    print(f"{'kill every':>11} {'faulty':>7} {'clean':>7} {'relative':>9} {'paced':>7} {'points':>7} {'steps':>7} "
          f"{'points':>7} {'restarts':>9}")
    for r in results:
        led = r["ledger"]
        cell = lambda v: f"{v:.3f}" if v is not None else "-"
        pts = lambda v: f"{v:+.2f}" if v is not None else "-"
        print(f"{r['interval_s']:>10.0f}s {cell(led['faulty']):>7} {cell(led['clean']):>7} {cell(led['relative']):>9} "
              f"{cell(led['paced']):>7} {pts(led['difference_points']):>7} {r['goodput']:>7.3f} "
              f"{pts(led['difference_from_steps_points']):>7} {cell(led.get('restarts')):>9}")
    # a run of some intervals replaces those and keeps the others' earlier results (each with its date)
    now, before = results_file.now(), results_file.read("goodput")
    ran = {r["interval_s"] for r in results}
    merged = sorted([r for r in before.get("results", []) if r["interval_s"] not in ran]
                    + [{**r, "created": now} for r in results], key=lambda r: r["interval_s"])
    mixed = before.get("mix")     # --mix's, kept
    results_file.write("goodput", {"config": "configs/tiny.toml (2 ranks)", "overrides": EXTRA, "results": merged,
                                   "created": now, **({"mix": mixed} if mixed else {})})


if __name__ == "__main__":
    main()
