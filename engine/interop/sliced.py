"""`llm-pretrain export --format mindspore-sliced`: a semi-auto run's sliced checkpoint in the layout
MindSpore's `transform_checkpoints` reads, so it can be resumed onto another dp × tp × pp layout.

Owns: splitting our one checkpoint of `rank<r>/<name>` tensors (engine/rank/checkpoint.py) into
`rank_<r>/checkpoint_<r>.ckpt` per rank (MindSpore's own checkpoint format, the parameter names
the compiled step used, optimizer moments included), and the run's strategy files beside them
(`strategy/rank_<r>.ckpt`, which each rank's compile wrote; with pp > 1 also merged into
`merged_strategy.ckpt` by MindSpore's merge_pipeline_strategys, which transform_checkpoints needs).
The command it prints then transforms them onto the strategy of the layout to resume on.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from checkpointing import CheckpointError, reader
from engine.interop import hf

_RANKED = re.compile(r"^rank(\d+)/(.+)$")


def rank_tensors(checkpoint: Path) -> tuple[dict[str, Any], dict[int, dict[str, np.ndarray]]]:
    """(the saved parallel layout, {rank: {parameter name: its slice}}) of a verified sliced checkpoint."""
    hf.verify_for_export(checkpoint)
    manifest = reader.read_manifest(checkpoint)
    saved = manifest["run_state"].get("parallel_layout") or {}
    if not saved.get("sliced"):
        raise CheckpointError(f"{checkpoint} holds whole tensors (data parallel): it resumes onto any layout as "
                              "it is; --format mindspore-sliced is for semi-auto runs' sliced checkpoints")
    ranks: dict[int, dict[str, np.ndarray]] = {}
    for key, value in reader.load_tensors(checkpoint, manifest).items():
        if m := _RANKED.match(key):
            ranks.setdefault(int(m[1]), {})[m[2]] = value
    return saved, ranks


def export(checkpoint: Path, out: Path, *, overwrite: bool = False) -> dict[str, Any]:
    import mindspore as ms

    hf.check_output(out, overwrite)
    saved, ranks = rank_tensors(checkpoint)
    pipelined = int(saved.get("pp", 1)) > 1
    strategies = Path(checkpoint).resolve().parent.parent / "strategy"
    with hf.output_directory(out, overwrite=overwrite) as tmp:
        for rank, tensors in sorted(ranks.items()):
            folder = tmp / f"rank_{rank}"
            folder.mkdir()
            ms.save_checkpoint([{"name": n, "data": ms.Tensor(v)} for n, v in sorted(tensors.items())],
                               str(folder / f"checkpoint_{rank}.ckpt"))
        files = sorted(strategies.glob("rank_*.ckpt")) if strategies.is_dir() else []
        if files:
            (tmp / "strategy").mkdir()
            for f in files:
                shutil.copy2(f, tmp / "strategy" / f.name)
            if pipelined:
                from mindspore.parallel import merge_pipeline_strategys

                merge_pipeline_strategys(str(tmp / "strategy"), str(tmp / "merged_strategy.ckpt"))
    strategy = (out / ("merged_strategy.ckpt" if pipelined else "strategy/rank_0.ckpt")) if files else None
    return {"tensors": sum(len(t) for t in ranks.values()), "ranks": len(ranks),
            "parameters": int(sum(np.prod(v.shape) for t in ranks.values() for v in t.values())),
            "strategy": str(strategy) if strategy else None,
            "note": None if files else f"no strategy files under {strategies}: transform_checkpoints needs the "
                                       "ones the run's compile wrote there"}


def transform_command(out: Path, strategy: str | None) -> str:
    """What to run next: MindSpore's transform onto the strategy of the layout to resume on."""
    return ("python -c \"import mindspore as ms; ms.parallel.transform_checkpoints("
            f"'{out}', 'TRANSFORMED', 'checkpoint_', '{strategy or 'SRC_STRATEGY'}', 'DST_STRATEGY')\"")
