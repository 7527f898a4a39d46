"""The soak: random real faults into a live run at exponential intervals, each waited out, then a report.

Faults come in rounds: every fault named once per round, in a seeded random order, so a short
soak still covers each kind. One fault at a time: the next comes a random interval after the
previous one has been recovered from. When the duration or the fault count is reached the run
is left to finish; the report gives each fault's detection and recovery time and the steps it
cost, the goodput (the final trajectory's step time over the wall time) and, when every fault
was of the crash kind, whether the final parameters equal an uninterrupted run's (`--reference`
trains one beside the run, same config, no faults).
"""
from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from chaos import faults
from chaos.view import RunView
from contracts.config import Config
from durable import write_atomically

POLL_S = 0.2


class Daemon:
    """The daemon under test: started (and restarted after a kill, as systemd's Restart= would)
    by the soak, or attached to one a service manager runs and restarts."""

    def __init__(self, config_args: Sequence[str] | None, log_dir: Path, restart_delay_s: float = 1.0):
        self.config_args, self.log_dir, self.delay = config_args, log_dir, restart_delay_s
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def owned(self) -> bool:
        return self.config_args is not None

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        out = open(self.log_dir / f"chaos-daemon-{self.starts}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "cli", "run", *self.config_args],
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def killed(self, pid: int) -> None:
        if not self.owned:
            return                                    # the service manager brings it back
        if self.proc is not None and self.proc.pid == pid:
            self.proc.wait()
        time.sleep(self.delay)
        self.start()

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None


@dataclasses.dataclass
class Plan:
    faults: Sequence[str]
    duration_s: float
    mean_interval_s: float
    max_faults: int | None = None
    seed: int = 0
    recover_timeout_s: float = 600.0
    finish_timeout_s: float = 3600.0


class Soak:
    def __init__(self, cfg: Config, plan: Plan, daemon: Daemon, out: TextIO = sys.stdout):
        self.cfg, self.plan, self.daemon, self.out = cfg, plan, daemon, out
        self.run_dir = cfg.run.resolved_dir().absolute()
        self.view = RunView(self.run_dir, cfg.run.resolved_log_dir().absolute())
        self.rng = random.Random(plan.seed)
        self.injections: list[faults.Injection] = []

    def say(self, text: str) -> None:
        print(f"chaos: {text}", file=self.out, flush=True)

    def run(self) -> dict[str, Any]:
        started = time.time()
        if self.daemon.owned:
            self.daemon.start()
        self._wait(lambda: self.view.last_step()[1] > 0 or self._finished(), 900, "the run's first step")
        for fault in self._schedule(started):
            if self._finished():
                break
            inj = faults.inject(fault, self)
            self.injections.append(inj)
            self.say(f"{fault} at step {inj.step}: {inj.detail}")
            if not self._wait(lambda: faults.settled(self, inj), self.plan.recover_timeout_s, ""):
                inj.error = f"not recovered within {self.plan.recover_timeout_s:g} s"
                faults.clear_disk(self)
                self.say(f"{fault}: {inj.error}")
                break
            self.say(f"{fault}: detected in {inj.to_dict()['detection_s']} s, recovered in "
                     f"{inj.to_dict()['recovery_s']} s, {inj.lost_steps} step(s) lost")
        finished = self._wait(self._finished, self.plan.finish_timeout_s, "the run to finish")
        return self._report(started, time.time(), finished)

    def _schedule(self, started: float):
        count = 0
        while time.time() - started < self.plan.duration_s:
            order = list(self.plan.faults)
            self.rng.shuffle(order)
            for fault in order:
                if self.plan.max_faults is not None and count >= self.plan.max_faults:
                    return
                deadline = time.time() + self.rng.expovariate(1.0 / self.plan.mean_interval_s)
                while time.time() < deadline and not self._finished():
                    time.sleep(POLL_S)
                if time.time() - started >= self.plan.duration_s or self._finished():
                    return
                count += 1
                yield fault

    def _finished(self) -> bool:
        if self.daemon.owned:
            return self.daemon.exit_code() is not None
        done = [e for e in self.view.events() if e.get("event") == "daemon_exit"]
        return bool(done) and done[-1].get("reason") == "finished"

    def _wait(self, predicate, timeout_s: float, what: str) -> bool:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if predicate():
                return True
            time.sleep(POLL_S)
        if what:
            self.say(f"gave up waiting for {what} after {timeout_s:g} s")
        return False

    def _report(self, started: float, ended: float, finished: bool) -> dict[str, Any]:
        final: dict[int, float] = {}
        for s in self.view.steps():
            final[s.step] = s.step_s                     # the last generation's word on each step
        exits = [e for e in self.view.events(started) if e.get("event") == "daemon_exit"]
        return {"run": str(self.run_dir), "faults": [i.to_dict() for i in self.injections],
                "plan": dataclasses.asdict(self.plan), "wall_s": round(ended - started, 3),
                "final_step": max(final, default=0), "finished": finished,
                "daemon_exit_code": exits[-1].get("code") if exits else None,
                "goodput": round(sum(final.values()) / (ended - started), 4),
                "lost_steps": sum(i.lost_steps or 0 for i in self.injections),
                "checkpoint_interval_steps": self.cfg.checkpoint.interval_steps,
                "params_sha256": self.view.final_digest() if finished else None,
                "daemon_starts": self.daemon.starts}


def reference_digest(cfg: Config, directory: Path, timeout_s: float) -> str | None:
    """Trains the same config uninterrupted in `directory`; rank 0's final parameter digest."""
    resolved = cfg.run.resolved_dir().absolute() / "config.resolved.toml"
    sets = [f'run.dir="{directory}"', f'run.log_dir="{directory / "logs"}"', f'run.name="{cfg.run.name}-reference"']
    args = ["--config", str(resolved), *sum((["--set", s] for s in sets), [])]
    done = subprocess.run([sys.executable, "-m", "cli", "run", *args], capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        return None
    return RunView(directory, directory / "logs").final_digest()


def verdict(report: dict[str, Any], reference: str | None) -> dict[str, Any]:
    """Adds `bit_exact` (None: not comparable, with the reason) and `ok` to the report."""
    kinds = {f["fault"] for f in report["faults"]}
    if not report["finished"]:
        exact, why = None, "the run did not finish"
    elif kinds - set(faults.CRASH_ONLY):
        exact, why = None, "numerical faults roll back and change the trajectory by design"
    elif reference is None:
        exact, why = None, "no reference run (--reference)"
    else:
        exact, why = report["params_sha256"] == reference, ""
    recovered = all(f["error"] is None for f in report["faults"])
    return {**report, "reference_sha256": reference, "bit_exact": exact, "bit_exact_note": why,
            "ok": bool(report["finished"] and report["daemon_exit_code"] == 0 and recovered and exact is not False)}


def write_report(report: dict[str, Any], path: Path) -> None:
    write_atomically(path, json.dumps(report, indent=2, sort_keys=True) + "\n")
