"""A supervised script's rank, as a few calls: restore, begin a step, end it with what it measured, finish.

Owns what the engine's rank loop does around its step (engine/rank/trainer.py), for a step it does not own:
the phases the daemon's hang timeouts read, one step event per step, the daemon's commands agreed by every rank
and applied after the same step (pause — holding until resume, release or stop —, checkpoint now, stop, the
drills, the checkpoint interval), SIGTERM as a stop with a save, saves at the configured intervals in both
tiers, and the recovery directive (skip ranges, lr overrides, the loss scale and its cap) after a restore.
Outside the daemon (no LLM_PRETRAIN_CONFIG) every call is a cheap no-op and `training` runs to `steps`.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import hashlib
import math
import shutil
import signal
import sys
import time
from typing import Any, Sequence

from contracts.command_tail import CommandTail, hold
from contracts.drills import Drills
from contracts.event_sink import EventSink
from contracts.phase_board import PhaseWriter
from contracts.protocol import AUTO_FIRST_STEPS, REPORTS, ExitEvent, LrOverride, PhaseEvent, StepEvent
from contracts.stop_signal import StopSignal
from llm_pretrain_client import data_plan, settings
from llm_pretrain_client.agreement import Agreement

STOP_SLOT = 0       # the control vector: [stop flag, the commands window (contracts.command_tail.WINDOW slots)]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What the step about to run must do: `poison` multiplies its loss (1.0; NaN for a nan drill: non-finite
    gradients, as a device fault gives), `corrupt`: its batch is a spike drill's bad data (a script that reads
    through `Client.source` gets it there)."""

    step: int
    poison: float = 1.0
    corrupt: bool = False


