"""The compiled training step: forward, scaled backward, reduce, unscale, check, clip, update.

Owns: the order of operations inside one optimizer step and the gradient
accumulation buffers. With one micro-batch per step the whole step is one
`ms.jit` function; with k > 1 each micro-batch runs a compiled
forward/backward that adds into fp32 buffers (one graph, reused k times, so
compile time does not grow with k) and one compiled update finishes the step.

Invariants (README, Numerics):
- non-finite gradients are never applied, in any precision: the step is
  skipped, reported, and parameters and optimizer state stay bit-identical
  (the check is the global norm's: a NaN or Inf anywhere makes it non-finite);
- under data parallel, gradients, the loss and the control flags are summed in one
  all-reduce per optimizer step (a flat buffer, as DDP buckets; with parallel.local_reduce,
  through shared memory when every rank is on this machine: engine/training/local_reduce.py), and
  the reported loss and grad norm are global (identical on every rank);
- the reported grad norm is that of the unscaled, unclipped gradients.
"""
from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Callable

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, ops

from contracts.config import Config
from engine.layout import parallel
from engine.layout.parallel import Reduction
from engine.model.causal_lm import CausalLM
from engine.training.gradient_sum import HUB, SHARED_MEMORY, GradientSum
from engine.training.local_reduce import LocalAllReduce
from engine.training.step_state import StepResult, StepState

PER_RANK_MAX = 64          # ranks whose own loss and gradient norm every step reports (beyond: none)


