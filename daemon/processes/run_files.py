"""The run directory as the supervisor writes it for its ranks: paths, and the files of a generation.

Owns: where things are (run dir, log dir, checkpoints, the memory cgroup
directory), what a generation's ranks are handed — the resolved config
(`config.resolved.toml`), the recovery directive (`recovery.json`), a fresh
commands file, their environment — and daemon-side checkpoint retention,
which protects the newest checkpoint a rollback may still need, judged from
the run's real incident log. Paths, not policy; no processes.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Mapping, Sequence

from checkpointing import CheckpointError, layout, reader, retention
from contracts.config import Config, to_toml, with_changes
from contracts.protocol import (
    ENV_COMMANDS,
    ENV_CONFIG,
    ENV_EVENT_SOCKET,
    ENV_MEMORY_LIMIT,
    ENV_NODE,
    ENV_RECOVERY,
    ENV_RERUN,
    ENV_RESUME_STEP,
    Command,
    RecoveryDirective,
    RerunDirective,
)
from daemon.judging.cadence import interval_args
from daemon.judging.incidents import IncidentRecord
from daemon.judging.policy import newest_healthy
from daemon.processes import mindspore_env, rank_log
from daemon.processes.generation import worker_env
from daemon.records import bundles
from durable import write_atomically

RESOLVED_CONFIG = "config.resolved.toml"
_SYSTEMD_ONLY = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


class RunFiles:
    def __init__(self, cfg: Config, env: Mapping[str, str]):
        self.name = cfg.run.name
        self.run_dir = cfg.run.resolved_dir(env).absolute()
        # what is this node's own (its lock, state.json, control directory): the run directory itself on
        # one machine; on several, which share the run directory, a directory per node inside it
        self.node_dir = self.run_dir if cfg.run.nodes == 1 else self.run_dir / "nodes" / f"node-{cfg.run.node_rank}"
        self.log_dir = cfg.run.resolved_log_dir(env).absolute()
        self.ckpt_root = self.run_dir / "checkpoints"
        self.commands = self.run_dir / "commands.jsonl"
        self.recovery = self.run_dir / "recovery.json"
        self.rerun = self.run_dir / "rerun.json"
        self.resolved_config = self.run_dir / RESOLVED_CONFIG
        self.incidents_dir = self.node_dir / bundles.INCIDENTS_DIR    # post-mortem bundles (daemon.records.bundles)
        self.memory_dir = cfg.checkpoint.memory_dir
        local = cfg.parallel.world_size // cfg.run.nodes
        self.local_ranks = list(range(cfg.run.node_rank * local, (cfg.run.node_rank + 1) * local))
        self.node = cfg.run.node_rank          # this machine's own index (a generation's config numbers its slot)
        self.single_machine = cfg.run.nodes == 1   # several: the RAM step is agreed (daemon.machines.memory_agreement)
        self.agreed_step: int | None = None   # several machines: the step the generation's ranks resume from
        # checkpoint.memory_placement = "buddy": the steps a buddy's part is being or was last copied into
        # (daemon.machines.buddy_copies; retention keeps them), and the shards this machine's ranks write (the rest
        # of a retired step, copies, are not recycled: no writer here would write over them)
        self.buddy_kept: frozenset[int] = frozenset()
        self.own_shards: frozenset[str] | None = None
        self.memory_tier = bool(cfg.checkpoint.memory_interval_steps)
        self._seq = 0
        self.fence_generation = 0       # several machines: commands are stamped with their generation
        self._memory_root: Path | None = None

    def memory_root(self) -> Path | None:
        """The run's RAM tier of checkpoints (checkpoint.memory_interval_steps); None while the run
        directory does not exist."""
        if self._memory_root is None:      # the run's id, read once (the daemon asks at every RAM commit)
            try:
                self._memory_root = layout.memory_root(self.run_dir, self.memory_dir, self.node)
            except OSError:
                return None
        return self._memory_root

    def memory_steps(self) -> list[int]:
        """The RAM tier's committed checkpoints (none without one)."""
        memory = self.memory_root()
        return layout.committed_steps(memory) if memory is not None and memory.is_dir() else []

    @property
    def cgroup_dir(self) -> str:
        """The run's directory under the daemon's memory cgroup: one child per rank and generation."""
        return f"llm-pretrain-{self.name}"

    def committed_steps(self) -> list[int]:
        """Committed checkpoints that look complete (manifest, shard sizes): what the ranks will find,
        short of a checksum only they compute; one that does not is theirs to quarantine."""
        return [s for s in layout.committed_steps(self.ckpt_root)
                if not reader.looks_complete(layout.step_dir(self.ckpt_root, s))]

    def space_low(self, step: int) -> str | None:
        """Why the disk will soon refuse saves, if it will: less free space than two checkpoints the
        size of committed `step` (retention frees one at most per commit)."""
        import shutil

        try:
            manifest = reader.read_manifest(layout.step_dir(self.ckpt_root, step))
            size = sum(int(sh["size_bytes"]) for sh in manifest["shards"])
            free = shutil.disk_usage(self.ckpt_root).free
        except (OSError, ValueError, KeyError, TypeError, CheckpointError):
            return None
        if free >= 2 * size:
            return None
        return (f"{free:,} bytes free under {self.ckpt_root}: room for fewer than two more checkpoints of "
                f"{size:,} bytes (step {step}); saves will fail when it runs out")

    def committed_step(self) -> int:
        steps = self.committed_steps()
        return steps[-1] if steps else 0

    def faulty_devices(self) -> list[dict]:
        """The devices a faulty-rank drill turned faulty for good (the ranks' markers under `<run.dir>/drills/`,
        contracts.drills), as drills in force: every generation on them is labelled a drill's."""
        found = []
        for mark in sorted((self.run_dir / "drills").glob("faulty-node*-device*")):
            node, _, device = mark.name.removeprefix("faulty-node").partition("-device")
            if node.isdigit() and device.lstrip("-").isdigit():
                found.append({"fault": "faulty-rank", "node": int(node), "device": int(device)})
        return found

    def resume_step(self, common: Sequence[int] | None = None) -> int:
        """The step the ranks will resume from: the RAM tier's newest committed checkpoint where it is newer than
        the disk's (one machine: the ranks take it when it verifies, checkpointing.reader.find_newest; several:
        the newest of `common`, the RAM steps every machine of the generation holds, which the ranks are told),
        else the disk's newest. What restart, rollback and generation events and status report."""
        return self.resume_point(common)[0]

    def is_memory_path(self, path: str) -> bool:
        """`path` (a rank's `restored` event's) lies in this run's RAM tier."""
        memory = self.memory_root()
        return memory is not None and Path(path).is_relative_to(memory)

    def tier_of(self, step: int) -> str:
        """Where the ranks find `step` as the newest they resume from: "ram", "disk" or "none" (step 0: from scratch)."""
        if not step:
            return "none"
        newer = step > self.committed_step()      # several machines: only an agreed RAM step is newer than the disk
        return "ram" if newer and (not self.single_machine or step in self.memory_steps()) else "disk"

    def resume_point(self, common: Sequence[int] | None = None) -> tuple[int, str]:
        """The step the ranks will resume from and its tier: "ram" or "disk" ("none": from scratch). On several
        machines the RAM tier counts through `common` alone (see resume_step)."""
        disk = self.committed_step()
        memory = max(self.memory_steps() if self.single_machine else (common or ()), default=0)
        if memory > disk:
            return memory, "ram"
        return disk, "disk" if disk else "none"

    def retire_memory_after(self, step: int) -> list[int]:
        """A rollback's or rerun's: this machine's RAM checkpoints after `step`, retired (none may be resumed from,
        nor stand in for the steps trained again). Returns them."""
        memory, retired = self.memory_root(), []
        if memory is not None:
            for newer in layout.committed_steps(memory):
                if newer > step:
                    layout.retire(memory, newer)
                    retired.append(newer)
        return retired

    # A generation's files ----------------------------------------------------------------------
    def prepare_generation(self, cfg: Config, recovery: RecoveryDirective | None,
                           rerun: dict | None = None, cadence: dict | None = None,
                           common: Sequence[int] | None = None) -> int:
        """The resolved config, the recovery directive, the rerun directive of a generation that reruns an
        incident's steps and a fresh commands file, ready for the ranks; returns the step they resume from
        (`common`: see resume_step). The commands file starts with the checkpoint intervals in force when they
        are "auto" (`cadence`: state.json's, daemon.judging.cadence): the ranks take them after their first step."""
        run_dir, log_dir = ((self.run_dir.resolve(), self.log_dir.resolve()) if cfg.script.command   # another cwd
                            else (self.run_dir, self.log_dir))
        resolved = with_changes(cfg, {"run.dir": str(run_dir), "run.log_dir": str(log_dir)})
        write_atomically(self.resolved_config, to_toml(resolved, [
            "written by the llm-pretrain daemon for each generation: the config its ranks run with",
            "(the operator's file as the daemon read it at its start, plus the recovery policy's changes)"]))
        if recovery is not None:
            write_atomically(self.recovery, recovery.to_json())
        else:
            self.recovery.unlink(missing_ok=True)
        if rerun is not None:
            write_atomically(self.rerun, RerunDirective.from_dict(rerun).to_json())
        else:
            self.rerun.unlink(missing_ok=True)
        self._seq = 0
        self.commands.write_text("")               # commands are per generation
        if (intervals := interval_args(cfg.checkpoint, cadence)):
            self.append_command("interval", intervals)
        return self.resume_step(common)

    def append_command(self, name: str, args: dict) -> int:
        """One command line for the ranks, durable before they can read it; returns its seq."""
        self._seq += 1
        with open(self.commands, "a") as f:
            f.write(Command(seq=self._seq, name=name, args=args, generation=self.fence_generation).to_json() + "\n")
            f.flush()
            os.fsync(f.fileno())
        return self._seq

    def rank_env(self, env: Mapping[str, str], cfg: Config, *, rank: int, port: int, generation: int,
                 sock: Path) -> dict[str, str]:
        base = {k: v for k, v in env.items() if k not in _SYSTEMD_ONLY}   # the daemon speaks for them
        base.update({ENV_EVENT_SOCKET: str(sock), ENV_COMMANDS: str(self.commands), ENV_NODE: str(self.node),
                     ENV_CONFIG: str(self.resolved_config)})
        if self.recovery.exists():
            base[ENV_RECOVERY] = str(self.recovery)
        if self.rerun.exists():
            base[ENV_RERUN] = str(self.rerun)
        if self.agreed_step is not None:          # several machines: every rank resumes from the same step
            base[ENV_RESUME_STEP] = str(self.agreed_step)
        if cfg.train.device == "ascend":           # CANN's logs beside the rank's: HCCL's verdicts are read there
            base.setdefault("ASCEND_PROCESS_LOG_PATH", str(rank_log.plog_dir(self.log_dir, rank)))
        if cfg.run.worker_memory_limit_bytes:
            base[ENV_MEMORY_LIMIT] = str(cfg.run.worker_memory_limit_bytes)
        if cfg.run.compile_cache and not cfg.script.command:   # a script's graphs are its own: a cache keyed by
            # this project's model config would hand a changed script its old graph (measured: NaN from step 1)
            base.update(MS_COMPILER_CACHE_ENABLE="1", MS_COMPILER_CACHE_PATH=str(self.compile_cache_dir(cfg)))
        return worker_env(base, cfg, rank=rank, port=port, generation=generation)

    def scheduler_env(self, env: Mapping[str, str], cfg: Config, *, port: int, generation: int) -> dict[str, str]:
        world = cfg.parallel.world_size
        if mindspore_env.has_hub(cfg):
            return mindspore_env.hub_env(env, host=cfg.run.master_addr, port=port, world=world, generation=generation)
        return mindspore_env.process_env(env, role=mindspore_env.SCHEDULER, sched_host=cfg.run.master_addr, sched_port=port,
                                   worker_num=world, local_worker_num=world // cfg.run.nodes, generation=generation)

    def compile_cache_dir(self, cfg: Config) -> Path:
        """One cache per graph-shaping config: MindSpore reuses a cached graph of another shape (say,
        before the policy halved the micro-batch) and then fails with "Parameter[N] has no default
        param". Keyed by every section but the daemon's own. A local group's graphs hold no
        collective and no world size (engine/training/step.py): its data-parallel size and
        accumulation shape them only through their product and whether each is above 1, so a run
        shrunk or regrown by whole machines with the same micro-batch keeps its cache."""
        shaping = {k: v for k, v in cfg.to_dict().items() if k not in ("run", "health", "checkpoint")}
        if mindspore_env.is_local_group(cfg):
            dp, accum = shaping["parallel"].pop("dp"), shaping["train"].pop("grad_accum_steps")
            shaping["per_update"] = [dp * accum, dp > 1, accum > 1]
        key = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]
        return self.run_dir / "compile_cache" / key

    # Retention ---------------------------------------------------------------------------------
    def retire_old(self, cfg: Config, incidents: Sequence[IncidentRecord], *, current_step: int) -> list[int]:
        """After a commit: keep the newest `keep_last`, every `keep_every_steps`, and those a rollback
        may still need (see `protected_steps`); retire the rest. Returns the steps retired."""
        protected = protected_steps(self.committed_steps(), incidents, cfg, current_step=current_step)
        return retention.retire_old(self.ckpt_root, keep_last=cfg.checkpoint.keep_last,
                                    keep_every=cfg.checkpoint.keep_every_steps, protected=protected)

    def retire_memory(self, cfg: Config, incidents: Sequence[IncidentRecord], *, current_step: int) -> list[int]:
        """After a RAM-tier commit: under the daemon the ranks retire none of the RAM tier's checkpoints, the daemon
        does, by the disk's rule (`protected_steps`: what a rerun or rollback of an incident not yet cleared may
        need) and the newest MEMORY_KEEP; every rank's shards are in the one directory, so all keep the same steps.
        What it retires, the ranks' next saves write over (layout's `.spare/`). Returns the steps retired."""
        memory = self.memory_root()
        if memory is None:
            return []
        steps = layout.committed_steps(memory)
        protected = protected_steps(steps, incidents, cfg, current_step=current_step) | self.buddy_kept
        try:
            return retention.retire_old(memory, keep_last=MEMORY_KEEP, protected=protected,
                                        recycle=True if self.own_shards is None else self.own_shards)
        except OSError:            # the tmpfs refused: tried again at the next commit; never the daemon's end
            return []


