"""`llm-pretrain plan`: check a layout's rules, estimate its memory, propose layouts that fit.

Owns: the divisibility rules of dp × tp × pp × sp (each a line a user can act
on), the enumeration of the layouts of N devices, the throughput estimate that
orders them, and the report. Pure: no MindSpore (the dry run, which needs the
Ascend toolkit, is engine/layout/dry_run.py).

The throughput estimate ranks layouts; it does not predict: compute at a fixed
fraction of the device's peak, the pipeline's bubble, and tensor-, data- and
pipeline-parallel traffic at the link's bandwidth, none of it overlapped.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from contracts.config import Config, sp_rows, with_changes
from engine.layout.memory_model import (
    COMPUTE_BYTES,
    GIB,
    Layout,
    Recipe,
    StageMemory,
    estimate,
    layer_param_counts,
    peak,
    total_param_count,
)
from engine.layout.parallel import SEMI_AUTO, mode


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the estimate assumes of a device and its links (Ascend 910B-class by default)."""

    memory_gib: float = 64.0
    peak_tflops: float = 280.0       # bf16/fp16 dense; fp32 at a quarter
    efficiency: float = 0.5          # fraction of peak the matmuls reach
    devices_per_node: int = 8
    intra_node_gbps: float = 100.0   # GB/s of a collective within a node (HCCS)
    inter_node_gbps: float = 25.0    # GB/s between nodes (200 Gb/s RoCE)

    def describe(self) -> str:
        return (f"{self.memory_gib:g} GiB, {self.peak_tflops:g} TFLOPS at {self.efficiency:.0%}, "
                f"{self.devices_per_node} devices per node, {self.intra_node_gbps:g} GB/s within a node, "
                f"{self.inter_node_gbps:g} GB/s between nodes")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# Rules -------------------------------------------------------------------------
def rules(cfg: Config, lay: Layout) -> list[tuple[str, bool]]:
    """Every divisibility rule of the layout, as (what must hold, whether it does)."""
    m, t = cfg.model, cfg.train
    out = [(f"dp x tp x pp = {lay.devices} devices", True)]
    for key in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        value = getattr(m, key)
        out.append((f"model.{key} ({value}) divisible by tp ({lay.tp})", value % lay.tp == 0))
    out.append((f"model.num_layers ({m.num_layers}) divisible by pp ({lay.pp})", m.num_layers % lay.pp == 0))
    per_rank = lay.micro_batch * lay.grad_accum_steps
    out.append((f"train.global_batch ({t.global_batch}) = dp ({lay.dp}) x micro_batch ({lay.micro_batch}) x "
                f"grad_accum_steps ({lay.grad_accum_steps})", per_rank * lay.dp == t.global_batch))
    if lay.pp > 1:
        out.append((f"pipeline_microbatches ({lay.pipeline_microbatches}) >= pp ({lay.pp})",
                    lay.pipeline_microbatches >= lay.pp))
        out.append((f"micro_batch ({lay.micro_batch}) divisible by pipeline_microbatches "
                    f"({lay.pipeline_microbatches})", lay.micro_batch % lay.pipeline_microbatches == 0))
    if lay.sp:
        out.append((f"sp needs tp > 1 (tp = {lay.tp})", lay.tp > 1))
        out.append((f"data.seq_len ({cfg.data.seq_len}) divisible by tp ({lay.tp}) under sp",
                    cfg.data.seq_len % lay.tp == 0))
        rows = sp_rows(lay.micro_batch, lay.pp, lay.pipeline_microbatches)
        out.append((f"one sequence per dp rank per micro-step under sp ({rows})", rows == 1))
    return out


def broken_rules(cfg: Config, lay: Layout) -> list[str]:
    return [text for text, ok in rules(cfg, lay) if not ok]