class Client:
    def __init__(self, *, global_batch: int | None = None, seq_len: int | None = None, steps: int | None = None,
                 grad_norm: bool = False, loss_scale: bool = False, env=None):
        """`global_batch`, `seq_len`, `steps`: the script's (default: the run's config, train.global_batch,
        data.seq_len, train.steps). `grad_norm`/`loss_scale`: the script passes them to `end_step` (said to the
        daemon before the first step: the detectors that need a signal never sent are off)."""
        import os

        self.settings = s = settings.from_env(os.environ if env is None else env)
        cfg = s.config
        self.supervised = s.supervised
        self.rank, self.world, self.generation = s.rank, s.world, s.generation
        self.global_batch = global_batch or (cfg.train.global_batch if cfg else 1)
        self.seq_len = seq_len or (cfg.data.seq_len if cfg else 0)
        self.total_steps = steps or (cfg.train.steps if cfg else 0)
        self.step = 0                      # optimizer steps done
        self.reason = "finished"
        self._stopping = False
        self._claims = {"grad_norm": grad_norm, "loss_scale": loss_scale, "lr": False, "data_position": False,
                        "skip_data": False}
        self.skips: list[tuple[int, int]] = []
        self.overrides: list[LrOverride] = []
        self.lr_schedule = None            # llm_pretrain_client.lr_multiplier.LrMultiplier, where the script made one
        self.loss_scale_param = None       # the script's loss-scale Parameter, where it gave it (restore)
        self._cap = (None, 0)              # (the recovery's loss-scale cap, until this step)
        self._announced = False
        self._restored = False
        self._last_end = self._begun = None
        self._poisoned = None              # the loss scale a nan drill replaced for one step
        if not self.supervised:
            return
        self.stop = StopSignal()
        faulthandler.register(signal.SIGUSR1, all_threads=True)     # the daemon's stack dump of a hung rank
        self.sink = EventSink(sys.stdout, s.socket)
        self.commands = CommandTail(s.commands, generation=s.generation)
        self.applied = 0
        ckpt = cfg.checkpoint
        self.intervals = {"interval_steps": AUTO_FIRST_STEPS if ckpt.interval_steps == "auto" else ckpt.interval_steps,
                          "memory_interval_steps": (AUTO_FIRST_STEPS if ckpt.memory_interval_steps == "auto"
                                                    else ckpt.memory_interval_steps)}
        self.drills = Drills(rank=s.rank, allowed=cfg.health.allow_fault_injection, dp=cfg.parallel.dp,
                             marks=s.run_dir / "drills", rerun=s.rerun)
        self.board = PhaseWriter(s.phase_board, s.rank) if s.phase_board else None
        self.agreement = Agreement(s.world)
        from llm_pretrain_client.store import ScriptCheckpoints

        self.store = ScriptCheckpoints(cfg, rank=s.rank, world=s.world, generation=s.generation, emit=self._emit)
        self._phase("restore")

    # What the daemon is told -----------------------------------------------------------------------
    def _emit(self, event, *, log: bool = True) -> None:
        self.sink.emit(event, log=log)

    def _phase(self, name: str, **more) -> None:
        self._emit(PhaseEvent(rank=self.rank, generation=self.generation, phase=name, step=self.step, **more))

    def _enter(self, phase: str, step: int | None = None) -> None:
        if self.board is not None:
            self.board.enter(phase, self.step + 1 if step is None else step)

    @property
    def reports(self) -> list[str]:
        """Of contracts.protocol.REPORTS, what this script reports."""
        have = {"loss", *(k for k, v in self._claims.items() if v)}
        return [r for r in REPORTS if r in have]

    # Set-up ---------------------------------------------------------------------------------------
    def restore(self, params: Sequence, *, loss_scale=None) -> int:
        """Loads the newest checkpoint (either tier) into `params` — every Parameter the script's state is made
        of: the network's and the optimizer's (`net.trainable_params() + optimizer.parameters`, or a training
        cell's `get_parameters()`) — and applies the recovery directive; returns the step it resumes after
        (0: from scratch). `loss_scale`: the script's loss-scale Parameter (a directive may set or cap it)."""
        self.loss_scale_param = loss_scale
        self._restored = True
        if not self.supervised:
            return 0
        self.store.attach(list(params))
        state = self.store.restore()
        if state is not None:
            self.step = int(state["step"])
            self.skips = data_plan.merged(state.get("skip_ranges", []))
            self.overrides = [LrOverride.from_dict(o) for o in state.get("lr_overrides", [])]
        recovery = self.settings.recovery
        if recovery is not None:
            self.skips = data_plan.merged([*self.skips, *recovery.skip_ranges])
            self.overrides = list(recovery.lr_overrides)
            if recovery.loss_scale is not None and self.step == recovery.checkpoint_step and loss_scale is not None:
                self._set_scale(recovery.loss_scale)
            if recovery.loss_scale_cap is not None:
                self._cap = (recovery.loss_scale_cap, recovery.loss_scale_cap_until_step)
        return self.step

    def source(self, source, *, vocab_size: int | None = None) -> data_plan.SupervisedSource:
        """The script's random-access samples as this rank's for the rest of the run (data_plan.SupervisedSource):
        resumed where the run was, the daemon's skip ranges stepped over, a spike drill's bad data in its
        window (needs `vocab_size`). Call after `restore`."""
        self._claims["data_position"] = self._claims["skip_data"] = True
        return data_plan.SupervisedSource(source, step_of=lambda: self.step, global_batch=self.global_batch,
                                          rank=self.rank, world=self.world, steps=self.total_steps,
                                          skips=lambda: self.skips, corrupt=self._corrupts, vocab_size=vocab_size)

    def lr(self, base):
        """The script's lr (a float or a LearningRateSchedule) as the optimizer's `learning_rate`, with the
        daemon's lr cuts applied inside the update (llm_pretrain_client.lr_multiplier)."""
        from llm_pretrain_client.lr_multiplier import LrMultiplier

        self.lr_schedule = LrMultiplier(base)
        self._claims["lr"] = True
        return self.lr_schedule

    def _corrupts(self, step: int) -> bool:
        return self.supervised and any(d.fault == "spike" and d.covers(step) for d in self.drills.pending)

    @property
    def training(self) -> bool:
        """Steps remain and no stop was agreed."""
        return self.step < self.total_steps and not self._stopping

    def multiplier(self, step: int) -> float:
        m = 1.0
        for o in self.overrides:
            m *= o.multiplier(step)
        return m

    # The step -------------------------------------------------------------------------------------
    def begin_step(self) -> StepPlan:
        """Before the script's step: the drills due, the lr cut in force; returns the step's plan."""
        step = self.step + 1
        if not self.supervised:
            return StepPlan(step)
        if not self._announced:               # the first step compiles; the daemon learns what is reported
            if not self._restored:
                raise RuntimeError("call Client.restore(params) before the first step: a supervised script must "
                                   "resume from the run's checkpoint")
            self._phase("compile", reports=self.reports)
            self._announced = True
        self._begun = time.monotonic()
        self.store.poll()
        if self.lr_schedule is not None:
            self.lr_schedule.set(self.multiplier(step))
        poison, corrupt = self.drills.before_step(step, entering=lambda phase: self._enter(phase, step))
        if poison != 1.0 and self.loss_scale_param is not None:     # the drill through the scale (Model.train)
            self._poisoned = float(self.loss_scale_param.asnumpy())
            self._set_scale(self._poisoned * poison)
        self._enter("compute", step)
        return StepPlan(step, poison, corrupt or self._corrupts(step))

    def end_step(self, loss: Any, *, grad_norm: Any = None, loss_scale: Any = None, overflow: bool = False,
                 lr: float | None = None, tokens: int | None = None) -> bool:
        """After the script's step (its optimizer update applied, or skipped on `overflow`): the step event,
        the agreed commands, a save when one is due; False when the run must stop now (then `finish`)."""
        self.step += 1
        if not self.supervised:
            return self.step < self.total_steps or not self.total_steps
        now = time.monotonic()
        step = self.step
        if self._poisoned is not None:
            self._set_scale(self._poisoned)
            self._poisoned = None
        step_s = now - (self._last_end or self._begun or now)
        host_s = (self._begun - self._last_end) if self._last_end and self._begun else 0.0
        self._last_end = now
        tokens = tokens if tokens is not None else self.global_batch * self.seq_len
        mult = self.multiplier(step)
        if lr is None:
            lr = self.lr_schedule.base_lr(step - 1) * mult if self.lr_schedule is not None else math.nan
        first, end = data_plan.step_range(step, self.global_batch, self.skips)
        event = StepEvent(rank=self.rank, generation=self.generation, step=step, loss=_number(loss),
                          grad_norm=_number(grad_norm), loss_scale=1.0 if loss_scale is None else _number(loss_scale),
                          lr=float(lr), lr_multiplier=mult, skipped=bool(_number(overflow)), sample_start=first,
                          sample_end=end, tokens=int(tokens), step_s=step_s, data_wait_s=0.0,
                          tokens_per_s=tokens / step_s if step_s > 0 else 0.0, host_s=host_s)
        last = step >= self.total_steps
        self._emit(event, log=step % self.settings.config.train.log_interval_steps == 0 or last)
        self._cap_scale(step)
        self._enter("between", step)
        self.commands.poll()
        summed = self.agreement.sum([int(self.stop.requested), *self.commands.slots(self.applied)])
        stopping, pausing, save_now = self._agree(summed, step, last)
        self._save(save_now)
        if pausing:
            outcome = self._pause()
            stopping = stopping or outcome in ("stop", "release")
            if outcome == "release":
                self.reason = "released"
        if stopping and self.reason == "finished" and not last:
            self.reason = "stopped"
        self._stopping = stopping
        return not (stopping or last)

    def _agree(self, summed: list[int], step: int, last: bool) -> tuple[bool, bool, bool]:
        """What every rank applies after this step: (stop, pause, save now)."""
        stopping = summed[STOP_SLOT] > 0
        interval = self.intervals["interval_steps"]
        pausing, save_now = False, stopping or last or bool(interval and step % interval == 0)
        for cmd in self.commands.agreed(self.applied, summed[1:]):
            self.applied = cmd.seq
            if cmd.name == "stop":
                stopping = save_now = True
            elif cmd.name == "checkpoint":
                save_now = True
            elif cmd.name == "pause":
                pausing = save_now = not last
            elif cmd.name == "inject":
                self.drills.add(cmd.seq, cmd.args, step)
            elif cmd.name == "interval":
                self.intervals.update({k: int(v) for k, v in cmd.args.items() if k in self.intervals
                                       and isinstance(v, int) and v >= 1})
        return stopping, pausing, save_now

    def _run_state(self) -> dict[str, Any]:
        return {"step": self.step, "data_position": self.step * self.global_batch,
                "skip_ranges": [list(r) for r in self.skips], "lr_overrides": [o.to_dict() for o in self.overrides],
                "reports": self.reports}

    def _save(self, save_now: bool) -> None:
        if not self.store.params:
            return
        memory = self.settings.config.checkpoint.memory_interval_steps and self.intervals["memory_interval_steps"]
        if save_now or (memory and self.step % memory == 0):
            self._enter("save", self.step)
            self.store.save(self._run_state(), memory=not save_now)
            self._enter("between", self.step)

    def _pause(self) -> str:
        """The pause checkpoint committed first (the daemon may release the devices at any time)."""
        self.store.wait()
        self._phase("paused")
        self._enter("paused", self.step)
        outcome, self.applied = hold(self.commands, self.applied, self.stop)
        if outcome == "resume":
            self._phase("train")
            self._enter("between", self.step)
        return outcome

    def _set_scale(self, value: float) -> None:
        import mindspore as ms

        p = self.loss_scale_param
        p.set_data(ms.Tensor(value, p.dtype))

    def _cap_scale(self, step: int) -> None:
        cap, until = self._cap
        if cap is None or self.loss_scale_param is None:
            return
        if step >= until:
            self._cap = (None, 0)
        elif float(self.loss_scale_param.asnumpy()) > cap:
            self._set_scale(cap)

    # The end --------------------------------------------------------------------------------------
    def finish(self, reason: str | None = None) -> None:
        """After the last step or a stop: the save in flight waited for, the exit event (with a digest of the
        parameters), the RAM tier dropped once the run's final checkpoint is on disk."""
        if not self.supervised:
            return
        reason = reason or self.reason
        self._phase("checkpoint")
        ok = self.store.wait()
        self.store.close()
        if ok and reason == "finished" and self.rank == 0 and self.store.memory_root is not None:
            shutil.rmtree(self.store.memory_root, ignore_errors=True)
        self._phase("exiting")
        self._emit(ExitEvent(rank=self.rank, generation=self.generation, step=self.step, reason=reason,
                             params_sha256=self.params_sha256()))
        if not ok:
            raise RuntimeError(f"the checkpoint of step {self.step} could not be saved: {self.store.writer.last_error}")

    def params_sha256(self) -> str:
        """Over every checkpointed parameter's name and bytes, in name order: equal digests, equal state."""
        import numpy as np

        digest = hashlib.sha256()
        for p in sorted(self.store.params, key=lambda p: p.name):
            digest.update(p.name.encode())
            digest.update(np.ascontiguousarray(p.asnumpy()).tobytes())
        return digest.hexdigest()


def _number(value: Any) -> float:
    """A loss, norm or flag as the script has it (a float, a 0-d Tensor or array) as a float; None: NaN."""
    if value is None:
        return math.nan
    if hasattr(value, "asnumpy"):
        value = value.asnumpy()
    return float(value)