MEMORY_KEEP = 2      # the RAM tier's newest kept besides what protected_steps keeps (engine.rank.checkpoint's, alone)


def detection_hold(cfg: Config) -> int:
    """The steps a numerical incident may take to be detected after its first step: the longest streak a detector
    waits for (a loss spike's or collapse's hold, a rank outlier's, an fp16 overflow storm's length); 1: at once."""
    h = cfg.health
    return max(h.loss_spike_hold_steps, h.rank_outlier_steps,
               h.overflow_storm_steps if cfg.train.precision == "fp16" else 1, 1)


def protected_steps(committed: Sequence[int], incidents: Sequence[IncidentRecord], cfg: Config, *,
                    current_step: int) -> set[int]:
    """The checkpoints a rerun or rollback may still need, in either tier. An incident not yet detected started
    after `current_step` - its hold (`detection_hold`), else it would have been detected already; its rollback
    target is the newest healthy checkpoint more than the rollback margin before its start, its rerun's the
    newest healthy one before it. So: the newest healthy one (by the incident log) at or before that horizon,
    and every one after it, since any of those may become the target as steps go on. `current_step` stops
    at an incident's detection (daemon.judging.watch.Watch.judged_step) until it is decided."""
    h = cfg.health
    horizon = current_step - detection_hold(cfg) - h.rollback_margin_steps
    rolled = [r.incident for r in incidents if r.is_rollback]
    settled = newest_healthy([s for s in committed if s <= horizon], rolled, h.rollback_margin_steps)
    return {s for s in committed if s > horizon} | ({settled} if settled else set())
