"""The worker: build the model and step, then run the step loop, reporting one JSON event per step.

Owns: the training loop of one rank — which samples each step feeds, the lr
of each step, and what is reported. `llm-pretrain train` runs it either as a
complete single-process trainer or as one rank of MindSpore's dynamic cluster
(the msrun-style environment the supervisor sets).
"""
from __future__ import annotations

import dataclasses
import faulthandler
import hashlib
import itertools
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence, TextIO

import numpy as np

from contracts.command_tail import hold
from contracts.config import Config
from contracts.drills import Drills
from contracts.event_sink import EventSink
from contracts.phase_board import PhaseWriter
from contracts.protocol import (
    AUTO_FIRST_STEPS,
    ENV_COMMANDS,
    ENV_EVENT_SOCKET,
    ENV_GENERATION,
    ENV_PHASE_BOARD,
    ENV_NODE,
    ENV_RECOVERY,
    ENV_RERUN,
    ENV_RESUME_STEP,
    DataFaultEvent,
    EvalEvent,
    ExitEvent,
    FingerprintEvent,
    PhaseEvent,
    RecoveryDirective,
    RerunDirective,
    StepEvent,
)
from contracts.stop_signal import StopSignal
from engine.data import order
from engine.data.corpus_blocks import CorruptBlockError
from engine.data.feed import FedStep, feed
from engine.rank import runtime
from engine.rank.commands import CommandReader
from engine.rank.startup import StartupClock
from engine.training import schedule


