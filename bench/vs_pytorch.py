"""Step time and peak memory of this project's step against PyTorch and plain MindSpore, same model.

Three implementations of one LLaMA shape, each in its own process, interleaved
(A B C A B C …), with the same batch geometry, fp32, and every core of the machine:

- `project`: this project's compiled step (engine.rank.trainer.Trainer: loss scaling,
  finite check, global-norm clipping, AdamW, the events' host values), fed by its
  own input pipeline;
- `project-avx512` (on a CPU with AVX-512 only): the same, its fused kernels built for AVX-512
  (`LLM_PRETRAIN_KERNEL_ISA=avx512`; the default builds them for AVX2): what 16 lanes change, side by side;
- `mindspore`: the same network (engine.model.causal_lm.CausalLM) built from MindSpore's stock
  ops (`train.fused_kernels = false`: no C++ kernels of this project's) under
  `nn.TrainOneStepCell` and `nn.AdamWeightDecay`, random token batches;
- `torch`: Hugging Face's `LlamaForCausalLM` (transformers, SDPA attention) with
  `torch.optim.AdamW` and `clip_grad_norm_`, eager, the same shapes and batches;
- `torch.compile`: the same model under `torch.compile` (inductor; its compile is in the warm-up).

Reported per implementation, the median over rounds with the range: wall-clock tokens/s
after warm-up (the timed steps' tokens over their wall time, between-step work included:
what a run delivers, not the step alone), the cores busy while stepping (CPU seconds / wall
seconds), and the process's peak RSS (which includes compilation). `--recompute` adds small-20m with activation
recompute (MindSpore's per-layer recompute; Hugging Face's gradient checkpointing).
Prints a table with the ratios and writes bench/results/vs_pytorch.json.
Needs torch and transformers (the `interop` extra); without them the torch
column is left out, saying so.

    python bench/vs_pytorch.py [--rounds N] [--only tiny|small-20m] [--recompute]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import results_file  # bench/results_file.py: the one writer of bench/results

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # config, warm-up steps, timed steps, rounds by default
    "tiny": ("configs/tiny.toml", 20, 100, 5),
    "small-20m": ("configs/small-20m.toml", 3, 8, 5),
}
IMPLS = ("project", "project-avx512", "mindspore", "torch", "torch.compile")


def _config(config: str, steps: int, recompute: bool):
    sys.path.insert(0, str(ROOT))
    from contracts.config import load_config

    sets = [f"train.steps={steps}", "train.grad_accum_steps=1", "checkpoint.interval_steps=0"]
    if recompute:
        sets.append("train.recompute=true")
    cfg = load_config(ROOT / config, sets)
    return cfg


def _batches(cfg, count: int):
    import numpy as np

    rng = np.random.default_rng(cfg.train.seed)
    shape = (cfg.train.global_batch, cfg.data.seq_len + 1)
    return [rng.integers(0, cfg.model.vocab_size, size=shape, dtype=np.int32) for _ in range(count)]


def _timed(step, warmup: int, steps: int) -> dict:
    started = time.perf_counter()
    step()
    first_s = time.perf_counter() - started
    for _ in range(warmup - 1):
        step()
    times = []
    cpu0, wall0 = os.times(), time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    cpu1, wall1 = os.times(), time.perf_counter()
    busy = ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / (wall1 - wall0)
    return {"first_step_s": first_s, "median_step_s": statistics.median(times), "cores_busy": busy,
            "timed_wall_s": wall1 - wall0, "timed_steps": steps}


def run_project(cfg, warmup: int, steps: int) -> dict:
    from engine.rank import runtime
    from engine.rank.trainer import Trainer

    trainer = Trainer(cfg, runtime.setup(cfg))
    return _timed(trainer.train_step, warmup, steps)


def run_mindspore(cfg, warmup: int, steps: int) -> dict:
    import mindspore as ms
    from mindspore import Tensor, nn

    from contracts.config import with_changes
    from engine.model.causal_lm import build_model
    from engine.rank import runtime

    cfg = with_changes(cfg, {"train.fused_kernels": False})
    net = build_model(cfg, runtime.setup(cfg).parallelism)
    o = cfg.optim
    optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=o.lr, beta1=o.beta1, beta2=o.beta2,
                                   eps=o.eps, weight_decay=o.weight_decay)
    train = nn.TrainOneStepCell(net, optimizer)
    batches = [(Tensor(b[:, :-1]), Tensor(b[:, 1:])) for b in _batches(cfg, 4)]
    at = iter(range(10 ** 9))

    def step():
        tokens, targets = batches[next(at) % len(batches)]
        float(train(tokens, targets).asnumpy())

    ms.set_seed(cfg.train.seed)
    return _timed(step, warmup, steps)


def run_torch(cfg, warmup: int, steps: int, compiled: bool = False) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.interop.hf import hf_config

    torch.manual_seed(cfg.train.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    hf = {k: v for k, v in hf_config(cfg.model).items() if k not in ("architectures", "torch_dtype")}
    model = LlamaForCausalLM._from_config(LlamaConfig(**{**hf, "use_cache": False}), attn_implementation="sdpa")
    if cfg.train.recompute:
        model.gradient_checkpointing_enable()
    model.train()
    forward = torch.compile(model) if compiled else model
    o = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay)
    batches = [torch.from_numpy(b.astype("int64")) for b in _batches(cfg, 4)]
    at = iter(range(10 ** 9))
    vocab = cfg.model.vocab_size

    def step():
        b = batches[next(at) % len(batches)]
        logits = forward(input_ids=b[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, vocab), b[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        float(loss.detach())

    return _timed(step, warmup, steps)


def child(impl: str, config: str, warmup: int, steps: int, recompute: bool) -> dict:
    cfg = _config(config, warmup + steps + 1, recompute)
    if impl == "project-avx512":          # the same step, its fused kernels built for AVX-512 (the A/B)
        os.environ["LLM_PRETRAIN_KERNEL_ISA"] = "avx512"
    run = {"project": run_project, "project-avx512": run_project, "mindspore": run_mindspore, "torch": run_torch,
           "torch.compile": lambda *a: run_torch(*a, compiled=True)}[impl]
    out = run(cfg, warmup, steps)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    out.update(impl=impl, tokens_per_step=tokens, tokens_per_s=tokens * out["timed_steps"] / out["timed_wall_s"],
               step_tokens_per_s=tokens / out["median_step_s"],
               peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    return out


def _spawn(impl: str, config: str, warmup: int, steps: int, recompute: bool) -> dict:
    argv = [sys.executable, __file__, "--child", impl, "--config", config, "--warmup", str(warmup),
            "--steps", str(steps)] + (["--recompute"] if recompute else [])
    done = subprocess.run(argv, cwd=ROOT, env=dict(os.environ, GLOG_v="3"), capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{impl} on {config} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="rounds per case (default: 5)")
    parser.add_argument("--only", choices=sorted(CASES))
    parser.add_argument("--recompute", action="store_true", help="also small-20m with activation recompute")
    parser.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.config, args.warmup, args.steps, args.recompute)))
        return
    impls = IMPLS if _torch_available() else IMPLS[:3]
    if len(impls) < len(IMPLS):
        print("torch or transformers is not installed (pip install -e '.[interop]'): no PyTorch column")
    sys.path.insert(0, str(ROOT))
    from engine.model.fused_cpu import isa_flags

    if isa_flags(widest=True) != ("-mavx512f",):     # no AVX-512 here: nothing to compare
        impls = tuple(i for i in impls if i != "project-avx512")
    cases = [(name, *CASES[name], False) for name in CASES if not args.only or name == args.only]
    if args.recompute and args.only in (None, "small-20m"):
        cases.append(("small-20m recompute", *CASES["small-20m"], True))
    results = {}
    for name, config, warmup, steps, rounds, recompute in cases:
        runs = {impl: [] for impl in impls}
        for _ in range(args.rounds or rounds):
            for impl in impls:
                runs[impl].append(_spawn(impl, config, warmup, steps, recompute))
        summary = {impl: {key: statistics.median(r[key] for r in rs)
                          for key in ("tokens_per_s", "step_tokens_per_s", "median_step_s", "peak_rss_gb",
                                      "cores_busy", "first_step_s")}
                   for impl, rs in runs.items()}
        for impl, rs in runs.items():
            summary[impl]["tokens_per_s_range"] = [min(r["tokens_per_s"] for r in rs), max(r["tokens_per_s"] for r in rs)]
            summary[impl]["rounds"] = len(rs)
        results[name] = {"config": config, "recompute": recompute, "summary": summary, "runs": runs}
    _print(results)
    payload = {"results": results}
    results_file.write("vs_pytorch", payload)


def _print(results: dict) -> None:
    print(f"{'case':<20} {'impl':<14} {'tokens/s (wall, range)':>26} {'step s':>8} {'cores':>6} {'peak RSS GB':>12} "
          f"{'vs torch':>9} {'vs compile':>11} {'RSS vs torch':>13}")
    for name, r in results.items():
        s = r["summary"]
        ref, compiled = s.get("torch"), s.get("torch.compile")
        for impl, m in s.items():
            speed = f"{m['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
            versus = f"{m['tokens_per_s'] / compiled['tokens_per_s']:.2f}x" if compiled else "-"
            rss = f"{m['peak_rss_gb'] / ref['peak_rss_gb']:.2f}x" if ref else "-"
            lo, hi = m["tokens_per_s_range"]
            print(f"{name:<20} {impl:<14} {m['tokens_per_s']:>9,.0f} ({lo:>6,.0f}-{hi:>6,.0f}) {m['median_step_s']:>8.3f} "
                  f"{m['cores_busy']:>6.2f} {m['peak_rss_gb']:>12.2f} {speed:>9} {versus:>11} {rss:>13}")
        p, plain = s["project"], s["mindspore"]
        print(f"{'':<20} project / plain MindSpore: {p['tokens_per_s'] / plain['tokens_per_s']:.2f}x tokens/s, "
              f"{p['peak_rss_gb'] / plain['peak_rss_gb']:.2f}x peak RSS")


if __name__ == "__main__":
    main()
