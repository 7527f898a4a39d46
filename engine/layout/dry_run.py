"""`llm-pretrain plan --dry-run`: MindSpore's own simulation compile of each pipeline stage.

Owns: finding the Ascend toolkit, the command and environment of one simulated
rank per pipeline stage, reading the compiler's peak memory from its log, and
the lines printed next to the estimate. It runs MindSpore's dry run the way
MindFormers' tooling does: no devices and no cluster, one process per stage,
each told which rank it plays (`MS_SIMULATION_LEVEL=1`, `RANK_SIZE` = the
layout's devices, `RANK_ID` = the stage's first rank); each compiles the real
step for the real layout and reports the memory its graph would allocate. The
rank trains one simulated step and saves nothing (engine/rank/trainer.py).

Before that, every rank's graph is compiled at `MS_SIMULATION_LEVEL=0` (the
frontend and the parallel passes only, on the CPU): what a semi-auto layout
gets wrong — a strategy that does not fit, an optimizer state shaped unlike its
sliced weight, a construct that does not parse — fails there, per rank, in
seconds to minutes instead of at the cluster's first step.

Where the toolkit is missing it says so plainly (exit 69) — MindSpore refuses a
distributed dry run on the CPU backend.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping

from contracts.config import Config
from engine.layout.memory_model import GIB, Layout, estimate

TOOLKIT_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
TOOLKIT_DIRS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")
SIMULATION_LEVEL = "1"          # compile, infer shapes and allocate (in simulation): memory is known
COMPILE_LEVEL = "0"             # compile the graph only: every rank's, on the CPU
# the memory pool's summary: "Actual peak memory usage (with fragments): 48874M" (MindFormers' dry-run guide;
# "Used peak memory usage (without fragments)" beside it), or the pool's "actual peak used mem: 1300M"
_PEAK = re.compile(r"actual peak (?:used )?mem(?:ory)?(?: usage)?(?: \([^)]*\))?\s*:\s*([\d.]+)\s*([KMGT]?)B?",
                   re.IGNORECASE)
_UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}


class DryRunUnavailableError(RuntimeError):
    """The dry run needs the Ascend toolkit (and MindSpore's Ascend build); exit 69."""


def toolkit_home(env: Mapping[str, str] = os.environ) -> Path | None:
    for key in TOOLKIT_ENV:
        if env.get(key) and Path(env[key]).is_dir():
            return Path(env[key])
    for candidate in TOOLKIT_DIRS:
        if Path(candidate).is_dir():
            return Path(candidate)
    return None


def stage_ranks(layout: Layout) -> list[int]:
    """The rank that plays each pipeline stage: its first (stage-major rank order, engine.layout.parallel)."""
    return [stage * layout.dp * layout.tp for stage in range(layout.pp)]


def peak_bytes(log: str) -> int | None:
    """The largest "actual peak" the memory pool reported, in bytes (None if it reported none)."""
    found = [float(value) * _UNITS[unit.upper()] for value, unit in _PEAK.findall(log)]
    return int(max(found)) if found else None


def stage_command(config: str | None, overrides: list[str], workdir: Path) -> list[str]:
    argv = [sys.executable, "-m", "cli", "train", "--log-format", "json"]
    if config:
        argv += ["--config", config]
    for item in [*overrides, f"run.dir={str(workdir)!r}", 'data.source="synthetic"', "checkpoint.interval_steps=0"]:
        argv += ["--set", item]
    return argv


def stage_env(layout: Layout, rank: int, base: Mapping[str, str] = os.environ,
              level: str = SIMULATION_LEVEL, ir_dir: Path | None = None) -> dict[str, str]:
    """A simulated rank's environment. The memory run logs at INFO (GLOG_v=1: the pool's summary); the
    graph compile at WARNING (INFO would be most of its time). With `ir_dir`, the graph after the
    parallel pass (`step_parallel_end_*.ir`: the partitioned graph, with the inserted collectives and
    the sliced parameters' shapes) is saved there, and nothing else."""
    env = {k: v for k, v in base.items() if not k.startswith("MS_ROLE")}
    env.update({"MS_SIMULATION_LEVEL": level, "RANK_SIZE": str(layout.devices), "RANK_ID": str(rank),
                "GLOG_v": "1" if level == SIMULATION_LEVEL else "2", "GLOG_logtostderr": "1"})
    if ir_dir is not None:
        env.update({"MS_DEV_SAVE_GRAPHS": "1", "MS_DEV_SAVE_GRAPHS_PATH": str(ir_dir),
                    "MS_DEV_DUMP_IR_PASSES": "step_parallel_end"})
    return env


def simulate(config: str | None, overrides: list[str], layout: Layout, rank: int, level: str,
             timeout_s: float, ir_dir: Path | None = None) -> subprocess.CompletedProcess:
    """One simulated rank (`cli train` under MS_SIMULATION_LEVEL), its output captured."""
    with tempfile.TemporaryDirectory(prefix="llm-pretrain-dryrun-") as tmp:
        return subprocess.run(stage_command(config, overrides, Path(tmp)),
                              env=stage_env(layout, rank, level=level, ir_dir=ir_dir),
                              capture_output=True, text=True, timeout=timeout_s)


_simulate = simulate
# MindSpore's own log lines (glog: "[INFO] PARALLEL(pid,...)", "[WARNING] ...", "[ERROR] ME(...)") and
# the rank's closing line, which points at the traceback above it
_GLOG = re.compile(r"^\[(DEBUG|INFO|WARNING|ERROR|CRITICAL)\] ")
_EXCEPTION = re.compile(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:")


def error_line(done: subprocess.CompletedProcess) -> str:
    """Why a simulated rank failed: the exception its traceback ends with, else its last line that is not
    MindSpore's log (a failed compile ends with INFO lines after the error)."""
    def mine(text: str) -> list[str]:
        return [line.strip() for line in text.splitlines() if line.strip() and not _GLOG.match(line)]

    lines = mine(done.stderr) or mine(done.stdout)
    raised = [line for line in lines if _EXCEPTION.match(line)]
    return (raised or lines or ["no output"])[-1]


_last_line = error_line


def compile_every_rank(config: str | None, overrides: list[str], layout: Layout, *, timeout_s: float) -> bool:
    """Each rank's graph compiled at MS_SIMULATION_LEVEL=0; prints one line per rank that fails."""
    print(f"\ngraph compile of every rank (MS_SIMULATION_LEVEL={COMPILE_LEVEL}): {layout.devices} ranks")
    failed = 0
    for rank in range(layout.devices):
        done = simulate(config, overrides, layout, rank, COMPILE_LEVEL, timeout_s)
        if done.returncode != 0:
            failed += 1
            print(f"  rank {rank}: exit {done.returncode}: {error_line(done)}")
    print(f"  {layout.devices - failed} of {layout.devices} ranks compiled")
    return failed == 0


def run(config: str | None, overrides: list[str], cfg: Config, layout: Layout, *, timeout_s: float = 3600.0) -> None:
    """Compiles each stage in simulation and prints its peak beside the estimate."""
    home = toolkit_home()
    if home is None:
        raise DryRunUnavailableError(
            "plan --dry-run needs the Ascend toolkit (CANN) and MindSpore's Ascend build on this host (looked at "
            f"${', $'.join(TOOLKIT_ENV)} and {', '.join(TOOLKIT_DIRS)}); the estimate above needs neither")
    compile_every_rank(config, overrides, layout, timeout_s=timeout_s)
    estimated = estimate(cfg, layout, runtime=True)
    print(f"\ndry run: MindSpore's simulation compile (MS_SIMULATION_LEVEL={SIMULATION_LEVEL}, toolkit {home}), "
          f"one process per pipeline stage")
    for stage, rank in enumerate(stage_ranks(layout)):
        done = simulate(config, overrides, layout, rank, SIMULATION_LEVEL, timeout_s)
        mine = estimated[stage].total
        if done.returncode != 0:           # a failed compile still prints the pool's summary: "... 0M"
            print(f"  stage {stage} (rank {rank}): failed (exit {done.returncode}): {error_line(done)}")
            continue
        peak = peak_bytes(done.stdout + done.stderr)
        if not peak:
            print(f"  stage {stage} (rank {rank}): no peak memory reported")
            continue
        print(f"  stage {stage} (rank {rank}): compiler {peak / GIB:.2f} GiB, estimate {mine / GIB:.2f} GiB "
              f"({(mine - peak) / peak:+.0%})")