# Throughput --------------------------------------------------------------------
def step_seconds(cfg: Config, lay: Layout, hw: Hardware) -> float:
    """Estimated seconds per optimizer step of the whole run under `lay`."""
    m, seq = cfg.model, cfg.data.seq_len
    c = COMPUTE_BYTES[cfg.train.precision]
    split, replicated = layer_param_counts(m)
    layer_fwd = 2 * (split + replicated) * seq + 4 * seq * seq * m.hidden_size     # per sequence
    head_fwd = 2 * m.vocab_size * m.hidden_size * seq
    recomputed = min(lay.recompute_layers, m.num_layers)
    flops = (3 * (m.num_layers * layer_fwd + head_fwd) + recomputed * layer_fwd) * cfg.train.global_batch
    tflops = hw.peak_tflops * (1.0 if c == 2 else 0.25) * hw.efficiency
    compute = flops / (lay.devices * tflops * 1e12)
    if lay.pp > 1:
        compute *= 1 + (lay.pp - 1) / lay.pipeline_microbatches
    seconds = compute
    batch = lay.micro_batch // lay.pipeline_microbatches if lay.pp > 1 else lay.micro_batch
    flushes = lay.grad_accum_steps * (lay.pipeline_microbatches if lay.pp > 1 else 1)
    group_bw = lambda size: (hw.intra_node_gbps if size <= hw.devices_per_node else hw.inter_node_gbps) * 1e9
    if lay.tp > 1:
        per_layer = (4 + (2 if lay.recompute_layers else 0)) * c * seq * batch * m.hidden_size
        ring = 2 * (lay.tp - 1) / lay.tp
        seconds += flushes * (m.num_layers // lay.pp) * per_layer * ring / group_bw(lay.tp)
    if lay.dp > 1:
        grads = Recipe.of(cfg).param_bytes * total_param_count(m) / (lay.tp * lay.pp)
        seconds += grads * 2 * (lay.dp - 1) / lay.dp / group_bw(lay.dp * lay.tp)
    if lay.pp > 1:
        hop = 2 * c * seq * batch * m.hidden_size // (lay.tp if lay.sp else 1)
        seconds += flushes * (lay.pp - 1) * hop / group_bw(lay.devices)
    return seconds


def tokens_per_second(cfg: Config, lay: Layout, hw: Hardware) -> float:
    return cfg.train.global_batch * cfg.data.seq_len / step_seconds(cfg, lay, hw)


# Enumeration ---------------------------------------------------------------------
def layouts(cfg: Config, devices: int, hw: Hardware) -> Iterator[Layout]:
    """Every layout of `devices` that keeps the config's global batch and obeys every rule:
    tp within a node, recompute off or full, sp and optimizer sharding on or off."""
    m, gb = cfg.model, cfg.train.global_batch
    for tp in _divisors(devices):
        if tp > hw.devices_per_node:
            continue
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            if gb % dp:
                continue
            for micro in _divisors(gb // dp):
                accum = gb // dp // micro
                pipes = [1] if pp == 1 else sorted({n for n in (micro, micro // 2) if n >= pp and micro % n == 0})
                for pipe in pipes:
                    for recompute in (0, m.num_layers):
                        for sp in ((False, True) if tp > 1 else (False,)):
                            for shard in ((False, True) if dp > 1 else (False,)):
                                lay = Layout(dp=dp, tp=tp, pp=pp, sp=sp, optimizer_shard=shard, micro_batch=micro,
                                             pipeline_microbatches=pipe, grad_accum_steps=accum,
                                             recompute_layers=recompute)
                                if not broken_rules(cfg, lay):
                                    yield lay


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: StageMemory           # the stage that needs the most
    tokens_per_s: float


def propose(cfg: Config, devices: int, hw: Hardware, *, limit: int = 10) -> list[Candidate]:
    """The layouts that fit in the device's memory, best throughput estimate first (ties: less memory);
    of the variants of one dp x tp x pp, only the best."""
    capacity = hw.memory_gib * GIB
    best: dict[tuple[int, int, int], Candidate] = {}
    rank = lambda c: (-c.tokens_per_s, c.memory.total)
    for lay in layouts(cfg, devices, hw):
        worst = peak(estimate(cfg, lay, runtime=True))
        if worst.total > capacity:
            continue
        cand = Candidate(lay, worst, tokens_per_second(cfg, lay, hw))
        key = (lay.dp, lay.tp, lay.pp)
        if key not in best or rank(cand) < rank(best[key]):
            best[key] = cand
    return sorted(best.values(), key=rank)[:limit]


def config_with(cfg: Config, lay: Layout) -> Config:
    """The config with a proposed layout applied (so a user can copy its [parallel] and [train] keys)."""
    return with_changes(cfg, {
        "parallel.dp": lay.dp, "parallel.tp": lay.tp, "parallel.pp": lay.pp, "parallel.sp": lay.sp,
        "parallel.optimizer_shard": lay.optimizer_shard, "parallel.pipeline_microbatches": lay.pipeline_microbatches,
        "train.micro_batch": lay.micro_batch, "train.grad_accum_steps": lay.grad_accum_steps,
        "train.recompute": lay.recompute_layers > 0, "train.recompute_num_layers": 0})


# The report ------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / GIB:8.2f}"


def memory_table(stages: list[StageMemory]) -> list[str]:
    head = f"{'GiB per device':<16}" + "".join(f"{'stage ' + str(s.stage):>10}" for s in stages)
    lines = [head]
    for part in StageMemory.PARTS:
        lines.append(f"{part:<16}" + "".join(f"{_gib(getattr(s, part)):>10}" for s in stages))
    lines.append(f"{'total':<16}" + "".join(f"{_gib(s.total):>10}" for s in stages))
    return lines


def report(cfg: Config, devices: int, hw: Hardware, *, layout: Layout | None = None,
           limit: int = 10) -> tuple[list[str], str]:
    """The lines `plan` prints, and why the config's own layout (`layout`, default the config's) cannot
    run on these devices ("" if it obeys every rule and fits)."""
    lay = layout or Layout.of(cfg)
    n = total_param_count(cfg.model)
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    lines = [f"model: {size} parameters, {cfg.model.num_layers} layers, seq_len {cfg.data.seq_len}, "
             f"global batch {cfg.train.global_batch}, {cfg.train.precision}",
             f"assumed device (Ascend): {hw.describe()}", ""]
    verdict = ""
    if lay.devices != devices:
        verdict = f"its layout ({lay.describe()}) uses {lay.devices} devices, not {devices}"
        lines.append(f"the config's layout {verdict.removeprefix('its layout ')}")
    else:
        broken = broken_rules(cfg, lay)
        lines.append(f"the config's layout: {lay.describe()}, micro_batch {lay.micro_batch}, "
                     f"grad_accum_steps {lay.grad_accum_steps}, recompute {lay.recompute_layers} layers")
        lines += [f"  {'ok  ' if ok else 'FAIL'} {text}" for text, ok in rules(cfg, lay)]
        if broken:
            verdict = f"a rule is broken: {broken[0]}"
        else:
            stages = estimate(cfg, lay, runtime=True)
            worst = peak(stages)
            fits = worst.total <= hw.memory_gib * GIB
            lines += ["", *memory_table(stages), "",
                      f"  {'fits' if fits else 'DOES NOT FIT'}: {worst.total / GIB:.1f} of {hw.memory_gib:g} GiB "
                      f"on stage {worst.stage}; about {tokens_per_second(cfg, lay, hw):,.0f} tokens/s"]
            per_rank = max(s.params + s.optimizer for s in stages)
            ranks = min(devices, hw.devices_per_node)
            held = "slices" if mode(config_with(cfg, lay)) == SEMI_AUTO else "copy"
            lines.append(f"  host memory to initialise: {per_rank / GIB:.1f} GiB per rank, "
                         f"{ranks * per_rank / GIB:.1f} per machine of {ranks} (each rank's {held} of the "
                         f"{Recipe.of(cfg).param_dtype} weights and both moments; MindSpore's own per process not "
                         "counted)")
            if not fits:
                verdict = (f"it needs about {worst.total / GIB:.1f} GiB per device (stage {worst.stage}), more than "
                           f"{hw.memory_gib:g} GiB")
    lines += ["", f"layouts of {devices} devices that fit, best estimated throughput first:"]
    found = propose(cfg, devices, hw, limit=limit)
    if not found:
        lines.append("  none: more devices, a shorter sequence or a smaller global batch")
    for c in found:
        lay = c.layout
        pipe = str(lay.pipeline_microbatches) if lay.pp > 1 else "-"
        lines.append(f"  {lay.describe():<26} micro_batch {lay.micro_batch:<4} accum {lay.grad_accum_steps:<4} "
                     f"pipeline_microbatches {pipe:<4} recompute {'full' if lay.recompute_layers else 'off':<4} "
                     f"{c.memory.total / GIB:6.1f} GiB {c.tokens_per_s:>9,.0f} tokens/s")
    return lines, verdict


# Reading the config to plan ------------------------------------------------------------
_NEUTRAL = {"dp": 1, "tp": 1, "pp": 1, "pipeline_microbatches": 1, "sp": False, "optimizer_shard": False,
            "device_memory_gib": 1e6}


def check_fits(cfg: Config) -> Config:
    """The config, if its layout fits the device memory; an Ascend layout the memory estimate says
    cannot fit is refused (ConfigError) before any cluster time, and so is a config that only describes
    another framework's recipe for `plan` (`parallel.plan_recipe`). The command line calls it after the
    schema's own checks: fitting is the planner's judgement, not the schema's."""
    from contracts.errors import ConfigError

    if cfg.parallel.plan_recipe != "project":
        raise ConfigError(f'parallel.plan_recipe = "{cfg.parallel.plan_recipe}" is for `llm-pretrain plan` only (it '
                          "counts another framework's recipe); this project's step trains fp32 weights: remove it "
                          "to run")
    if cfg.train.device != "ascend":
        return cfg
    worst = peak(estimate(cfg))
    have = cfg.parallel.device_memory_gib * GIB
    if worst.total > have:
        raise ConfigError(f"this layout needs about {worst.total / GIB:.1f} GiB per device (pipeline stage "
                          f"{worst.stage}) but parallel.device_memory_gib = {cfg.parallel.device_memory_gib:g}; "
                          "`llm-pretrain plan --config FILE --devices N` lists layouts that fit")
    return cfg


def planned(path: str | None, overrides: list[str]) -> tuple[Config, Layout, str]:
    """The config to plan, the layout it asks for, and why it would not load as it is ("" if it would).

    A layout that breaks a rule or does not fit is what `plan` is for, so the config is read with a
    one-device layout (the model, data and precision are validated as usual) and the requested
    layout is taken from its tables."""
    from contracts.config import config_from_dict, read_config_data
    from contracts.errors import ConfigError

    data = read_config_data(path, overrides)
    try:
        cfg = config_from_dict(data)
        return cfg, Layout.of(cfg), ""
    except ConfigError as e:
        problem = str(e)
    par, train = dict(data.get("parallel") or {}), dict(data.get("train") or {})
    neutral = {**data, "parallel": {**par, **_NEUTRAL},
               "train": {**train, "micro_batch": train.get("global_batch", 8), "grad_accum_steps": 1}}
    cfg = config_from_dict(neutral)          # a ConfigError here is the model's or the data's: reported as is
    lay = Layout(dp=int(par.get("dp", 1)), tp=int(par.get("tp", 1)), pp=int(par.get("pp", 1)),
                 sp=bool(par.get("sp", False)), optimizer_shard=bool(par.get("optimizer_shard", False)),
                 micro_batch=int(train.get("micro_batch", cfg.train.global_batch)),
                 pipeline_microbatches=int(par.get("pipeline_microbatches", 1)),
                 grad_accum_steps=int(train.get("grad_accum_steps", 1)), recompute_layers=cfg.recompute_layers)
    return cfg, lay, problem