class Trainer:
    """One rank's model, step and data, with the loop that drives them."""

    def __init__(self, cfg: Config, rank_info: runtime.RankInfo, *, generation: int = 0,
                 overrides: Sequence[schedule.LrOverride] = (),
                 source: order.CorpusSource | order.SyntheticSource | None = None):
        from engine.training.step import build_network

        self.cfg, self.rank_info, self.generation = cfg, rank_info, generation
        self.overrides = list(overrides)
        self.parallelism = rank_info.parallelism
        self.net, self.step_fn = build_network(cfg, self.parallelism, rank=rank_info.rank,
                                               world=rank_info.world_size, gradient_sum=rank_info.gradient_sum)
        self.source = source if source is not None else order.open_source(cfg)
        self.skips: list[tuple[int, int]] = []   # global sample ranges never trained on (set_skips)
        self.step = 0                      # optimizer steps completed
        self.cursor = 0                    # data position: the next global sample index
        self._fed: Iterator[FedStep] | None = None
        self._last_end: float | None = None     # when the previous step ended (host time since: host_s)
        self.agreed_control: tuple[int, ...] = ()
        self.phases = None                 # contracts.phase_board.PhaseWriter, under a daemon (attach_phases)
        self.rotation = (0, 0, -1)         # a rotated rerun's (k, first step, last step): see rotate

    def compile_step(self) -> None:
        """Compiles the step without running it (under semi-auto parallel this slices the parameters)."""
        t = self.cfg.train
        rows = self.parallelism.rank_batch(np.arange(t.global_batch), self.rank_info.rank).shape[1]
        self.step_fn.compile(np.zeros((t.grad_accum_steps, rows, self.cfg.data.seq_len + 1), np.int32))

    def rotate(self, k: int, first_step: int, last_step: int) -> None:
        """A rotated rerun (contracts.protocol.RerunDirective.rotate): in steps first..last this rank trains on
        the share of rank (rank + k) % dp, so a fault that follows the data moves to another rank and one
        of the device stays."""
        if k % self.cfg.parallel.dp and not self.parallelism.semi_auto:
            self.rotation = (k, first_step, last_step)
            self._fed = None

    def share_of(self, step: int) -> int:
        """The rank whose share of the data this rank trains on at `step` (its own but in a rotated rerun)."""
        rank, (k, first, last) = self.rank_info.rank, self.rotation
        return (rank + k) % self.cfg.parallel.dp if first <= step <= last else rank

    def lr(self, step: int) -> tuple[float, float]:
        o = self.cfg.optim
        return schedule.lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps,
                              cosine_steps=self.cfg.cosine_steps, overrides=self.overrides)

    def set_skips(self, skips: Sequence[tuple[int, int]]) -> None:
        self.skips = order.merge_ranges(skips)
        self._fed = None

    # The trainer's state, in the manner of torchtitan's state_dict ------------
    def state_params(self) -> list:
        """Every Parameter a checkpoint carries: the model's, then the step's (AdamW, loss scaler)."""
        return [*self.net.trainable_params(), *self.step_fn.state()]

    def run_state(self) -> dict[str, Any]:
        """The non-tensor state a checkpoint carries, as JSON-ready values (keys as in the manifest)."""
        return {"step": self.step, "data_cursor": self.cursor,
                "data_epoch": self.cursor // self.source.samples_per_epoch,
                "skip_ranges": [list(r) for r in self.skips],
                "lr_overrides": [o.to_dict() for o in self.overrides],
                "quarantined_blocks": [list(b) for b in self.source.quarantined]}

    def load_run_state(self, state: dict[str, Any]) -> None:
        """The inverse of run_state (data_epoch follows from the cursor); extra keys are ignored."""
        self.step, self.cursor = int(state["step"]), int(state["data_cursor"])
        self.set_skips([(int(a), int(b)) for a, b in state["skip_ranges"]])   # also drops the feed at the old cursor
        self.overrides = [schedule.LrOverride.from_dict(o) for o in state["lr_overrides"]]
        self.quarantine(state.get("quarantined_blocks", []))

    def quarantine(self, blocks: Sequence[Sequence]) -> None:
        """Corpus blocks never to read again (their samples are passed over in the data order)."""
        self.source.quarantine(blocks)
        self._fed = None

    def train_step(self, *, poison: float = 1.0, control: np.ndarray | None = None,
                   corrupt: bool = False) -> StepEvent:
        """Runs optimizer step number self.step + 1 and returns its event; `agreed_control` then holds
        the control vector summed over the ranks. `corrupt` (a fault drill) replaces this rank's batch
        by uniformly random token ids, as a corrupt shard would: data the model cannot predict."""
        t = self.cfg.train
        started = time.perf_counter()
        if self._fed is None:
            parallelism, steps = self.parallelism, itertools.count(self.step + 1)    # one share a step, in order
            self._fed = feed(self.source, cursor=self.cursor, steps=t.steps - self.step,
                             share=lambda indices: parallelism.rank_batch(indices, self.share_of(next(steps))),
                             global_batch=t.global_batch, skips=self.skips,
                             prefetch_steps=self.cfg.data.prefetch_steps)
        self._mark("data")
        fed = next(self._fed, None)
        if fed is None:
            raise RuntimeError(f"the input pipeline is exhausted after step {self.step} of {t.steps}")
        data_wait_s = time.perf_counter() - started
        lr, multiplier = self.lr(self.step + 1)
        batch = fed.batch
        if corrupt:
            rng = np.random.default_rng(self.step + 1)
            batch = rng.integers(0, self.cfg.model.vocab_size, size=batch.shape, dtype=batch.dtype)
        computing = time.perf_counter()
        host_s = computing - (self._last_end if self._last_end is not None else started)
        self._mark("compute")
        result = self.step_fn.run(batch, lr, poison=poison, control=control)
        self._last_end = time.perf_counter()
        self._mark("between", self.step + 1)
        step_s = self._last_end - started
        sample_start, sample_end = fed.sample_start, fed.sample_end
        self.step += 1
        self.cursor = fed.cursor_after
        self.agreed_control = result.control
        tokens = t.global_batch * self.cfg.data.seq_len
        return StepEvent(rank=self.rank_info.rank, generation=self.generation, step=self.step,
                         loss=result.loss, grad_norm=result.grad_norm, loss_scale=result.loss_scale, lr=lr,
                         lr_multiplier=multiplier, skipped=result.skipped, sample_start=sample_start,
                         sample_end=sample_end, tokens=tokens, step_s=step_s, data_wait_s=data_wait_s,
                         tokens_per_s=tokens / step_s, host_s=host_s, sync_s=result.sync_s,
                         rank_losses=result.rank_losses, rank_grad_norms=result.rank_grad_norms)

    def _mark(self, phase: str, step: int | None = None) -> None:
        """This rank enters `phase` of step `step` (default: the one under way), on its phase board."""
        if self.phases is not None:
            step = self.step + 1 if step is None else step
            if phase == "compute" and hasattr(self.step_fn, "phase_step"):
                self.step_fn.phase_step = step           # the step's own marks (the gradient sum, the update)
            self.phases.enter(phase, step)

    def attach_phases(self, writer) -> None:
        """The rank's phase board (contracts.phase_board.PhaseWriter): the trainer and its step write to it."""
        self.phases = writer
        if hasattr(self.step_fn, "phases"):
            self.step_fn.phases = writer

    def apply_recovery(self, recovery: RecoveryDirective, restored_step: int) -> int:
        """The policy's directive after a rollback (see contracts.protocol.RecoveryDirective); returns the step
        at which the loss-scale cap it set must be lifted (0: no cap)."""
        from engine.training import loss_scale

        self.set_skips([*self.skips, *recovery.skip_ranges])
        self.quarantine(recovery.quarantined_blocks)
        self.overrides = list(recovery.lr_overrides)
        plan = loss_scale.after_recovery(recovery, restored_step=restored_step, step=self.step)
        return self.step_fn.scaler.follow(plan)

    def init_from_hf(self, directory: str) -> int:
        """Sets every model parameter from a Hugging Face LLaMA directory; returns the count."""
        from contracts.errors import ConfigError
        from engine.interop import hf
        from engine.rank.checkpoint import set_parameters

        params = list(self.net.trainable_params())
        set_parameters(params, hf.load_for_init(Path(directory), self.cfg.model),
                       source=f"model.init_from: {directory}", error=ConfigError)
        return len(params)

    def lift_loss_scale_cap(self) -> None:
        self.step_fn.scaler.lift_cap()

    def replicas_compare(self) -> bool:
        """Whether this rank's parameters have replicas to compare with: data parallel, unsliced."""
        return self.cfg.parallel.dp > 1 and not self.parallelism.semi_auto

    def fingerprint(self) -> tuple[list[int], list[str]]:
        """engine.rank.fingerprint's digest of the model's parameters, and each group's first name."""
        from engine.rank import fingerprint

        params = list(self.net.trainable_params())
        names = [params[a].name for a, _ in fingerprint.group_bounds(len(params))]
        return fingerprint.fingerprint([p.asnumpy() for p in params]), names

    def flip_weight_bit(self) -> str:
        """The corrupt-weight drill: one bit of the first parameter's first element, flipped; its name."""
        from engine.rank import fingerprint
        from engine.rank.checkpoint import set_parameters

        p = next(iter(self.net.trainable_params()))
        set_parameters([p], {p.name: fingerprint.flip_bit(p.asnumpy())}, source="the corrupt-weight drill",
                       error=RuntimeError)
        return p.name

    def params_sha256(self) -> str:
        """Over every parameter's name and bytes; one still holding its initializer (semi-auto, before the
        compile sliced it, or another stage's) counts by name only: reading it would build it whole."""
        digest = hashlib.sha256()
        for p in self.net.trainable_params():
            digest.update(p.name.encode())
            if not p.has_init:
                digest.update(np.ascontiguousarray(p.asnumpy()).tobytes())
        return digest.hexdigest()


