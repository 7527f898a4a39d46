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
- the gradients are value_and_grad's of a network whose only output is the scaled loss, so the parallel
  pass finds the loss and divides it by the devices holding it (_VirtualDiv): the mirrors' sums are then
  the mean's gradient (issue 47: with the loss an auxiliary output it found none, factor dp x tp);
- the global gradient norm: each rank's square sums of the slices it holds, each divided by the slice's
  holders in the stage, all-reduced once over the world (the same on every rank by construction, issue 47);
  the non-finite flag is all-reduced over the world too, so every rank skips or none does;
- a skipped step is branch-free (AdamW with lr 0 and betas 1): the Ascend kernel-by-kernel backend
  refuses a data-dependent branch;
- the loss exists only on the last pipeline stage (others return zero); it and
  the control vector are agreed by one small all-reduce after the step.

Nothing here compiles on the CPU backend (MindSpore refuses semi-auto parallel there): the tests build it,
and compile it in MindSpore's dry run against stand-in CANN libraries (tests/e2e/test_dry_run_ir.py);
see docs/ascend.md.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from contracts.config import Config
from engine.layout import parallel
from engine.training.step_state import StepResult, StepState


class ShardedStep(StepState):
    def __init__(self, net: nn.Cell, cfg: Config):
        super().__init__(net, cfg)
        from mindspore.communication import GlobalComm
        from mindspore.parallel.nn import GradAccumulation, Pipeline

        from engine.training.grad_reducer import GradReducer

        self.micro = parallel.micro_batches(cfg)
        if cfg.parallel.pp > 1:      # stages: engine/model/sharding.py set them on the cells
            # the micro-batches are sliced from the whole rows, the next-token shift inside each: the pipeline
            # pass labels the first slices of its inputs as the micro-batches
            self.network = Pipeline(_NextTokenLoss(net), self.micro)
            self.loss_of = self.network
        else:
            self.network = GradAccumulation(net, self.micro) if self.micro > 1 else net
            self.loss_of = _NextTokenLoss(self.network)
        self.reducer = (GradReducer(self.params, opt_shard=cfg.parallel.optimizer_shard)
                        if self.micro > 1 else None)
        # The gradients of a network whose only output is the scaled loss: the parallel pass finds that
        # loss and inserts the divisor (_VirtualDiv) of the devices that hold it, so the mirror operators'
        # sums are the mean's gradient. value_and_grad(..., has_aux=True) over (scaled loss, loss) returned
        # a tuple: no loss found, no divisor, every gradient summed over the stage's devices (issue 47).
        # A poisoned step (a NaN drill) reports a NaN loss: the loss is the scaled one divided back.
        self.scaled_loss = self._scaled_loss()
        self.grad = ms.value_and_grad(self.scaled_loss, None, self.params)
        self.world_sum = ops.AllReduce(group=GlobalComm.WORLD_COMM_GROUP)
        # the global norm's one reduction (see _global_norm); a primitive of its own, so the lint finds it
        self.norm_sum = ops.AllReduce(group=GlobalComm.WORLD_COMM_GROUP)
        self.stage_devices = cfg.parallel.dp * cfg.parallel.tp
        self.in_norm = (True,) * len(self.params)     # the parameters whose square sums this rank's norm adds

    def _scaled_loss(self) -> nn.Cell:
        return _ScaledLoss(self.loss_of)

    def gradients(self, tokens, poison):
        """(the loss, the gradients of the loss times the loss scale x `poison`), from one forward pass whose only
        output is the scaled loss: the form the parallel pass recognises (it divides that output by the devices
        holding it). A separate forward for the loss (TrainOneStepCell's form) makes a cycle with
        GradAccumulation's lazily inlined micro-steps ("Graph cycle exists", seen in the dry run)."""
        sens = self.scaler.scale * poison
        scaled, grads = self.grad(tokens, sens)
        return scaled / sens, grads

    def construct(self, tokens, lr, poison):
        return self.step(tokens, lr, poison)

    def step(self, tokens, lr, poison):
        loss, grads = self.gradients(tokens, poison)
        if self.reducer is not None:
            grads = self.reducer(grads)
        inv = 1.0 / (self.scaler.scale * self.micro)
        grads = [g * inv for g in grads]
        loss = loss / self.micro
        grad_norm = self._global_norm(grads)
        # every rank skips or none does: the non-finite flag summed over the world, not read off each
        # rank's own norm (issue 47)
        overflow = self.world_sum(ops.logical_not(ops.isfinite(grad_norm)).astype(ms.float32))
        finite = overflow == 0.0
        done, scale_used = self._clip_and_update(grads, grad_norm, finite, lr)
        return ops.depend(loss, done), grad_norm, scale_used, ops.logical_not(finite)

    def _global_norm(self, grads):
        """The norm of the whole gradient, the same on every rank by construction (issue 47): each rank sums
        the squares of the gradient slices it holds, each divided by how many ranks of its stage hold that
        same slice, and one all-reduce over the world adds them up: every slice of every stage counted once.
        The ops after the gradients run on each rank's own slice (no strategy: the dry run's IR), so a slice's
        holders are the stage's devices over its slices, whole / held elements. `held` is counted on the slice
        itself: the graph's shapes are the logical ones, and a count of ones_like(g) is folded to the whole
        size before the partition (seen in the IR); its finite elements are all of them, and where one is
        not, the norm is not finite whatever the weight. Nothing here is marked `grad_scale`: MindSpore's
        HandleGlobalNormScale, whose search for the marks is 10 nodes deep, has nothing to find or rescale
        (tests/e2e/test_dry_run_ir.py checks both in the partitioned graph)."""
        total = ops.zeros((), ms.float32)
        for g, mine in zip(grads, self.in_norm):
            if not mine:
                continue
            g = g.astype(ms.float32)
            held = ops.reduce_sum(ops.isfinite(g).astype(ms.float32))     # see above: not foldable
            holders = held * (self.stage_devices / g.size)
            total = total + ops.reduce_sum(ops.square(g)) / holders
        return ops.sqrt(self.norm_sum(total))

    def _update(self, grads, finite, lr):
        """AdamW unless not finite, without a graph branch: MindSpore's kernel-by-kernel backend (Ascend
        O0/O1) refuses a data-dependent branch in the step ("Can not build a sub graph which contains
        ConditionSwitch ... by kbk"). A skipped step runs the same kernel with lr 0, betas 1, decay 0 and
        the gradients' non-finite elements zeroed: parameters, moments and the count come out bit-identical.
        Computed like engine.training.optim.AdamW.update (torch's AdamW by the fused kernel's inputs)."""
        opt, cfg = self.optimizer, self.optimizer.cfg
        applied = finite.astype(ms.int32)
        step = opt.step + applied
        t = ops.maximum(step, 1).astype(ms.float32)
        bias1 = 1.0 - ops.pow(cfg.beta1, t)
        bias2_sqrt = ops.sqrt(1.0 - ops.pow(cfg.beta2, t))
        one, zero = ops.ones((), ms.float32), ops.zeros((), ms.float32)
        lr_k = ops.select(finite, lr * bias2_sqrt / bias1, zero)
        b1 = ops.select(finite, ops.fill(ms.float32, (), cfg.beta1), one)
        b2 = ops.select(finite, ops.fill(ms.float32, (), cfg.beta2), one)
        eps_k = ops.select(finite, cfg.eps * bias2_sqrt, one)
        decay_k = ops.select(finite, cfg.weight_decay * bias1 / bias2_sqrt, zero)
        no_decay = zero
        scale_used = self.scaler.scale * 1.0
        done = ops.assign(opt.step, step)
        for p, g, m, v, wd_on in zip(opt.params, grads, opt.exp_avg, opt.exp_avg_sq, opt.decays):
            g = ops.select(ops.isfinite(g), g, ops.zeros_like(g))
            done = ops.depend(done, opt.adam(p, m, v, lr_k, b1, b2, eps_k, decay_k if wd_on else no_decay, g))
        return ops.depend(done, self.scaler.adjust(finite)), scale_used


