"""The run configuration: one TOML file, one frozen dataclass per section, validated on load.

Owns: the schema (every key, its type, default and meaning), loading with
`--set section.key=value` overrides, every validity rule, and the hash of the
trajectory-defining keys that checkpoints record.

Must not import MindSpore (the supervisor and the CLI load configs without it).
The defaults are the tiny config: what runs when no file is given.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shlex
import types
import typing
from pathlib import Path
from typing import Any

import tomllib

from contracts import elastic
from contracts.errors import ConfigError

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")   # a run's name


def _fail(msg: str) -> typing.NoReturn:
    raise ConfigError(msg)


def _choice(path: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _fail(f"{path} = {value!r} is not allowed; use one of {', '.join(repr(a) for a in allowed)}")


def _at_least(path: str, value: float, low: float) -> None:
    if value < low:
        _fail(f"{path} = {value!r} is out of range; it must be >= {low}")


def _in_range(path: str, value: float, low: float, high: float, *, open_low: bool = False) -> None:
    if value < low or value > high or (open_low and value == low):
        bracket = "(" if open_low else "["
        _fail(f"{path} = {value!r} is out of range; it must be in {bracket}{low}, {high}]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The network's shape. Changing any of these starts a different model."""

    arch: str = "llama"            # "llama" (RMSNorm, RoPE, SwiGLU, GQA) or "gpt2" (LayerNorm, GELU, learned positions)
    vocab_size: int = 512          # embedding rows; >= the tokenizer's vocabulary
    hidden_size: int = 64          # model width
    num_layers: int = 2            # decoder blocks
    num_heads: int = 4             # query heads; hidden_size must divide by it
    num_kv_heads: int = 2          # key/value heads (grouped-query attention); divides num_heads
    intermediate_size: int = 176   # MLP inner width
    max_seq_len: int = 256         # longest sequence the positions support
    rope_theta: float = 10000.0    # RoPE base (llama)
    norm_eps: float = 1e-5         # epsilon of RMSNorm / LayerNorm
    tie_embeddings: bool = False   # share the input embedding with the output projection
    init_std: float = 0.02         # std of the normal init; output projections get std/sqrt(2*num_layers)
    init_from: str = ""            # "hf:DIR": start from a Hugging Face LLaMA directory's weights (only with no checkpoint yet)

    def __post_init__(self) -> None:
        _choice("model.arch", self.arch, ("llama", "gpt2"))
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "intermediate_size", "max_seq_len"):
            _at_least(f"model.{key}", getattr(self, key), 1)
        _at_least("model.vocab_size", self.vocab_size, 2)
        if self.hidden_size % self.num_heads:
            _fail(f"model.hidden_size = {self.hidden_size} must be divisible by model.num_heads = {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            _fail(f"model.num_kv_heads = {self.num_kv_heads} must divide model.num_heads = {self.num_heads}")
        if self.arch == "llama" and self.head_dim % 2:
            _fail(f"model.hidden_size / model.num_heads = {self.head_dim} must be even for rotary embeddings")
        _in_range("model.rope_theta", self.rope_theta, 1.0, 1e9)
        _in_range("model.norm_eps", self.norm_eps, 0.0, 1e-2, open_low=True)
        _in_range("model.init_std", self.init_std, 0.0, 1.0, open_low=True)
        if self.init_from and not (self.init_from.startswith("hf:") and len(self.init_from) > 3):
            _fail(f"model.init_from = {self.init_from!r} is not allowed; use \"\" or \"hf:DIR\" (a Hugging Face "
                  "LLaMA directory with config.json and .safetensors files)")
        if self.init_from and self.arch != "llama":
            _fail("model.init_from needs model.arch = \"llama\" (Hugging Face LlamaForCausalLM weights)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where training sequences come from and in which order."""

    source: str = "prepared"       # "prepared": a corpus from `llm-pretrain prepare-data`; "synthetic": a
                                   # seeded Markov chain (learnable, no files; for tests)
    path: str = ""                 # prepared corpus directory; "" = the embedded corpus (this Python's standard
                                   # library, byte-level), prepared on first use into the cache directory
    verify_checksums: bool = True  # corpus v2: each block's CRC32C when first read in an epoch; v1: sha256 at open
    seq_len: int = 64              # tokens per training sequence (each sample holds seq_len + 1)
    seed: int = 1234               # data order (and the synthetic chain)
    synthetic_successors: int = 4  # synthetic: distinct next tokens each token can have
    prefetch_steps: int = 4        # steps' batches the input pipeline prepares ahead in the background
    validation_path: str = ""      # held-out corpus for the validation loss; "" = the training corpus's own
                                   # validation split (prepare-data --validation-fraction), if it has one

    def __post_init__(self) -> None:
        _choice("data.source", self.source, ("prepared", "synthetic"))
        _at_least("data.prefetch_steps", self.prefetch_steps, 1)
        _at_least("data.seq_len", self.seq_len, 2)
        _at_least("data.seed", self.seed, 0)
        _at_least("data.synthetic_successors", self.synthetic_successors, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How the step runs: device, precision, batch geometry, length."""

    device: str = "cpu"            # "cpu" or "ascend"
    precision: str = "fp32"        # compute dtype: "fp32", "fp16" (loss-scaled) or "bf16" (ascend only)
    steps: int = 200               # optimizer steps in the run
    global_batch: int = 8          # sequences per optimizer step = micro_batch * grad_accum_steps * dp
    micro_batch: int = 8           # sequences per forward/backward on one rank
    grad_accum_steps: int = 1      # micro-batches accumulated per optimizer step
    recompute: bool = False        # recompute decoder layers' activations in the backward pass (saves memory)
    recompute_num_layers: int = 0  # with recompute: how many layers, from the first, recompute; 0 = all
    seed: int = 1234               # parameter init
    compute_threads: int = 0       # intra-op threads per rank; 0 = this machine's cores / local ranks
    fused_kernels: bool = True     # cpu: RMSNorm, causal softmax, SwiGLU, RoPE as C++ kernels (g++, built once)
    flash_attention: bool = True   # ascend: MindSpore's fused FlashAttentionScore (causal, GQA); cpu: always eager
    loss_scale_init: float = 65536.0     # fp16: initial dynamic loss scale
    loss_scale_window_steps: int = 1000  # fp16: clean steps before the scale doubles
    loss_scale_min: float = 1.0          # fp16: the scale never halves below this
    log_interval_steps: int = 1    # print a step line every N steps
    eval_interval_steps: int = 100  # the validation loss every N steps (and at the last); 0 = never
    eval_batches: int = 4          # of train.micro_batch held-out sequences: the same ones each time, on every rank

    def __post_init__(self) -> None:
        _choice("train.device", self.device, ("cpu", "ascend"))
        _at_least("train.eval_interval_steps", self.eval_interval_steps, 0)
        _at_least("train.eval_batches", self.eval_batches, 1)
        _choice("train.precision", self.precision, ("fp32", "fp16", "bf16"))
        for key in ("steps", "global_batch", "micro_batch", "grad_accum_steps", "loss_scale_window_steps",
                    "log_interval_steps"):
            _at_least(f"train.{key}", getattr(self, key), 1)
        _at_least("train.seed", self.seed, 0)
        _at_least("train.compute_threads", self.compute_threads, 0)
        _at_least("train.recompute_num_layers", self.recompute_num_layers, 0)
        _in_range("train.loss_scale_min", self.loss_scale_min, 0.0, 2.0**24, open_low=True)
        _in_range("train.loss_scale_init", self.loss_scale_init, self.loss_scale_min, 2.0**24)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW (bias-corrected, decoupled weight decay) with linear warmup then cosine decay."""

    lr: float = 3e-3               # peak learning rate, reached at the end of warmup
    min_lr: float = 3e-4           # floor of the cosine decay
    warmup_steps: int = 20         # linear warmup from lr/warmup_steps to lr
    cosine_steps: int = 0          # length of the cosine decay after warmup; 0 = until train.steps
    beta1: float = 0.9             # decay of the first-moment estimate
    beta2: float = 0.95            # decay of the second-moment estimate
    eps: float = 1e-8              # added to the second moment's root, as torch's AdamW does
    weight_decay: float = 0.1      # applied to matrices and embeddings, not to norms and biases
    grad_clip: float = 1.0         # global-norm clipping threshold; 0 disables

    def __post_init__(self) -> None:
        _in_range("optim.lr", self.lr, 0.0, 10.0, open_low=True)
        _in_range("optim.min_lr", self.min_lr, 0.0, self.lr)
        _at_least("optim.warmup_steps", self.warmup_steps, 0)
        _at_least("optim.cosine_steps", self.cosine_steps, 0)
        _in_range("optim.beta1", self.beta1, 0.0, 0.999999)
        _in_range("optim.beta2", self.beta2, 0.0, 0.999999)
        _in_range("optim.eps", self.eps, 0.0, 1.0, open_low=True)
        _in_range("optim.weight_decay", self.weight_decay, 0.0, 10.0)
        _at_least("optim.grad_clip", self.grad_clip, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Parallel layout. On CPU only data parallel runs; tp/pp/sharding map onto Ascend's semi-auto parallel."""

    dp: int = 1                    # data-parallel ranks
    tp: int = 1                    # tensor-parallel ranks (Ascend)
    pp: int = 1                    # pipeline stages (Ascend)
    pipeline_microbatches: int = 1  # micro-batches in flight through the pipeline (Ascend, pp > 1)
    optimizer_shard: bool = False  # shard the fp32 weights and optimizer states across dp (Ascend)
    sp: bool = False               # sequence parallel: norms and element-wise ops split along the sequence
                                   # inside each tensor-parallel group (Ascend, tp > 1; MindFormers' use_seq_parallel)
    device_memory_gib: float = 64.0  # memory of one device (Ascend); `run` refuses a layout the estimate
                                     # (`llm-pretrain plan`) says cannot fit
    plan_recipe: str = "project"   # what `plan` counts: "project" (this project's step: fp32 weights, gradients and
                                   # accumulators, fp32 residual stream) or "mindformers" (MindFormers' LLaMA-2
                                   # pretrain recipe, to compare with its published figures: fp16 weights, gradients
                                   # and accumulators, fp32 AdamW moments, no fp32 master copy, activations in the
                                   # compute dtype); `run` refuses "mindformers" (configs/mindformers-llama2-7b.toml)
    local_reduce: bool = True      # CPU data parallel with every rank on one machine: sum gradients through
                                   # /dev/shm (engine/training/local_reduce.py) instead of MindSpore's AllReduce, and
                                   # under the daemon form no MindSpore cluster (daemon/processes/mindspore_env.py); false:
                                   # MindSpore's cluster and AllReduce (no effect on Ascend or across nodes)
    bind_cores: bool = True        # CPU, several ranks on one machine as a local group (local_reduce): each
                                   # rank's threads bound to its own share of the cores this process may use
                                   # (engine/rank/runtime.py; as numactl or Intel's multi-instance launcher do);
                                   # false: the scheduler's choice. Under msrun: msrun's --bind_core

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp", "pipeline_microbatches"):
            _at_least(f"parallel.{key}", getattr(self, key), 1)
        _in_range("parallel.device_memory_gib", self.device_memory_gib, 0.0, 1e6, open_low=True)
        _choice("parallel.plan_recipe", self.plan_recipe, ("project", "mindformers"))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


CHECKPOINT_CHECKSUMS = ("crc32c", "sha256")     # checkpointing.checksums.ALGORITHMS
MEMORY_PLACEMENTS = ("replica", "buddy")        # checkpoint.memory_placement (checkpointing.parts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When checkpoints are saved and which are kept."""

    interval_steps: int | str = 50  # save every N steps (0 = only on stop and at the end); "auto": as often as
                                    # the failure rate says (Young/Daly, daemon/judging/cadence.py)
    keep_last: int = 3             # retain the newest N
    keep_every_steps: int = 0      # also retain every checkpoint whose step divides by this (0 = none)
    keep_incident_bundles: int = 20  # post-mortem bundles kept (<run.dir>/incidents/, one per incident): the newest
                                     # N, fewer once retention deletes their checkpoints (0 = none written)
    memory_interval_steps: int | str = 0  # also every N steps to RAM (memory_dir): a crash loses at most N steps
                                          # (0 = off; "auto": as interval_steps)
    memory_dir: str = "/dev/shm"   # where the RAM tier lives (a tmpfs); one directory per run under it
    peer_fetch_timeout_s: float = 300.0  # several machines: one back with an empty RAM tier takes the run's newest
                                         # RAM step from a peer for at most this long (else all resume from disk)
    memory_placement: str = "replica"  # several machines: "replica" (each machine's RAM tier a whole checkpoint) or
                                       # "buddy" (each its own part, as on disk, and a copy of a buddy machine's part)
    checksum: str = "crc32c"       # each disk shard's, in the manifest: "crc32c" (in hardware: a save's CPU ~10x
                                   # less) or "sha256" (names the content); the RAM tier's is always CRC32C
    direct_io: bool = True         # disk shards written past the page cache (O_DIRECT) where the file system takes
                                   # it (a save cost small-20m 1.4 % against 7.3 % buffered); false: through it
    auto_mtbf_prior_s: float = 86400.0   # "auto": the time between failures assumed before any is seen; observed
                                         # failures replace it as they come
    auto_min_interval_steps: int = 10    # "auto": never more often than this ...
    auto_max_interval_steps: int = 10000  # ... nor less often than this

    def __post_init__(self) -> None:
        for key in ("interval_steps", "memory_interval_steps"):
            value = getattr(self, key)
            if isinstance(value, str):
                if value != "auto":
                    _fail(f'checkpoint.{key} = {value!r} must be an integer >= 0 or "auto"')
            else:
                _at_least(f"checkpoint.{key}", value, 0)
        _at_least("checkpoint.keep_last", self.keep_last, 1)
        _at_least("checkpoint.keep_every_steps", self.keep_every_steps, 0)
        _at_least("checkpoint.keep_incident_bundles", self.keep_incident_bundles, 0)
        _in_range("checkpoint.auto_mtbf_prior_s", self.auto_mtbf_prior_s, 0.0, 1e9, open_low=True)
        _at_least("checkpoint.auto_min_interval_steps", self.auto_min_interval_steps, 1)
        _at_least("checkpoint.auto_max_interval_steps", self.auto_max_interval_steps, self.auto_min_interval_steps)
        _choice("checkpoint.checksum", self.checksum, CHECKPOINT_CHECKSUMS)
        _in_range("checkpoint.peer_fetch_timeout_s", self.peer_fetch_timeout_s, 0.0, 1e6)
        _choice("checkpoint.memory_placement", self.memory_placement, MEMORY_PLACEMENTS)
        if not os.path.isabs(self.memory_dir):
            _fail(f"checkpoint.memory_dir = {self.memory_dir!r} must be an absolute path (a tmpfs such as /dev/shm)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HealthConfig:
    """Incident detection and the recovery policy's limits."""

    allow_fault_injection: bool = False  # honour fault drills (`inject` commands) in the workers
    rerun: bool = True                   # before a NaN, loss spike or collapse (or a grad-norm spike acted on) is
                                         # rolled back, re-run its steps from the checkpoint before them: reproduced
                                         # -> the data or the numbers (the policy below); not -> a transient fault,
                                         # training goes on from the rerun (no rollback, no skip, no lr cut)
    fingerprint_interval_steps: int = 100  # every N steps each data-parallel replica reduces its parameters to a
                                         # few integers and the daemon compares them: one that differs was
                                         # corrupted silently -> roll back to the newest checkpoint all agreed at
                                         # (0: off)
    rank_outlier_steps: int = 3          # data parallel: one rank's own gradient norm 10x the others' median this
                                         # many steps in a row is an incident (a device adding to its gradients, or
                                         # data only its share holds), triaged as the numerical ones (0: off)
    quarantine_probation_s: float = 3600.0  # a device (one machine) or machine (several) judged faulty is left out
                                         # of the generations for this long, then taken back on probation
    transient_faults_to_quarantine: int = 3  # this many transient faults pointing at one device (or machine) within
    transient_fault_window_s: float = 86400.0  # ... this window quarantine it (0: never)
    rerun_rtol: float = 0.0              # reproduced: each rerun step's loss and grad norm within this relative
                                         # tolerance of the first run's (0: bit for bit; CPU and Ascend's deterministic
                                         # mode repeat a step exactly, other devices need a tolerance)
    loss_spike_window_steps: int = 50    # trailing steps whose median and MAD are the baseline
    loss_spike_mad_k: float = 4.0        # a step is high above median + k x MAD-sigma ...
    loss_spike_min_rel: float = 0.1      # ... and at least this fraction above the median
    loss_spike_hold_steps: int = 3       # high steps in a row that make a spike (one bursty batch never does)
    loss_spike_warmup_steps: int = 100   # steps before spikes are judged (the loss falls fast early on)
    loss_collapse_min_rel: float = 0.5   # a loss collapse: below median - k x MAD-sigma and at least this fraction
                                         # below the median (0.5: under half of it), held and warmed up as a spike;
                                         # 1.0 turns it off (a loss is never negative)
    grad_norm_mad_k: float = 6.0         # the same statistic on the gradient norm
    grad_norm_action: str = "warn"       # "warn", or "rollback" to treat a grad-norm spike like a loss spike
    grad_norm_burst_factor: float = 100.0  # warn on a single step's grad norm >= this x the window's median (0: off)
    overflow_storm_steps: int = 10       # fp16: skipped steps in a row that make an incident
    throughput_window_steps: int = 100   # steps whose median tokens/s is compared with the best seen
    throughput_drop: float = 0.3         # warn when tokens/s falls this fraction below the best
    loss_stall_steps: int = 2000         # warn when the smoothed loss has not improved for this long
    loss_stall_min_delta: float = 0.01   # ... by at least this fraction
    rollback_margin_steps: int = 10      # a checkpoint this close before an incident's start is not healthy
    lr_cut_factor: float = 0.5           # lr override after a numerical incident; compounds on recurrence
    lr_hold_steps: int = 200             # the cut holds this long after the resumed step ...
    lr_ramp_steps: int = 200             # ... then ramps linearly back to 1 over this many
    lr_floor_factor: float = 0.0625      # a cut that would go below this gives up (exit 4)
    recur_window_steps: int = 1000       # incidents of a kind this close together count as recurring
    loss_scale_cut: float = 0.25         # fp16 overflow storm: restart at the storm's starting scale x this ...
    loss_scale_cap_steps: int = 1000     # ... with growth capped at that scale for this many steps
    hang_floor_s: float = 60.0           # a training rank is hung after max(this, hang_step_multiplier x p99 step time)
    hang_step_multiplier: float = 10.0   # ... without a new step
    hang_start_timeout_s: float = 600.0  # from process start to the first event (imports, cluster forming, restore)
    hang_compile_timeout_s: float = 900.0  # for the first step (graph compilation)
    hang_checkpoint_timeout_s: float = 600.0  # for the final save's commit
    stall_floor_s: float = 10.0          # a rank stuck this long in one phase of a step (its phase board) while the
                                         # others wait for it is named and the generation restarted: after max(this,
                                         # hang_step_multiplier x p99 step time), once this generation has a step time
    max_restarts_without_progress: int = 3  # crash loop: this many restarts with no new committed checkpoint (either tier): exit 3
    straggler_action: str = "warn"       # a rank the others wait for: "warn", "restart" the generation, or "exclude"
                                         # its device (several machines: its machine) as a faulty one, when
    straggler_restart_after_s: float = 300.0  # ... it stays slow this long (on a cluster: its node excluded)
    straggler_window_steps: int = 20     # steps whose median lag per rank is judged
    straggler_min_lag_s: float = 0.05    # a straggler's median lag is at least this ...
    straggler_min_rel: float = 0.2       # ... and this fraction of the median step period
    max_quarantined_fraction: float = 0.05  # corrupt corpus blocks are quarantined up to this fraction; beyond: exit 65
    restart_backoff_initial_s: float = 1.0  # delay of a restart that repeats without progress; doubles, jittered
    restart_backoff_max_s: float = 60.0     # cap on the restart delay

    def __post_init__(self) -> None:
        for key in ("hang_floor_s", "hang_step_multiplier", "hang_start_timeout_s", "hang_compile_timeout_s",
                    "hang_checkpoint_timeout_s", "stall_floor_s", "restart_backoff_max_s"):
            _in_range(f"health.{key}", getattr(self, key), 0.0, 1e7, open_low=True)
        _in_range("health.restart_backoff_initial_s", self.restart_backoff_initial_s, 0.0,
                  self.restart_backoff_max_s)
        _at_least("health.max_restarts_without_progress", self.max_restarts_without_progress, 1)
        for key in ("loss_spike_window_steps", "loss_spike_hold_steps", "overflow_storm_steps",
                    "throughput_window_steps", "loss_stall_steps"):
            _at_least(f"health.{key}", getattr(self, key), 1)
        _at_least("health.loss_spike_warmup_steps", self.loss_spike_warmup_steps, 0)
        for key in ("loss_spike_mad_k", "grad_norm_mad_k"):
            _in_range(f"health.{key}", getattr(self, key), 0.0, 1000.0, open_low=True)
        for key in ("loss_spike_min_rel", "throughput_drop", "loss_stall_min_delta"):
            _in_range(f"health.{key}", getattr(self, key), 0.0, 1.0)
        _in_range("health.loss_collapse_min_rel", self.loss_collapse_min_rel, 0.0, 1.0, open_low=True)
        _choice("health.grad_norm_action", self.grad_norm_action, ("warn", "rollback"))
        _in_range("health.rerun_rtol", self.rerun_rtol, 0.0, 1.0)
        _at_least("health.fingerprint_interval_steps", self.fingerprint_interval_steps, 0)
        _in_range("health.grad_norm_burst_factor", self.grad_norm_burst_factor, 0.0, 1e9)
        for key in ("rollback_margin_steps", "lr_hold_steps", "lr_ramp_steps", "recur_window_steps",
                    "loss_scale_cap_steps"):
            _at_least(f"health.{key}", getattr(self, key), 0)
        for key in ("lr_cut_factor", "loss_scale_cut"):
            _in_range(f"health.{key}", getattr(self, key), 0.0, 1.0, open_low=True)
        _in_range("health.lr_floor_factor", self.lr_floor_factor, 0.0, 1.0, open_low=True)
        _in_range("health.max_quarantined_fraction", self.max_quarantined_fraction, 0.0, 1.0)
        _choice("health.straggler_action", self.straggler_action, ("warn", "restart", "exclude"))
        _at_least("health.rank_outlier_steps", self.rank_outlier_steps, 0)
        _at_least("health.transient_faults_to_quarantine", self.transient_faults_to_quarantine, 0)
        _in_range("health.quarantine_probation_s", self.quarantine_probation_s, 0.0, 1e9)
        _in_range("health.transient_fault_window_s", self.transient_fault_window_s, 0.0, 1e9)
        _at_least("health.straggler_window_steps", self.straggler_window_steps, 2)
        _in_range("health.straggler_restart_after_s", self.straggler_restart_after_s, 0.0, 1e7)
        _in_range("health.straggler_min_lag_s", self.straggler_min_lag_s, 0.0, 1e4)
        _in_range("health.straggler_min_rel", self.straggler_min_rel, 0.0, 1.0)


def coordinator_endpoints(url: str) -> list[tuple[str, int]]:
    """`etcd://HOST:PORT[,HOST:PORT…]` → [(host, port), …]; ValueError naming what is wrong."""
    import urllib.parse

    if not url.startswith("etcd://"):
        raise ValueError(f"{url!r} must look like etcd://HOST:PORT[,HOST:PORT…]")
    out = []
    for part in url[len("etcd://"):].rstrip("/").split(","):
        parsed = urllib.parse.urlsplit(f"//{part}")
        try:
            port = parsed.port
        except ValueError:
            port = None
        if not parsed.hostname or port is None or parsed.path:
            raise ValueError(f"{part!r} in {url!r} must be HOST:PORT")
        out.append((parsed.hostname, port))
    return out


EMBEDDED = "embedded"
EMBEDDED_CLIENT_PORT, EMBEDDED_PEER_PORT = 2379, 2380     # etcd's own defaults


def sp_rows(micro_batch: int, pp: int, pipeline_microbatches: int) -> int:
    """Sequences per dp rank in one compiled micro-step (a pipeline splits micro_batch into its
    micro-batches): sequence parallelism's row-parallel split matches the residual's only at 1."""
    return micro_batch // pipeline_microbatches if pp > 1 else micro_batch


def embedded_members(spec: str) -> list[tuple[str, int, int]]:
    """run.coordinator_members, `HOST[:CLIENT_PORT:PEER_PORT],…` → [(host, client port, peer port), …]
    (member i runs on node i); ValueError naming what is wrong."""
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part.count(":") not in (0, 2):
            raise ValueError(f"{part!r} must be HOST or HOST:CLIENT_PORT:PEER_PORT")
        host, *ports = part.split(":")
        try:
            client, peer = (int(p) for p in ports) if ports else (EMBEDDED_CLIENT_PORT, EMBEDDED_PEER_PORT)
        except ValueError:
            raise ValueError(f"{part!r} must be HOST or HOST:CLIENT_PORT:PEER_PORT") from None
        if not host or any(c.isspace() for c in host) or not (0 < client < 65536 and 0 < peer < 65536):
            raise ValueError(f"{part!r} must be HOST or HOST:CLIENT_PORT:PEER_PORT")
        out.append((host, client, peer))
    return out


def run_endpoints(run: "RunConfig") -> list[tuple[str, int]]:
    """Where the run's etcd answers: run.coordinator's endpoints, or the embedded members' clients."""
    if run.coordinator == EMBEDDED:
        return [(host, client) for host, client, _ in embedded_members(run.coordinator_members)]
    return coordinator_endpoints(run.coordinator)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Naming and where the run's files live."""

    name: str = "tiny"             # letters, digits, '-', '_', '.'; not given, one machine with run.dir: the dir's name
    dir: str = ""                  # run directory; "" = $STATE_DIRECTORY/<name> under systemd, else ./runs/<name>
    log_dir: str = ""              # event and rank logs; "" = $LOGS_DIRECTORY/<name> under systemd, else <dir>/logs
    nodes: int = 1                 # machines in the cluster, one supervisor each
    node_rank: int = 0             # this machine's index: orders the machines (whichever decides runs the scheduler)
    master_addr: str = "127.0.0.1"  # one machine: where MindSpore's scheduler listens (several: the decider's node_addr)
    node_addr: str = ""            # several machines: this one's address the others reach; "" = the one that reaches etcd
    master_port: int = 0           # the scheduler's port; 0 = a free port, fresh each generation (single node)
    coordinator: str = ""          # etcd://HOST:PORT[,HOST:PORT…], or "embedded": the nodes' daemons agree through etcd
    coordinator_members: str = ""  # "embedded": the first 3 (or 5) machines' addresses, node-rank order (each runs a member)
    coordinator_prefix: str = ""   # this run's etcd keys live under it; "" = /llm-pretrain/<name>/
    coordinator_timeout_s: float = 60.0   # etcd unreachable this long: checkpoint and stop (exit 75)
    node_lease_ttl_s: int = 5      # a node whose daemon is silent this long is lost
    node_join_timeout_s: float = 600.0    # a fresh run's first generation waits this long for every machine to boot
    node_rejoin_timeout_s: float = 60.0   # a lost node back within this long: the run goes on at full size
    min_nodes: int = 0             # fewer nodes than this (0 = run.nodes): wait, then stop; more: go on smaller
    stop_timeout_s: float = 300.0  # on stop: wait this long for the final checkpoint, then kill
    kill_grace_s: float = 10.0     # SIGTERM to SIGKILL when a generation is torn down
    pause_release_after_s: float = 600.0  # paused this long: stop the ranks to free the devices (resume restarts them)
    compile_cache: bool = True     # MindSpore's compile cache under <dir>/compile_cache: restarts recompile little
    standby: bool = True           # CPU: the next generation's ranks start (one node: and form their cluster)
                                   # while this one trains, so a restart skips ~2-5 s (daemon/processes/standby.py)
    metrics_port: int = 0          # > 0: Prometheus metrics on http://127.0.0.1:<port>/metrics (0: off)
    metrics_textfile: str = ""     # a node-exporter textfile to rewrite with the metrics ("" = off)
    log_max_bytes: int = 67108864  # events.jsonl rotates past this size (0: never) ...
    log_backups: int = 5           # ... keeping this many old files (events.jsonl.1 is the newest)
    worker_memory_limit_bytes: int = 0  # > 0: each rank in its own memory cgroup with this limit (OOM is then told apart)
    devices: str = ""              # this machine's devices for its ranks, comma-separated ids in rank order ("" = the
                                   # visible-devices variable's, else 0..ranks-1); a device judged faulty is left out
    failure_domains: str = ""      # several machines: each one's failure domain (rack, switch, power), comma-separated
                                   # in node-rank order; a buddy copy goes to another domain ("" = each its own)

    def __post_init__(self) -> None:
        _at_least("run.nodes", self.nodes, 1)
        if self.devices:
            device_ids(self.devices)
        if self.failure_domains and len(domains := failure_domains(self.failure_domains)) != self.nodes:
            _fail(f"run.failure_domains = {self.failure_domains!r} names {len(domains)} machine(s); run.nodes = "
                  f"{self.nodes}: one name per machine, comma-separated in node-rank order")
        _in_range("run.node_rank", self.node_rank, 0, self.nodes - 1)
        _in_range("run.master_port", self.master_port, 0, 65535)
        _in_range("run.coordinator_timeout_s", self.coordinator_timeout_s, 0.0, 1e6, open_low=True)
        _in_range("run.node_lease_ttl_s", self.node_lease_ttl_s, 2, 3600)
        _in_range("run.node_join_timeout_s", self.node_join_timeout_s, 0.0, 1e6)
        _in_range("run.node_rejoin_timeout_s", self.node_rejoin_timeout_s, 0.0, 1e6)
        _in_range("run.min_nodes", self.min_nodes, 0, self.nodes)
        if self.coordinator == EMBEDDED:
            self._check_embedded()
        elif self.coordinator:
            try:
                coordinator_endpoints(self.coordinator)
            except ValueError as e:
                _fail(f"run.coordinator: {e}")
        elif self.nodes > 1:
            _fail(f"run.nodes = {self.nodes} needs run.coordinator = \"etcd://HOST:PORT[,HOST:PORT…]\": the nodes' "
                  "daemons agree on generations and decisions through etcd")
        if self.coordinator_prefix and not self.coordinator_prefix.startswith("/"):
            _fail(f"run.coordinator_prefix = {self.coordinator_prefix!r} must start with '/'")
        _in_range("run.stop_timeout_s", self.stop_timeout_s, 0.0, 1e6, open_low=True)
        _in_range("run.kill_grace_s", self.kill_grace_s, 0.0, 3600.0)
        _in_range("run.pause_release_after_s", self.pause_release_after_s, 0.0, 1e7)
        _in_range("run.metrics_port", self.metrics_port, 0, 65535)
        _at_least("run.log_max_bytes", self.log_max_bytes, 0)
        _in_range("run.log_backups", self.log_backups, 0, 1000)
        if self.worker_memory_limit_bytes != 0 and not (1 << 24) <= self.worker_memory_limit_bytes <= (1 << 50):
            _fail(f"run.worker_memory_limit_bytes = {self.worker_memory_limit_bytes} is out of range; use 0 "
                  "(no limit) or a byte count from 16777216 (16 MiB) to 2**50")
        if not self.master_addr or any(c.isspace() for c in self.master_addr):
            _fail(f"run.master_addr = {self.master_addr!r} must be a host name or address")
        if any(c.isspace() for c in self.node_addr):
            _fail(f"run.node_addr = {self.node_addr!r} must be a host name or address (or \"\": found)")
        if not self.name or not set(self.name) <= _NAME_CHARS or self.name.startswith("."):
            _fail(f"run.name = {self.name!r} is not allowed; use letters, digits, '-', '_' and '.' "
                  "(not starting with '.')")

    def _check_embedded(self) -> None:
        if self.nodes < 3:
            _fail(f"run.coordinator = \"embedded\" needs run.nodes >= 3, not {self.nodes}: with two machines no "
                  "embedded etcd quorum survives the loss of one; use an external etcd (etcd://HOST:PORT,…)")
        try:
            members = embedded_members(self.coordinator_members)
        except ValueError as e:
            _fail(f"run.coordinator_members: {e}")
        if len(members) not in (3, 5) or len(members) > self.nodes:
            _fail(f"run.coordinator_members = {self.coordinator_members!r}: run.coordinator = \"embedded\" needs the "
                  f"addresses of the first 3 (or 5) of the run.nodes = {self.nodes} machines, in node-rank order "
                  "(node i runs etcd member i), as HOST or HOST:CLIENT_PORT:PEER_PORT, comma-separated")

    @property
    def key_prefix(self) -> str:
        """Where this run's keys live in etcd (ends with '/')."""
        return (self.coordinator_prefix or f"/llm-pretrain/{self.name}/").rstrip("/") + "/"

    @property
    def quorum(self) -> int:
        """The fewest nodes the run trains on."""
        return self.min_nodes or self.nodes

    def resolved_dir(self, env: typing.Mapping[str, str] = os.environ) -> Path:
        if self.dir:
            return Path(self.dir)
        state = env.get("STATE_DIRECTORY")
        return Path(state.split(":")[0]) / self.name if state else Path("runs") / self.name

    def resolved_log_dir(self, env: typing.Mapping[str, str] = os.environ) -> Path:
        if self.log_dir:
            return Path(self.log_dir)
        logs = env.get("LOGS_DIRECTORY")
        base = Path(logs.split(":")[0]) / self.name if logs else self.resolved_dir(env) / "logs"
        return base if self.nodes == 1 else base / f"node-{self.node_rank}"     # a shared run dir: one per node


def failure_domains(text: str) -> tuple[str, ...]:
    """run.failure_domains as names, one per machine in node-rank order (empty: each machine its own); a one-line
    ConfigError for an empty name."""
    if not text:
        return ()
    names = tuple(x.strip() for x in text.split(","))
    if not all(names):
        _fail(f"run.failure_domains = {text!r} has an empty name: one name per machine, comma-separated "
              "(\"rack-a,rack-a,rack-b,rack-b\"), or \"\" for each machine its own")
    return names


def device_ids(text: str) -> tuple[int, ...]:
    """run.devices as ids; a one-line ConfigError when it is not distinct non-negative integers."""
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        ids = ()
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        _fail(f"run.devices = {text!r} must be distinct device ids, comma-separated (\"0,1,2,3\"), or \"\" for all")
    return ids


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScriptConfig:
    """A training script of the user's own run as each rank instead of this project's engine
    (docs/bring-your-own-script.md): it reports through `llm_pretrain_client`, and the daemon supervises it as it
    does the engine's ranks. train.steps, train.global_batch, data.seq_len and parallel.dp then describe the
    script's run (progress, tokens, ranks); model.* and data.* beyond seq_len are not read."""

    command: str = ""              # the script and its arguments after the interpreter, quoted as a shell would:
                                   # "train.py --lr 3e-4", "-m my_pkg.train"; "" = this project's engine
    python: str = ""               # the interpreter that runs it (the script's own environment, with
                                   # llm_pretrain_client installed); "" = the daemon's own
    cwd: str = ""                  # its working directory; "" = the directory `run` was started in

    def __post_init__(self) -> None:
        if self.command:
            try:
                argv = shlex.split(self.command)
            except ValueError as e:
                _fail(f"script.command = {self.command!r} cannot be split into arguments ({e}); quote it as a "
                      "shell would: \"train.py --name 'my run'\"")
            if not argv:
                _fail("script.command = \"\" after quoting holds no argument: name the script, \"train.py ...\"")
        elif self.python or self.cwd:
            _fail("script.python and script.cwd need script.command (the script to run); with no command the "
                  "ranks run this project's engine")

    @property
    def argv(self) -> list[str]:
        """The command's arguments after the interpreter ([] = the engine)."""
        return shlex.split(self.command) if self.command else []


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    parallel: ParallelConfig = ParallelConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    health: HealthConfig = HealthConfig()
    run: RunConfig = RunConfig()
    script: ScriptConfig = ScriptConfig()

    def __post_init__(self) -> None:
        _check_cross_section(self)

    @property
    def recompute_layers(self) -> int:
        """How many decoder layers, from the first, recompute their activations (0 = none)."""
        if not self.train.recompute:
            return 0
        return self.train.recompute_num_layers or self.model.num_layers

    @property
    def cosine_steps(self) -> int:
        """The resolved length of the cosine decay."""
        return self.optim.cosine_steps or max(1, self.train.steps - self.optim.warmup_steps)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_elastic(cfg: Config) -> None:
    """A run allowed to go on with fewer machines must keep its global batch on each machine count."""
    p, t, r = cfg.parallel, cfg.train, cfg.run
    count = elastic.unshapeable(nodes=r.nodes, min_nodes=r.quorum, ranks_per_node=p.world_size // r.nodes,
                                model_parallel=p.tp * p.pp, global_batch=t.global_batch, micro_batch=t.micro_batch)
    if count is not None:
        ranks = count * (p.world_size // r.nodes)
        _fail(f"run.min_nodes = {r.quorum} lets the run go on with {count} of run.nodes = {r.nodes} machines "
              f"({ranks} ranks), which cannot keep train.global_batch = {t.global_batch}: on every machine count "
              f"from run.min_nodes up, the ranks must divide by tp x pp = {p.tp * p.pp} and the data-parallel "
              "size must divide the global batch (raise run.min_nodes or choose a global batch that does)")


def _check_sequence_parallel(cfg: Config) -> None:
    p, t = cfg.parallel, cfg.train
    if p.tp == 1:
        _fail("parallel.sp = true needs parallel.tp > 1 (it splits the sequence inside a tensor-parallel group)")
    if cfg.data.seq_len % p.tp:
        _fail(f"data.seq_len = {cfg.data.seq_len} must be divisible by parallel.tp = {p.tp} with parallel.sp = true")
    if (rows := sp_rows(t.micro_batch, p.pp, p.pipeline_microbatches)) != 1:
        _fail(f"parallel.sp = true needs one sequence per dp rank in each micro-step, and this layout has {rows} "
              f"(train.micro_batch = {t.micro_batch}" + (f" / parallel.pipeline_microbatches = "
              f"{p.pipeline_microbatches}" if p.pp > 1 else "") + "): the row-parallel outputs are split over "
              "dp x tp blocks of the flattened tokens, which is the residual's (dp, tp) split only then; "
              "move the rest into train.grad_accum_steps")


def _check_cross_section(cfg: Config) -> None:
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if t.recompute_num_layers > m.num_layers:
        _fail(f"train.recompute_num_layers = {t.recompute_num_layers} exceeds model.num_layers = {m.num_layers}")
    if p.world_size % cfg.run.nodes:
        _fail(f"parallel.dp x tp x pp = {p.world_size} ranks do not divide over run.nodes = {cfg.run.nodes}")
    if cfg.run.devices and (named := len(device_ids(cfg.run.devices))) != p.world_size // cfg.run.nodes:
        _fail(f"run.devices = {cfg.run.devices!r} names {named} device(s) for the "
              f"{p.world_size // cfg.run.nodes} ranks of each machine (dp x tp x pp / run.nodes): one per rank")
    if cfg.run.quorum < cfg.run.nodes:
        _check_elastic(cfg)
    if cfg.run.nodes > 1 and cfg.run.master_port == 0:
        _fail("run.master_port = 0 picks a port on one machine only; with run.nodes > 1 set a fixed port")
    if cfg.run.worker_memory_limit_bytes and cfg.checkpoint.memory_interval_steps:
        _fail("checkpoint.memory_interval_steps with run.worker_memory_limit_bytes: the RAM tier's tmpfs pages count "
              "against the ranks' memory limit, whose kills would read as the model's out-of-memory; set one to 0")
    if cfg.run.nodes > 1 and cfg.checkpoint.memory_interval_steps and cfg.script.command:
        _fail("checkpoint.memory_interval_steps with run.nodes > 1 and script.command: a script's RAM tier "
              "(llm_pretrain_client) is one machine's; set it to 0 (disk checkpoints only)")
    if cfg.run.nodes > 1 and cfg.checkpoint.memory_interval_steps and (
            p.tp > 1 or p.pp > 1 or p.optimizer_shard or p.sp) and cfg.checkpoint.memory_placement == "replica":
        _fail("checkpoint.memory_interval_steps with run.nodes > 1 and checkpoint.memory_placement = \"replica\" "
              "keeps a whole replica on every machine, and parallel.tp / pp / optimizer_shard / sp split the state "
              "across machines: set checkpoint.memory_placement = \"buddy\" (each machine's part and a copy of "
              "a buddy's), or checkpoint.memory_interval_steps = 0")
    if not cfg.script.command and cfg.data.seq_len > m.max_seq_len:     # a script's model is its own
        _fail(f"data.seq_len = {cfg.data.seq_len} exceeds model.max_seq_len = {m.max_seq_len}")
    if t.precision == "bf16" and t.device != "ascend":
        _fail(f'train.precision = "bf16" needs train.device = "ascend"; on "{t.device}" use "fp32" or "fp16"')
    if t.device == "cpu":
        for key, value, neutral in (("tp", p.tp, 1), ("pp", p.pp, 1),
                                    ("optimizer_shard", p.optimizer_shard, False),
                                    ("sp", p.sp, False)):
            if value != neutral:
                _fail(f"parallel.{key} = {_toml(value)} needs train.device = \"ascend\"; on \"cpu\" only "
                      f"data parallel runs (set parallel.{key} = {_toml(neutral)})")
    if p.plan_recipe != "project" and t.device != "ascend":
        _fail(f'parallel.plan_recipe = "{p.plan_recipe}" is an Ascend recipe for `plan`: it needs train.device = "ascend"')
    per_step = t.micro_batch * t.grad_accum_steps * p.dp
    if per_step != t.global_batch:
        _fail(f"train.global_batch = {t.global_batch} must equal train.micro_batch ({t.micro_batch}) x "
              f"train.grad_accum_steps ({t.grad_accum_steps}) x parallel.dp ({p.dp}) = {per_step}")
    if t.device == "ascend" and t.flash_attention and t.precision != "fp32" and m.head_dim % 16:
        _fail(f"model.hidden_size / model.num_heads = {m.head_dim} (the head size) must be a multiple of 16 for "
              "train.flash_attention = true (MindSpore's FlashAttentionScore); change the shape or set it to false")
    if not cfg.script.command:      # the rest is about this project's model, which a script does not run
        _check_model_layout(cfg)


def _check_model_layout(cfg: Config) -> None:
    """The model's shape against the parallel layout: what tp, sp and pp split must divide."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if p.tp > 1:
        for key in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            if getattr(m, key) % p.tp:
                _fail(f"model.{key} = {getattr(m, key)} must be divisible by parallel.tp = {p.tp}")
    if p.sp:
        _check_sequence_parallel(cfg)
    if p.pp > 1:
        if m.num_layers % p.pp:
            _fail(f"model.num_layers = {m.num_layers} must be divisible by parallel.pp = {p.pp} "
                  "(every pipeline stage holds the same number of layers)")
        if m.tie_embeddings:
            _fail("model.tie_embeddings = true is not supported with parallel.pp > 1 (the first and last "
                  "stages would share the embedding); untie it or set parallel.pp = 1")
        if p.pipeline_microbatches < p.pp:
            _fail(f"parallel.pipeline_microbatches = {p.pipeline_microbatches} must be >= parallel.pp = {p.pp} "
                  "or the pipeline never fills")
        if t.micro_batch % p.pipeline_microbatches:
            _fail(f"train.micro_batch = {t.micro_batch} must be divisible by parallel.pipeline_microbatches = "
                  f"{p.pipeline_microbatches}")
    elif p.pipeline_microbatches != 1:
        _fail(f"parallel.pipeline_microbatches = {p.pipeline_microbatches} needs parallel.pp > 1 (or set it to 1)")


def _toml(value: Any) -> str:
    """One TOML value (the config holds booleans, integers, finite floats and strings: JSON's
    spelling of each is valid TOML)."""
    return json.dumps(value)


def to_toml(cfg: Config, comments: typing.Sequence[str] = ()) -> str:
    """The whole config as a TOML file that load_config reads back to an equal Config."""
    lines = [f"# {c}" for c in comments]
    for section, values in cfg.to_dict().items():
        lines += ["", f"[{section}]"] if lines else [f"[{section}]"]
        lines += [f"{k} = {_toml(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def with_changes(cfg: Config, changes: typing.Mapping[str, Any]) -> Config:
    """cfg with "section.key" -> value changes applied, validated like any config."""
    if not changes:
        return cfg
    data = cfg.to_dict()
    for path, value in changes.items():
        section, key = path.split(".", 1)
        data[section][key] = value
    return config_from_dict(data)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)


def _type_name(tp: Any) -> str:
    if isinstance(tp, types.UnionType):
        return " or ".join(_type_name(t) for t in typing.get_args(tp))
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[tp]


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Checks one value against its field's type; ints are accepted where numbers are; a union (an
    integer or a string such as "auto") takes the first of its types the value is."""
    if isinstance(tp, types.UnionType):
        for member in typing.get_args(tp):
            try:
                return _coerce(path, value, member)
            except ConfigError:
                continue
        _fail(f"{path} = {_toml(value) if not isinstance(value, dict) else 'a table'} has the wrong type; "
              f"it must be {_type_name(tp)}")
    ok = (isinstance(value, bool) if tp is bool
          else isinstance(value, int) and not isinstance(value, bool) if tp is int
          else isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float
          else isinstance(value, str))
    if not ok:
        _fail(f"{path} = {_toml(value) if not isinstance(value, dict) else 'a table'} has the wrong type; "
              f"it must be {_type_name(tp)}")
    if tp is float:
        value = float(value)
        if not math.isfinite(value):
            _fail(f"{path} = {value!r} must be a finite number")
    return value


def _build_section(name: str, table: Any) -> Any:
    cls = SECTIONS[name]
    if not isinstance(table, dict):
        _fail(f"[{name}] must be a table, not {_toml(table)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in table:
        if key not in fields:
            _fail(f"unknown key {name}.{key}; [{name}] takes {', '.join(sorted(fields))}")
    return cls(**{k: _coerce(f"{name}.{k}", v, hints[k]) for k, v in table.items()})


def config_from_dict(data: dict[str, Any]) -> Config:
    for name in data:
        if name not in SECTIONS:
            _fail(f"unknown section [{name}]; sections are {', '.join(f'[{s}]' for s in SECTIONS)}")
    run = data.get("run")
    if (isinstance(run, dict) and "name" not in run and isinstance(run.get("dir"), str) and run["dir"].strip()
            and run.get("nodes", 1) == 1):      # several machines share the name (their etcd prefix): as given
        data = {**data, "run": {**run, "name": name_from_dir(run["dir"])}}
    return Config(**{name: _build_section(name, table) for name, table in data.items()})


def name_from_dir(directory: str) -> str:
    """A run of one machine given a directory and no name is named after the directory (its metrics'
    and events' `run` label, its cgroups), not after the config it came from: run.dir = "/data/exp-7"
    is run "exp-7". Characters a name cannot hold become '-'. (A run of several machines keeps the
    name it is given: it is their etcd prefix, the same on every machine whatever its directory.)"""
    base = os.path.basename(os.path.normpath(os.path.abspath(directory)))
    name = "".join(c if c in _NAME_CHARS else "-" for c in base).lstrip(".")
    return name or "run"


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` → (section, key, value); the value is read as TOML, else as a bare string."""
    path, sep, raw = text.partition("=")
    section, dot, key = path.strip().partition(".")
    if not sep or not dot or not section or not key:
        _fail(f"--set {text!r} is malformed; use --set section.key=value (for example --set train.steps=50)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, key, value


def load_config(path: str | os.PathLike[str] | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Loads a TOML file (None = the embedded tiny defaults), applies overrides, validates everything."""
    return config_from_dict(read_config_data(path, overrides))


def read_config_data(path: str | os.PathLike[str] | None = None, overrides: typing.Sequence[str] = ()) -> dict:
    """The TOML file's tables with the overrides applied, not yet validated."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            _fail(f"config file {os.fspath(path)!r} does not exist")
        except IsADirectoryError:
            _fail(f"config file {os.fspath(path)!r} is a directory; pass a .toml file")
        except tomllib.TOMLDecodeError as e:
            _fail(f"config file {os.fspath(path)!r} is not valid TOML: {e}")
        except UnicodeDecodeError:
            _fail(f"config file {os.fspath(path)!r} is not UTF-8 text")
        except OSError as e:                      # permissions, an unreadable device, …
            _fail(f"cannot read config file {os.fspath(path)!r}: {e.strerror or e}")
    for text in overrides:
        section, key, value = parse_override(text)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            _fail(f"[{section}] must be a table, not {_toml(table)}")
        table[key] = value
    return data


# Keys that may change between a checkpoint and its resumption without changing the
# trajectory: batch geometry below global_batch, parallel layout, recompute, fused kernels, device,
# how often things are logged or saved, where files go.
_TRAJECTORY_NEUTRAL = {
    "model": {"init_from"},                 # read only when there is no checkpoint yet
    "data": {"verify_checksums", "prefetch_steps", "validation_path"},     # validation: measured, never trained on
    "train": {"device", "micro_batch", "grad_accum_steps", "recompute", "recompute_num_layers", "compute_threads",
              "fused_kernels", "flash_attention", "log_interval_steps", "steps", "eval_interval_steps", "eval_batches"},
    "parallel": "*", "checkpoint": "*", "health": "*", "run": "*",
    "script": {"python", "cwd"},           # another environment or directory runs the same script
}


def trajectory_dict(cfg: Config) -> dict[str, Any]:
    """The keys that define the training trajectory (with the cosine horizon resolved)."""
    out: dict[str, Any] = {}
    for section, values in cfg.to_dict().items():
        neutral = _TRAJECTORY_NEUTRAL.get(section, set())
        if neutral == "*" or (section == "script" and not values["command"]):   # the engine: hashes as before
            continue
        out[section] = {k: v for k, v in values.items() if k not in neutral}
    out["optim"]["cosine_steps"] = cfg.cosine_steps
    return out


def config_hash(cfg: Config) -> str:
    """sha256 over the trajectory-defining keys; checkpoints record it, resumption compares it."""
    blob = json.dumps(trajectory_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