STOP_SLOT = 0   # control vector: [stop flag, command window (engine.rank.commands.WINDOW slots)]


def train(cfg: Config, *, out: TextIO = sys.stdout, env=os.environ, until_step: int | None = None,
          allow_config_change: bool = False) -> ExitEvent:
    """Resumes from the run's newest checkpoint, trains to cfg.train.steps (or `until_step`), saving
    every checkpoint.interval_steps, on SIGTERM/SIGINT or a `stop`/`checkpoint` command, and at the end.
    Every rank emits its events (steps, phases, checkpoints) as JSON lines and, under the supervisor,
    datagrams; raises CheckpointSaveError if the last save fails."""
    run = RankRun.start(cfg, out=out, env=env)          # data, signals, events, MindSpore and its cluster
    run.restore(allow_config_change=allow_config_change)  # model, step, checkpoint (or init_from), recovery
    reason = run.loop(until_step)                       # steps, agreed commands, saves, pauses
    return run.finish(reason)                           # the last save, the exit event


class RankRun:
    """One rank's run of `train`, in named steps: start, restore, loop (step, agree, save, pause), finish."""

    def __init__(self, cfg: Config, env, *, clock: StartupClock, source, stop: StopSignal, sink: EventSink,
                 rank_info: runtime.RankInfo, held_out: np.ndarray | None = None):
        self.cfg, self.env, self.clock, self.source, self.stop, self.sink = cfg, env, clock, source, stop, sink
        self.rank_info = rank_info
        self.generation = int(env.get(ENV_GENERATION, "0"))
        self.commands = CommandReader(env.get(ENV_COMMANDS), generation=self.generation)
        self.rerun = _read_directive(env, ENV_RERUN, RerunDirective)    # a generation that reruns an incident's steps
        self.drills = Drills(rank=rank_info.rank, allowed=cfg.health.allow_fault_injection, env=env,
                             dp=cfg.parallel.dp, marks=cfg.run.resolved_dir(env) / "drills", rerun=self.rerun)
        self.applied = 0                  # the highest command sequence number applied
        self.cap_until = 0                # the step at which the recovery's loss-scale cap is lifted (0: none)
        self.simulated = bool(env.get("MS_SIMULATION_LEVEL"))   # `plan --dry-run`: one compiled step, nothing saved
        self.trainer: Trainer | None = None
        self.ckpt = None
        self.held_out = held_out          # the validation sequences (order.validation_batches), or None
        self.evaluator = None             # built at the first evaluation (its graph compiles then)
        # how often to save to disk and to the RAM tier: as configured, or ("auto") as the daemon says
        self.intervals = {key: value if isinstance(value, int) else AUTO_FIRST_STEPS for key, value in (
            ("interval_steps", cfg.checkpoint.interval_steps),
            ("memory_interval_steps", cfg.checkpoint.memory_interval_steps))}
        # since the previous step's end: what its own events say (saves, validation, a pause, the
        # fingerprint), and of it the RAM tier's saves, said in the next step's event (the goodput ledger)
        self.aside_s = self.memory_save_s = 0.0

    @classmethod
    def start(cls, cfg: Config, *, out: TextIO, env) -> RankRun:
        clock = StartupClock()
        clock.mark("launch")                  # interpreter, imports, config and resume checks
        source = order.open_source(cfg)       # bad data fails here, before the cluster forms
        held_out = order.validation_batches(cfg, source)
        clock.mark("data")
        stop = StopSignal()                   # from here on, SIGTERM asks for a save and a clean exit
        faulthandler.register(signal.SIGUSR1, all_threads=True)   # the supervisor's stack dump of a hung rank
        faulthandler.enable(all_threads=True)        # a crash (SIGSEGV, SIGBUS, SIGABRT...) says where, in the log
        sink = EventSink(out, env.get(ENV_EVENT_SOCKET))
        import mindspore  # noqa: F401  (timed on its own; runtime.setup uses it)

        clock.mark("import")
        rank_info = runtime.setup(cfg, env)
        clock.mark("cluster")
        return cls(cfg, env, clock=clock, source=source, stop=stop, sink=sink, rank_info=rank_info,
                   held_out=held_out)

    def phase(self, name: str, step: int = 0, **more) -> None:
        self.sink.emit(PhaseEvent(rank=self.rank_info.rank, generation=self.generation, phase=name, step=step, **more))

    def board(self, phase: str) -> None:
        """This rank's place on its phase board, outside a step (saving, evaluating, paused, between)."""
        if self.trainer is not None and self.trainer.phases is not None:
            self.trainer.phases.enter(phase, self.trainer.step)

    def restore(self, *, allow_config_change: bool) -> None:
        from engine.rank.checkpoint import TrainerCheckpoints

        cfg, env, rank_info = self.cfg, self.env, self.rank_info
        self.phase("restore")
        trainer = self.trainer = Trainer(cfg, rank_info, generation=self.generation, source=self.source)
        if env.get(ENV_PHASE_BOARD):          # the daemon reads where this rank is inside each step
            trainer.attach_phases(PhaseWriter(env[ENV_PHASE_BOARD], rank_info.rank))
        self.clock.mark("build")
        # Under the supervisor, retention is its job: it knows which checkpoints its incidents still need.
        retain = rank_info.rank == 0 and not env.get(ENV_EVENT_SOCKET)
        self.ckpt = TrainerCheckpoints(cfg.run.resolved_dir(env) / "checkpoints", cfg, params=trainer.state_params(),
                                       run_state=trainer.run_state, load_run_state=trainer.load_run_state,
                                       rank=rank_info.rank, world=rank_info.world_size, generation=self.generation,
                                       emit=self.sink.emit, parallelism=rank_info.parallelism, retain=retain,
                                       supervised=bool(env.get(ENV_EVENT_SOCKET)),
                                       local_world=rank_info.local_world_size, node=int(env.get(ENV_NODE, "0")))
        agreed = env.get(ENV_RESUME_STEP)         # several machines: the step their daemons agreed on
        restored = self.ckpt.restore_latest(allow_config_change=allow_config_change,
                                            before_slices=trainer.compile_step,
                                            agreed_step=int(agreed) if agreed else None)
        if restored is None and cfg.model.init_from:
            count = trainer.init_from_hf(cfg.model.init_from.removeprefix("hf:"))
            print(f"llm-pretrain: initialized {count} parameters from {cfg.model.init_from}", file=sys.stderr,
                  flush=True)
        if self.rerun is not None and self.rerun.rotate:
            trainer.rotate(self.rerun.rotate, self.rerun.first_step, self.rerun.last_step)
        recovery = _read_directive(env, ENV_RECOVERY, RecoveryDirective)
        if recovery:
            self.cap_until = trainer.apply_recovery(recovery, restored["step"] if restored else 0)

    def loop(self, until_step: int | None) -> str:
        """Trains to the last step; returns why it ended (finished, until_step, stopped, released)."""
        trainer, cfg = self.trainer, self.cfg
        last = min(cfg.train.steps, until_step) if until_step is not None else cfg.train.steps
        if self.simulated:
            last = min(last, trainer.step + 1)
        reason = "finished" if last == cfg.train.steps else "until_step"
        self.clock.mark("restore")
        if trainer.step < last:
            self.phase("compile", trainer.step, startup_s=self.clock.stages)
        while trainer.step < last:
            event, agreed = self._step(last)
            stopping, pausing, save_now = self._agree(event, agreed, last)
            aside = time.perf_counter()
            if self._save(event, save_now) == "memory":
                self.memory_save_s += time.perf_counter() - aside
            self._fingerprint(event.step)
            if stopping:
                return "stopped"
            self._evaluate(event.step, last)
            if pausing:
                outcome = self._pause()
                if outcome != "resume":
                    return "stopped" if outcome == "stop" else "released"
            self.aside_s += time.perf_counter() - aside
        return reason

    def _step(self, last: int) -> tuple[StepEvent, np.ndarray]:
        """One optimizer step, with this rank's stop flag and commands read fed into its agreement."""
        trainer, rank = self.trainer, self.rank_info.rank
        self.commands.poll()
        self.ckpt.poll()
        control = np.concatenate([[int(self.stop.requested)], self.commands.encode(self.applied)]).astype(np.int32)
        if self.drills.corrupts_weight(trainer.step + 1):
            trainer.flip_weight_bit()
        poison, corrupt = self.drills.before_step(trainer.step + 1, entering=trainer._mark)
        try:
            event = trainer.train_step(control=control, poison=poison, corrupt=corrupt)
        except CorruptBlockError as e:
            # before any rank trained on it: the supervisor quarantines the blocks and restarts
            self.sink.emit(DataFaultEvent(rank=rank, generation=self.generation, step=trainer.step + 1,
                                          corpus=e.path, blocks=[b.to_dict() for b in e.bad], detail=str(e),
                                          corpus_blocks=e.corpus_blocks))
            raise
        # host_s less the data wait and what is said elsewhere: the loop's own work (this event's sending,
        # the commands, the drills) goes with the step
        event = dataclasses.replace(event, loop_s=max(0.0, event.host_s - event.data_wait_s - self.aside_s),
                                    memory_save_s=self.memory_save_s)
        self.aside_s = self.memory_save_s = 0.0
        # every step to the supervisor (its health detectors), every log interval to the rank's log
        self.sink.emit(event, log=event.step % self.cfg.train.log_interval_steps == 0 or event.step == last)
        if self.cap_until and trainer.step >= self.cap_until:
            trainer.lift_loss_scale_cap()
            self.cap_until = 0
        return event, np.asarray(trainer.agreed_control)

    def _agree(self, event: StepEvent, agreed: np.ndarray, last: int) -> tuple[bool, bool, bool]:
        """What every rank applies after this step: (stop, pause, save now)."""
        interval = self.intervals["interval_steps"]
        stopping = bool(agreed[STOP_SLOT] > 0)
        pausing = False
        save_now = stopping or event.step == last or bool(interval and event.step % interval == 0)
        for cmd in self.commands.agreed(self.applied, agreed[1:]):
            self.applied = cmd.seq
            if cmd.name == "stop":
                stopping = save_now = True
            elif cmd.name == "checkpoint":
                save_now = True
            elif cmd.name == "pause":
                pausing = save_now = event.step < last
            elif cmd.name == "inject":
                self.drills.add(cmd.seq, cmd.args, self.trainer.step)
            elif cmd.name == "interval":          # checkpoint.interval_steps = "auto": the daemon's Young/Daly
                self.intervals.update({k: int(v) for k, v in cmd.args.items() if k in self.intervals and
                                       isinstance(v, int) and v >= 1})
        return stopping, pausing, save_now

    def _save(self, event: StepEvent, save_now: bool) -> str | None:
        """Saves after this step when due: to disk (`save_now`) or the RAM tier; says which, or None."""
        if self.simulated:
            return None
        metrics = {"loss": event.loss, "grad_norm": event.grad_norm, "lr": event.lr, "loss_scale": event.loss_scale}
        in_memory = self.cfg.checkpoint.memory_interval_steps and self.intervals["memory_interval_steps"]
        if save_now or (in_memory and event.step % in_memory == 0):
            self.board("save")
            self.ckpt.save(metrics, **({} if save_now else {"memory": True}))   # the RAM tier, between disk saves
            self.board("between")
            return "disk" if save_now else "memory"
        return None

    def _fingerprint(self, step: int) -> None:
        """Every health.fingerprint_interval_steps, this replica's digest to the supervisor, which compares
        the replicas' (daemon.judging.replicas)."""
        interval = self.cfg.health.fingerprint_interval_steps
        if not interval or step % interval or self.simulated or not self.trainer.replicas_compare():
            return
        started = time.perf_counter()
        groups, names = self.trainer.fingerprint()
        self.sink.emit(FingerprintEvent(rank=self.rank_info.rank, generation=self.generation, step=step,
                                        groups=groups, names=names, seconds=time.perf_counter() - started),
                       log=False)

    def _evaluate(self, step: int, last: int) -> None:
        """The validation loss every train.eval_interval_steps and after the last step: rank 0 measures
        it (data parallel: every rank holds the same weights); every rank says it is evaluating, so a
        peer that waits for rank 0 in the next step's collective is not taken for hung."""
        interval = self.cfg.train.eval_interval_steps
        if self.held_out is None or self.simulated or not (step % interval == 0 or step == last):
            return
        rank = self.rank_info.rank
        if self.rank_info.parallelism.semi_auto:
            if rank == 0 and self.evaluator is None:
                print("llm-pretrain: no validation loss under tensor or pipeline parallel yet (its forward needs a "
                      "parallel graph of its own); set train.eval_interval_steps = 0 to silence this",
                      file=sys.stderr, flush=True)
            self.evaluator = False
            return
        self.phase("eval", step)
        if rank != 0:
            return
        self.board("eval")
        from engine.training.evaluate import Evaluator

        if not self.evaluator:
            self.evaluator = Evaluator(self.trainer.net, self.held_out)
        loss, perplexity, seconds = self.evaluator.run()
        sequences = int(self.held_out.shape[0] * self.held_out.shape[1])
        self.sink.emit(EvalEvent(rank=rank, generation=self.generation, step=step, loss=loss, perplexity=perplexity,
                                 sequences=sequences, tokens=sequences * (self.held_out.shape[2] - 1), seconds=seconds))
        self.board("between")

    def _pause(self) -> str:
        """Every rank agreed on this step; the checkpoint is committed before holding, so the supervisor
        may release the devices at any time and resume from it. Returns resume, stop or release."""
        self.board("save")
        self.ckpt.wait()
        self.phase("paused", self.trainer.step)
        self.board("paused")
        outcome, self.applied = hold(self.commands, self.applied, self.stop)
        if outcome == "resume":
            self.phase("train", self.trainer.step)
            self.board("between")
        return outcome

    def finish(self, reason: str) -> ExitEvent:
        trainer = self.trainer
        self.phase("checkpoint", trainer.step)
        self.board("save")
        ok = self.ckpt.wait()
        if ok and not self.simulated:
            self.ckpt.drop_memory_tier()                       # the final checkpoint is on disk
        self.phase("exiting", trainer.step)
        end = ExitEvent(rank=self.rank_info.rank, generation=trainer.generation, step=trainer.step, reason=reason,
                        params_sha256=trainer.params_sha256())
        self.sink.emit(end)
        if not ok:
            raise CheckpointSaveError(f"the checkpoint of step {trainer.step} could not be saved: "
                                      f"{self.ckpt.writer.last_error}")
        return end


def _read_directive(env, variable: str, kind):
    """The daemon's directive for this generation (a RecoveryDirective or RerunDirective) from the JSON file
    `variable` names; None when there is none."""
    path = env.get(variable)
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return kind.from_json(f.read())


class CheckpointSaveError(RuntimeError):
    """The last checkpoint of a run failed: its work since the previous checkpoint is not on disk."""
