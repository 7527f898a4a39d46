"""The script's state in this project's checkpoint format (checkpointing/): the parameters it names (the
network's and the optimizer's — moments, step count, a loss scale kept as a Parameter) and the client's run
state (step, data position, skip ranges, lr overrides), so the daemon's retention, rollback and verification
treat them as the engine's. Every rank holds a full replica (data parallel): each writes a size-balanced share
(checkpointing.partition) and loads every tensor back. The RAM tier (checkpoint.memory_interval_steps) the same,
on its tmpfs, in a writer process of its own."""
from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from checkpointing import CheckpointError, checksums, layout, partition, reader
from checkpointing.writer import ShardWriter
from checkpointing.writer_process import ProcessShardWriter
from contracts.config import Config
from contracts.protocol import CheckpointEvent

FORMAT = "llm_pretrain_client"
MEMORY_KEEP = 2          # RAM checkpoints kept: the newest, and the one before while the next is written


class ScriptCheckpoints:
    def __init__(self, cfg: Config, *, rank: int, world: int, generation: int, emit: Callable[[Any], None]):
        self.cfg, self.rank, self.world, self.generation = cfg, rank, world, generation
        self._emit_event = emit
        run_dir = Path(cfg.run.dir)
        self.root = run_dir / "checkpoints"
        self.memory_root = (layout.memory_root(run_dir, cfg.checkpoint.memory_dir)
                            if cfg.checkpoint.memory_interval_steps else None)
        self.writer = ShardWriter(self.root, rank=rank, world=world, emit=self._emit, checksum=cfg.checkpoint.checksum)
        self.memory_writer = None
        self.params: list = []
        self.plan: dict[str, int] = {}
        self._buffers: dict[bool, tuple[dict, list]] = {}

    def _emit(self, stage: str, *, step: int, seconds: float = 0.0, error: str = "", steps=(), detail: str = ""):
        self._emit_event(CheckpointEvent(rank=self.rank, generation=self.generation, step=step, stage=stage,
                                         seconds=seconds, detail=detail or error))

    def _emit_memory(self, stage: str, *, step: int, seconds: float = 0.0, error: str = "", steps=(), detail=""):
        if stage in ("committed", "failed"):
            self._emit("in_memory" if stage == "committed" else "in_memory_failed", step=step, seconds=seconds,
                       error=error, detail=detail or (str(self.memory_root) if stage == "committed" else ""))

    def attach(self, params: Sequence) -> None:
        """The MindSpore Parameters saved and restored (names unique, as MindSpore makes a cell's)."""
        from llm_pretrain_client.lr_multiplier import NAME

        unique = {id(p): p for p in params if p.name != NAME}       # a Parameter listed twice is one
        self.params = list(unique.values())
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"parameters to checkpoint must have unique names; repeated: {', '.join(dup[:3])}")
        sizes = {p.name: int(np.prod(p.shape)) * np.dtype(p.asnumpy().dtype).itemsize for p in self.params}
        self.plan = partition.assign(sizes, self.world)

    # Saving --------------------------------------------------------------------------------------
    def save(self, run_state: dict[str, Any], *, memory: bool = False) -> None:
        """Copies this rank's share to host memory (the blocking part) and hands it to the writer."""
        step = run_state["step"]
        if memory and self.memory_writer is None:
            self.memory_writer = ProcessShardWriter(self.memory_root, rank=self.rank, world=self.world,
                                                    emit=self._emit_memory, keep_last=MEMORY_KEEP,
                                                    indent_manifest=False, checksum=checksums.CRC32C,
                                                    recycle=True, latest_hint=False)
        writer = self.memory_writer if memory else self.writer
        writer.ready(step)
        started = time.monotonic()
        if memory not in self._buffers:
            owned = [p for p in self.params if self.plan[p.name] == self.rank]
            buffers = writer.staging({p.name: p.asnumpy() for p in owned})
            self._buffers[memory] = (buffers, [(p, buffers[p.name]) for p in owned])
        mine, copies = self._buffers[memory]
        for p, buffer in copies:
            np.copyto(buffer, p.asnumpy())
        state = {"format": FORMAT, **run_state, "dp_world_size": self.world} if self.rank == 0 else None
        writer.save(step, mine, run_state=state, versions=_versions())
        if not memory:
            self._emit("staged", step=step, seconds=time.monotonic() - started)

    def poll(self) -> None:
        if self.memory_writer is not None:
            self.memory_writer.poll()

    def wait(self) -> bool:
        if self.memory_writer is not None:
            self.memory_writer.wait()
        self.writer.wait()
        return self.writer.last_error is None

    def close(self) -> None:
        if self.memory_writer is not None:
            self.memory_writer.close()

    # Restoring -------------------------------------------------------------------------------------
    def restore(self) -> dict[str, Any] | None:
        """Loads the newest verified checkpoint of this client's format (either tier) into the parameters;
        returns its run state, or None when there is none."""
        if self.rank == 0:
            for name in layout.remove_temporaries(self.root) if self.root.is_dir() else []:
                self._emit("removed", step=layout.parse_step(name.removesuffix(".tmp")) or 0,
                           detail=f"removed {name}, left by an interrupted save")

        def corrupt(path: Path, problems: list[str]) -> None:
            self._emit("corrupt", step=layout.parse_step(path.name) or 0, detail="; ".join(problems))

        started = time.monotonic()
        found = reader.find_newest(self.root, self.memory_root, on_corrupt=corrupt,
                                   accept=lambda m: m["run_state"].get("format") == FORMAT)
        if found is None:
            return None
        path, manifest = found
        tensors = reader.load_tensors(path, manifest)
        missing = [p.name for p in self.params if p.name not in tensors]
        if missing:
            raise CheckpointError(f"{path} lacks {len(missing)} parameter(s) the script names, e.g. "
                                  f"{', '.join(missing[:3])}: was it saved by another model?")
        for p in self.params:
            if tuple(tensors[p.name].shape) != tuple(p.shape):
                raise CheckpointError(f"{path}: {p.name!r} has shape {tuple(tensors[p.name].shape)}, the script's "
                                      f"parameter {tuple(p.shape)}")
        import mindspore as ms

        for p in self.params:
            p.set_data(ms.Tensor(tensors[p.name]))
        state = manifest["run_state"]
        self._emit("restored", step=state["step"], seconds=time.monotonic() - started, detail=str(path))
        return state


def _versions() -> dict[str, str]:
    import mindspore as ms

    return {"llm_pretrain_client": "0.1.0", "mindspore": ms.__version__, "numpy": np.__version__,
            "python": platform.python_version()}