class PipelineStep(ShardedStep):
    """ShardedStep under pp, shaped for MindSpore's pipeline pass (PipelineInterleave, the kernel-by-kernel
    backend's). It takes for the micro-batches' graph the first graph holding a _VirtualDataset, and refuses
    the compile unless the lazily inlined network is called in that graph itself ("Using pipeline parallel with
    interleave, should enable lazy_inline", though the network is lazy_inline: issue 47). The compiler puts a
    _VirtualDataset in the differentiated graph, and in the outermost one too when a primitive there reads
    one of the step's inputs. So, as MindFormers' pipeline wrapper is built:
    - the differentiated cell keeps a graph of its own (defer_inline, _PipelinedScaledLoss), in which the
      pipeline's micro-batch loop is inlined: its slices and the network's calls;
    - the step's one input is the token rows, which the outermost graph only passes on; the learning rate and
      the poison are parameters the host sets before each call (ShardedTrainStep._inputs).
    The gradients' factor: the last stage's loss is divided by its devices (_VirtualDiv), and the earlier
    stages' gradients are the backward of what it sends back (tests/e2e/test_dry_run_ir.py)."""

    def __init__(self, net: nn.Cell, cfg: Config, stage: int = 0):
        super().__init__(net, cfg)
        # the norm adds this stage's parameters only: a sum over every stage's gradients is placed on the first
        # stage by the pipeline pass, and the step's tail (norm, skip, update) goes with it (seen in the dry run:
        # the last stage's graph lost its update); the world all-reduce adds the stages
        stages = parallel.cell_stages(cfg)
        self.in_norm = tuple(any(p.name.startswith(c + ".") and s == stage for c, s in stages.items())
                             for p in self.params)
        self.lr_now = Parameter(Tensor(0.0, ms.float32), name="step_lr", requires_grad=False)
        self.poison_now = Parameter(Tensor(1.0, ms.float32), name="step_poison", requires_grad=False)

    def _scaled_loss(self) -> nn.Cell:
        return _PipelinedScaledLoss(self.loss_of)

    def gradients(self, tokens, poison):
        scaled, grads = self.grad(tokens, self.scaler.scale, poison)
        return scaled / (self.scaler.scale * poison), grads

    def construct(self, tokens):
        return self.step(tokens, self.lr_now * 1.0, self.poison_now * 1.0)