class TrainStep(StepState):
    """DATA_PARALLEL (and one rank): every rank holds the whole model; the step reduces gradients itself.
    Semi-auto parallel layouts use engine.training.sharded_step instead (the decided Parallelism says which)."""

    def __init__(self, net: CausalLM, cfg: Config, *, reduction: Reduction,
                 local_reduce: Callable[[int], LocalAllReduce] | None = None, rank: int = 0, world: int = 1):
        """local_reduce: given the buffer's size, the shared-memory sum to use instead of MindSpore's
        AllReduce (engine.training.local_reduce; every rank on this machine)."""
        super().__init__(net, cfg)
        self.accum_steps = cfg.train.grad_accum_steps
        if reduction.scalars_all_reduce:
            raise ValueError("TrainStep reduces gradients by hand; a semi-auto layout needs engine.training.sharded_step")
        self.dp = reduction.divide_by
        # a local group (no MindSpore cluster: engine/rank/runtime.py) has no AllReduce to make
        self.all_reduce = ops.AllReduce() if reduction.hand_all_reduce and local_reduce is None else None
        self.phases = None          # the rank's contracts.phase_board.PhaseWriter, if its daemon reads one
        self.phase_step = 0
        # Each rank's own loss and gradient sum of squares ride the same sum in slots of their own (a rank
        # writes its slot, the others 0): every rank learns every rank's, and the daemon can tell which rank
        # a fault came from (daemon.judging.triage). Up to PER_RANK_MAX ranks.
        self.world = world if reduction.hand_all_reduce and 1 < world <= PER_RANK_MAX else 0
        # PER_RANK_MAX slots whatever the world, so that the graphs do not depend on it: a run that shrinks
        # or grows by whole machines with the same micro-batch reuses its compiled step (daemon.processes.run_files)
        self.slots = PER_RANK_MAX if self.world else 0
        # a Parameter, not a constant: a constant is baked into the compiled graph, and the compile cache,
        # shared by the ranks, would hand every rank the first one's mask after a restart
        self.rank_mask = Parameter(Tensor(np.arange(self.slots) == rank), name="rank_mask",
                                   requires_grad=False) if self.slots else None
        # Control flags ride along with the step's own collectives: every rank learns,
        # after the same step, what any rank asked for (a stop signal, a command).
        # Summed, because CPU AllReduce does only sums: a flag set anywhere sums to > 0.
        self.grad_buffers = ParameterTuple(
            [Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"grad_acc.{p.name}", requires_grad=False)
             for p in self.params] if self.accum_steps > 1 else [])
        self.loss_buffer = Parameter(Tensor(0.0, ms.float32), name="grad_acc.loss", requires_grad=False)
        self.shapes = tuple(tuple(p.shape) for p in self.params)
        self.grad_size = int(sum(np.prod(shape) for shape in self.shapes))
        # the CPU's fused kernels: unscale, norm and clip in one kernel (engine/model/fused_cpu.py)
        self.clipper = None
        if getattr(net, "fused", False):
            from engine.model import fused_cpu

            self.clipper = fused_cpu.kernels().grad_clipper(self.shapes, self.grad_clip)

        def scaled_loss(tokens, targets, multiplier):
            loss = self.net(tokens, targets)
            return loss * multiplier, loss

        # Gradients of (loss × scale × poison) with respect to the parameters; `poison`
        # is 1 except when a fault drill or test injects a non-finite gradient.
        self._grad_fn = ms.value_and_grad(scaled_loss, None, self.params, has_aux=True)
        self._fused = ms.jit(self._fused_step)
        self._accumulate = ms.jit(self._accumulate_step)
        self._finish = ms.jit(self._finish_step)
        self.local, self._make_local = None, None
        if reduction.hand_all_reduce and local_reduce is not None:
            self._make_local = local_reduce         # sized at the first step, by its control vector
            self._local_fused = ms.jit(self._local_fused_step)
            self._local_finish = ms.jit(self._local_finish_step)
            self._apply_summed = ms.jit(self._apply_summed_step)

    # Traced pieces ---------------------------------------------------------
    def _backward(self, tokens, poison):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        (_, loss), grads = self._grad_fn(inputs, targets, self.scaler.scale * poison)
        return loss, grads

    def _flatten_and_reduce(self, grads, loss, control):
        """Every gradient flattened into one fp32 buffer, the way DDP buckets them. Under data
        parallel the loss and the control flags ride at its end and the buffer is summed over the
        ranks in one all-reduce (one collective per step, not one per parameter).
        Returns (flat gradients summed over ranks, loss summed over ranks, control summed, per-rank slots)."""
        if self.all_reduce is None:
            return ops.concat([g.astype(ms.float32).reshape(-1) for g in grads]), loss, control, self._no_slots()
        return self._split(self.all_reduce(self._buffer(grads, loss, control)))

    def _buffer(self, grads, loss, control):
        """What a rank contributes to the sum: its gradients, loss, per-rank slots and control flags in one
        fp32 vector (CPU AllReduce takes floats only; the flags are small integers, exact in float32 below
        2**24). The slots: this rank's loss and its gradients' sum of squares (still scaled) where the mask
        says, 0 elsewhere — chosen, not multiplied, so that a non-finite value stays in its own slot."""
        flat = ops.concat([g.astype(ms.float32).reshape(-1) for g in grads])
        loss = loss.astype(ms.float32).reshape(1)
        if not self.slots:
            return ops.concat([flat, loss, control.astype(ms.float32)])
        zeros = ops.zeros((self.slots,), ms.float32)
        mine = ops.concat([ops.select(self.rank_mask, ops.broadcast_to(loss, (self.slots,)), zeros),
                           ops.select(self.rank_mask, ops.broadcast_to(ops.reduce_sum(ops.square(flat)).reshape(1),
                                                                       (self.slots,)), zeros)])
        return ops.concat([flat, loss, mine, control.astype(ms.float32)])

    def _split(self, summed):
        """A summed buffer → (flat gradients, loss, control flags, per-rank slots: losses then sums of squares)."""
        n, w = self.grad_size, 2 * self.slots
        slots = summed[n + 1:n + 1 + w] if w else self._no_slots()
        return summed[:n], summed[n], summed[n + 1 + w:].astype(ms.int32), slots

    def _no_slots(self):
        return ops.zeros((2,), ms.float32)

    def _apply(self, grads, loss, lr, control):
        """grads: summed over this rank's micro-batches, still scaled; loss: summed likewise.

        Unscaling, the finite check, the global norm and clipping run on the one flat buffer (a
        handful of kernels, where per-parameter ops cost ~7 launches per parameter); only the
        split and AdamW's update are per parameter. A NaN or Inf anywhere makes the sum of
        squares, hence the norm, non-finite, so the norm is the finite check. With the CPU's fused
        kernels all of that but the update is one kernel (fused_cpu.GradClipper), and one rank
        builds no buffer at all."""
        if self.clipper is not None and self.all_reduce is None:
            return self._apply_parts(grads, loss, lr, control, self._no_slots())     # no buffer to build
        flat, loss, agreed, slots = self._flatten_and_reduce(grads, loss, control)
        return self._apply_parts([flat], loss, lr, agreed, slots)

    def _apply_parts(self, parts, loss, lr, agreed, slots):
        """parts: every gradient, summed over ranks and micro-batches, still scaled, as one flat buffer
        (or, with the fused kernels, one tensor a parameter); loss likewise."""
        inv_scale = 1.0 / (self.scaler.scale * self.accum_steps * self.dp)
        if self.clipper is not None:
            grads, grad_norm = self.clipper(parts, inv_scale)
        else:
            grads, grad_norm = self._clip_flat(parts[0] * inv_scale)
        finite = ops.isfinite(grad_norm)
        done, scale_used = self._update(grads, finite, lr)
        loss = loss / (self.accum_steps * self.dp)
        return ops.depend(loss, done), grad_norm, scale_used, ops.logical_not(finite), agreed, slots

    def _clip_flat(self, flat):
        """An unscaled flat buffer → (its pieces, clipped, in the parameters' shapes; its norm)."""
        grad_norm = ops.sqrt(ops.reduce_sum(ops.square(flat)))
        if self.grad_clip > 0:
            flat = flat * ops.minimum(self.grad_clip / (grad_norm + 1e-6), 1.0)
        out, at = [], 0
        for shape in self.shapes:
            size = int(np.prod(shape))
            out.append(flat[at:at + size].reshape(shape))
            at += size
        return out, grad_norm

    def _local_fused_step(self, tokens, poison, control):
        loss, grads = self._backward(tokens, poison)
        return self._buffer(grads, loss, control)

    def _local_finish_step(self, control):
        out = self._buffer([buf * 1.0 for buf in self.grad_buffers], self.loss_buffer * 1.0, control)
        return ops.depend(out, self._zero_buffers())

    def _apply_summed_step(self, summed, lr):
        flat, loss, agreed, slots = self._split(summed)
        return self._apply_parts([flat], loss, lr, agreed, slots)

    def _zero_buffers(self):
        done = ops.assign(self.loss_buffer, ops.zeros_like(self.loss_buffer))
        for buf in self.grad_buffers:
            done = ops.depend(done, ops.assign(buf, ops.zeros_like(buf)))
        return done

    def _fused_step(self, tokens, lr, poison, control):
        loss, grads = self._backward(tokens, poison)
        return self._apply(grads, loss, lr, control)

    def _accumulate_step(self, tokens, poison):
        loss, grads = self._backward(tokens, poison)
        done = ops.assign_add(self.loss_buffer, loss)
        for buf, g in zip(self.grad_buffers, grads):
            done = ops.depend(done, ops.assign_add(buf, g.astype(ms.float32)))
        return ops.depend(loss, done)

    def _finish_step(self, lr, control):
        grads = [buf * 1.0 for buf in self.grad_buffers]
        loss = self.loss_buffer * 1.0
        out = self._apply(grads, loss, lr, control)
        return ops.depend(out[0], self._zero_buffers()), out[1], out[2], out[3], out[4], out[5]

    # Python entry point ----------------------------------------------------
    def run(self, micro_batches: np.ndarray, lr: float, *, poison: float = 1.0,
            control: np.ndarray | None = None) -> StepResult:
        """micro_batches: int32 (grad_accum_steps, micro_batch, seq_len + 1) of this rank;
        control: int32 flags of this rank, returned summed over all ranks."""
        if micro_batches.shape[0] != self.accum_steps:
            raise ValueError(f"expected {self.accum_steps} micro-batches, got {micro_batches.shape[0]}")
        lr_t = Tensor(lr, ms.float32)
        poison_t = Tensor(poison, ms.float32)
        control_t = Tensor(np.zeros(1, np.int32) if control is None else control.astype(np.int32))
        if self._make_local is not None:
            out = self._run_local(micro_batches, lr_t, poison_t, control_t)
            synced = out.pop()
        elif self.accum_steps == 1:
            synced = time.perf_counter()
            out = self._fused(Tensor(micro_batches[0]), lr_t, poison_t, control_t)
        else:
            for micro in micro_batches:
                self._accumulate(Tensor(micro), poison_t)
            synced = time.perf_counter()
            out = self._finish(lr_t, control_t)
        loss, grad_norm, scale, skipped, agreed, slots = (x.asnumpy() for x in out)
        rank_losses = rank_grad_norms = None
        if self.world:
            # the slots hold sums over this rank's micro-batches, scaled by the loss scale (and a drill's poison)
            rank_losses = [float(v) / self.accum_steps for v in slots[:self.world]]
            rank_grad_norms = [float(np.sqrt(v)) / (float(scale) * self.accum_steps)
                               for v in slots[self.slots:self.slots + self.world]]
        return StepResult(loss=float(loss), grad_norm=float(grad_norm), loss_scale=float(scale),
                          skipped=bool(skipped), control=tuple(int(v) for v in agreed),
                          sync_s=time.perf_counter() - synced, rank_losses=rank_losses,
                          rank_grad_norms=rank_grad_norms)

    def _run_local(self, micro_batches, lr_t, poison_t, control_t) -> list:
        """The step with the shared-memory sum between the backward and the update graphs;
        returns the update's outputs and, last, when the sum began."""
        if self.accum_steps == 1:
            local = self._local_fused(Tensor(micro_batches[0]), poison_t, control_t)
        else:
            for micro in micro_batches:
                self._accumulate(Tensor(micro), poison_t)
            local = self._local_finish(control_t)
        synced = time.perf_counter()
        local = local.asnumpy()
        if self.local is None:
            self.local = self._make_local(size=local.size)
            how = "through shared memory" if isinstance(self.local, LocalAllReduce) else "through the group's hub"
            print(f"llm-pretrain: rank {self.local.rank} sums gradients with its {self.local.world - 1} "
                  f"peer(s) {how}", file=sys.stderr, flush=True)
        self._mark("sum")
        summed = self.local.all_reduce(local)
        self._mark("update")
        return [*self._apply_summed(Tensor.from_numpy(summed), lr_t), synced]

    def _mark(self, phase: str) -> None:
        """Where this rank is inside the step, for its daemon (contracts.phase_board); set by the rank."""
        if self.phases is not None:
            self.phases.enter(phase, self.phase_step)

    def compile(self, micro_batches: np.ndarray) -> None:
        """Nothing to do ahead: the first step compiles, and whole tensors load before it."""


