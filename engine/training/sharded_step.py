"""The training step under semi-auto parallel (Ascend: tp, pp, sp or optimizer sharding).

Owns: the whole optimizer step as one cell compiled by MindSpore's AutoParallel
(MindSpore 2.10: functional training must be wrapped so at its outermost
level), and the host side that feeds it and agrees the scalars.

The graph is written for the whole logical model; MindSpore partitions it by
engine/layout/parallel.py's strategies and inserts every collective, the data-parallel
gradient reduction included, so unlike engine/training/step.py (DATA_PARALLEL) nothing
here all-reduces gradients by hand. Within it:
- accumulation is MindSpore's own: `GradAccumulation` (pp = 1) or the
  pipeline's micro-batches (`Pipeline`, micro-batches = pipeline_microbatches
  x grad_accum_steps), both summing the micro-batches' losses and filling the
  `GradReducer`'s accumulators (engine/training/grad_reducer.py), so loss and gradients are divided by the
  micro-batch count here;
- the global gradient norm is the sum of each gradient's square-sum marked
  with `grad_scale` (MindFormers' ClipGradNorm pattern): the compiler divides
  each by its replica count and all-reduces within and across stages, so it
  is the norm of the whole gradient, not of a shard. Finiteness is read off
  that norm (one non-finite element makes it non-finite), which every rank
  shares; a per-rank check would let stages disagree on skipping;
- the loss exists only on the last pipeline stage (others return zero); it and
  the control vector are agreed by one small all-reduce after the step.

Nothing here compiles on CPU (MindSpore refuses semi-auto parallel there): it
is built, not run, by the tests; see the README's Ascend section.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from contracts.config import Config
from engine.layout import parallel
from engine.training.step_state import StepResult, StepState


class ShardedStep(StepState):
    def __init__(self, net: nn.Cell, cfg: Config):
        super().__init__(net, cfg)
        from mindspore.parallel.nn import GradAccumulation, Pipeline

        from engine.training.grad_reducer import GradReducer

        self.micro = parallel.micro_batches(cfg)
        if cfg.parallel.pp > 1:
            self.network = Pipeline(net, self.micro)       # stages: engine/model/sharding.py set them on the cells
        elif self.micro > 1:
            self.network = GradAccumulation(net, self.micro)
        else:
            self.network = net
        self.reducer = (GradReducer(self.params, opt_shard=cfg.parallel.optimizer_shard)
                        if self.micro > 1 else None)
        # the compiler recognises this marked ExpandDims and makes the sum global (see the module doc)
        self.expand = ops.ExpandDims().add_prim_attr("grad_scale", True)

        def scaled_loss(inputs, targets, multiplier):
            loss = self.network(inputs, targets)
            return loss * multiplier, loss

        self._grad_fn = ms.value_and_grad(scaled_loss, None, self.params, has_aux=True)

    def construct(self, tokens, lr, poison):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        (_, loss), grads = self._grad_fn(inputs, targets, self.scaler.scale * poison)
        if self.reducer is not None:
            grads = self.reducer(grads)
        inv = 1.0 / (self.scaler.scale * self.micro)
        grads = [g * inv for g in grads]
        loss = loss / self.micro
        squares = [self.expand(ops.reduce_sum(ops.square(g.astype(ms.float32))), 0) for g in grads]
        grad_norm = ops.sqrt(ops.addn(squares))[0]
        finite = ops.isfinite(grad_norm)
        done, scale_used = self._clip_and_update(grads, grad_norm, finite, lr)
        return ops.depend(loss, done), grad_norm, scale_used, ops.logical_not(finite)


def wrap(step: ShardedStep, parallelism: parallel.Parallelism, strategy_file: str):
    """The step inside AutoParallel, configured by the decided Parallelism (engine.layout.parallel)."""
    from mindspore.parallel.auto_parallel import AutoParallel

    settings = parallelism.auto_parallel(strategy_file=strategy_file)
    wrapped = AutoParallel(step, parallel_mode=settings["parallel_mode"])
    wrapped.dataset_strategy(settings["dataset_strategy"])
    if settings["pipeline"]:
        wrapped.pipeline(**settings["pipeline"])
    if settings["hsdp"]:
        wrapped.hsdp(**settings["hsdp"])
    if settings["save_param_strategy_file"]:
        wrapped.save_param_strategy_file(settings["save_param_strategy_file"])
        wrapped.disable_strategy_file_only_for_trainable_params()
    return wrapped


class ShardedTrainStep:
    """engine.training.step.TrainStep's interface (run, state, compile) for semi-auto parallel."""

    def __init__(self, net: nn.Cell, cfg: Config, parallelism: parallel.Parallelism, *, rank: int,
                 run_dir: Path):
        self.cfg, self.rank = cfg, rank
        self.accum_steps = cfg.train.grad_accum_steps
        self.cell = ShardedStep(net, cfg)
        self.scaler = self.cell.scaler
        strategy = run_dir / "strategy" / f"rank_{rank}.ckpt"
        strategy.parent.mkdir(parents=True, exist_ok=True)
        self.compiled = wrap(self.cell, parallelism, str(strategy))
        p = cfg.parallel
        self.last_stage = parallel.coordinates(rank, cfg).stage == p.pp - 1
        self.loss_share = 1.0 / (p.dp * p.tp)        # every last-stage rank holds the same loss
        self.all_reduce = ops.AllReduce()
        self.compiled_once = False
        self.simulated = bool(os.environ.get("MS_SIMULATION_LEVEL"))

    def _inputs(self, micro_batches: np.ndarray, lr: float, poison: float):
        tokens = micro_batches.reshape(-1, micro_batches.shape[-1])      # (accum x rows, seq_len + 1)
        return Tensor(tokens), Tensor(lr, ms.float32), Tensor(poison, ms.float32)

    def compile(self, micro_batches: np.ndarray) -> None:
        """Compiles (and so slices the parameters) without running: sliced checkpoints load after this."""
        if not self.compiled_once:
            self.compiled.compile(*self._inputs(micro_batches, 0.0, 1.0))
            self.compiled_once = True

    def run(self, micro_batches: np.ndarray, lr: float, *, poison: float = 1.0,
            control: np.ndarray | None = None) -> StepResult:
        if micro_batches.shape[0] != self.accum_steps:
            raise ValueError(f"expected {self.accum_steps} micro-batches, got {micro_batches.shape[0]}")
        loss, grad_norm, scale, skipped = (x.asnumpy() for x in self.compiled(*self._inputs(micro_batches, lr,
                                                                                                poison)))
        self.compiled_once = True
        synced = time.perf_counter()
        flags = np.zeros(1, np.int32) if control is None else control.astype(np.int32)
        mine = np.concatenate([[float(loss) * self.loss_share if self.last_stage else 0.0], flags]).astype(np.float32)
        # a dry run (MS_SIMULATION_LEVEL) compiles and allocates but communicates nothing
        agreed = mine if self.simulated else self.all_reduce(Tensor(mine)).asnumpy()
        return StepResult(loss=float(agreed[0]), grad_norm=float(grad_norm), loss_scale=float(scale),
                          skipped=bool(skipped), control=tuple(int(round(v)) for v in agreed[1:]),
                          sync_s=time.perf_counter() - synced)

    def state(self) -> list:
        return self.cell.state()