class _NextTokenLoss(nn.Cell):
    """The network's loss of a batch of token rows (inputs: all but the last token; targets: all but the first)."""

    def __init__(self, network: nn.Cell):
        super().__init__(auto_prefix=False)
        self.network = network

    def construct(self, tokens):
        return self.network(tokens[:, :-1], tokens[:, 1:])


class _ScaledLoss(nn.Cell):
    """The loss times the loss scale: the one output the gradients are taken of."""

    def __init__(self, loss_of: nn.Cell):
        super().__init__(auto_prefix=False)
        self.loss_of = loss_of

    def construct(self, tokens, multiplier):
        return self.loss_of(tokens) * multiplier


class _PipelinedScaledLoss(_ScaledLoss):
    """_ScaledLoss under pp: a graph of its own (defer_inline, the flag MindFormers' pipeline wrapper sets on its
    network), holding the pipeline's micro-batch slices and the lazily inlined network's calls; it multiplies by
    the scale and the poison itself, so that the outermost graph reads none of its inputs (see PipelineStep).
    No branch in it: a branch is a graph of its own, and the network's calls would be there."""

    def __init__(self, loss_of: nn.Cell):
        super().__init__(loss_of)
        self.add_flags(defer_inline=True)

    def construct(self, tokens, scale, poison):
        return self.loss_of(tokens) * (scale * poison)


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
        self.pipelined = cfg.parallel.pp > 1
        stage = parallel.coordinates(rank, cfg).stage
        self.cell = PipelineStep(net, cfg, stage) if self.pipelined else ShardedStep(net, cfg)
        self.scaler = self.cell.scaler
        strategy = run_dir / "strategy" / f"rank_{rank}.ckpt"
        strategy.parent.mkdir(parents=True, exist_ok=True)
        self.compiled = wrap(self.cell, parallelism, str(strategy))
        # compiled as a training graph (phase "train"): MindSpore refuses accumulation in a "predict" one
        # ("Current not support predict with grad_accu", seen in the dry run)
        self.compiled.set_train(True)
        p = cfg.parallel
        self.last_stage = parallel.coordinates(rank, cfg).stage == p.pp - 1
        self.loss_share = 1.0 / (p.dp * p.tp)        # every last-stage rank holds the same loss
        self.all_reduce = ops.AllReduce()
        self.compiled_once = False
        self.simulated = bool(os.environ.get("MS_SIMULATION_LEVEL"))
        # MS_SIMULATION_LEVEL=0 compiles the frontend and the parallel passes only: nothing to run, and a
        # call hands back a placeholder int, not the step's outputs
        self.compile_only = os.environ.get("MS_SIMULATION_LEVEL") == "0"

    def _inputs(self, micro_batches: np.ndarray, lr: float, poison: float):
        tokens = micro_batches.reshape(-1, micro_batches.shape[-1])      # (accum x rows, seq_len + 1)
        if self.pipelined:       # PipelineStep: the learning rate and the poison are parameters
            self.cell.lr_now.set_data(Tensor(lr, ms.float32))
            self.cell.poison_now.set_data(Tensor(poison, ms.float32))
            return (Tensor(tokens),)
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
        inputs = self._inputs(micro_batches, lr, poison)
        if self.compile_only:
            self.compiled.compile(*inputs)
            self.compiled_once = True
            return StepResult(loss=0.0, grad_norm=0.0, loss_scale=float(self.scaler.scale.asnumpy()), skipped=False,
                              control=() if control is None else tuple(int(v) for v in control))
        loss, grad_norm, scale, skipped = (x.asnumpy() for x in self.compiled(*inputs))
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