def build_network(cfg: Config, parallelism: parallel.Parallelism, **step_args):
    """(the model, its step), built as a rank trains them: under semi-auto parallel inside
    `lazy_parameters` (each rank initialises only its slices, at the compile)."""
    from engine.model.causal_lm import build_model
    from engine.model.lazy_init import lazy_parameters

    with lazy_parameters(parallelism):
        net = build_model(cfg, parallelism)
        return net, build_step(net, cfg, parallelism, **step_args)


def build_step(net: CausalLM, cfg: Config, parallelism: parallel.Parallelism, *, rank: int = 0, world: int = 1,
               gradient_sum: GradientSum = GradientSum()):
    """The step for the generation's decided parallel mode: the hand-reduced TrainStep under DATA_PARALLEL, the
    framework-reduced ShardedTrainStep under semi-auto parallel. Data-parallel ranks sum their gradients as
    `gradient_sum` says (decided with the rank's setup: engine.training.gradient_sum.choose)."""
    if parallelism.semi_auto:
        from engine.training.sharded_step import ShardedTrainStep

        return ShardedTrainStep(net, cfg, parallelism, rank=rank, run_dir=cfg.run.resolved_dir())
    local = None
    if gradient_sum.via == HUB:            # the supervisor's group across machines: a TCP hub
        from engine.training.hub_reduce import HubAllReduce

        local = functools.partial(HubAllReduce, rank=rank, world=world, hub=gradient_sum.hub,
                                  token=gradient_sum.prefix)
    elif gradient_sum.via == SHARED_MEMORY:
        local = functools.partial(LocalAllReduce, rank=rank, world=world, prefix=Path(gradient_sum.prefix),
                                  barrier=_cluster_barrier if gradient_sum.between_cluster_barriers else None)
    return TrainStep(net, cfg, reduction=parallelism.reduction, local_reduce=local, rank=rank, world=world)


_barrier_fn = None


def _cluster_barrier() -> None:
    """Every rank of MindSpore's cluster reaches this point (an all-reduce of one float)."""
    global _barrier_fn
    if _barrier_fn is None:
        all_reduce = ops.AllReduce()

        @ms.jit
        def barrier(x):
            return all_reduce(x)

        _barrier_fn = barrier
    _barrier_fn(Tensor(np.ones(1, np.float32))).asnumpy()
