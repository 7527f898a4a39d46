"""The client under MindFormers' Trainer (docs/bring-your-own-script.md#mindformers): a callback MindFormers builds by
type from its YAML, and the one call a launcher makes on its config before the Trainer, so the data resumes where
the run's checkpoint left it.

    callbacks:
      - type: MFLossMonitor
      - type: LlmPretrainSupervisor          # registered by importing this module

    import llm_pretrain_client.mindformers as supervised      # registers the callback
    config = MindFormerConfig("train.yaml")
    supervised.prepare(config)          # data_skip_steps: the resumed step; MindFormers' own resume off
    Trainer(args=config, ...).train()

At `on_train_begin` — after MindSpore built the dataset's iterator, before the first step — the callback loads the
run's newest checkpoint (this project's format, the client's store) into the training cell's parameters: the
network's, the optimizer's (moments, step count), the loss scale. MindFormers' MFTrainOneStepCell returns
(loss, overflow, loss scale, lr, global norm[, local norm, size]); each step is reported from them. MindFormers'
dataset has no way to step over a window in the middle of the run, so the callback never claims "skip_data" (a
rollback then trains the window again with the lr cut); it claims "data_position" only when `prepare` set
data_skip_steps to the step it restored.

Imports MindFormers inside functions only (llm_pretrain_client installs without it); importing this module
registers the callback when MindFormers is importable.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Any, Mapping, Sequence

from llm_pretrain_client import settings

NAME = "LlmPretrainSupervisor"
MF_OUTPUTS = ("loss", "overflow", "loss_scale", "lr", "grad_norm")   # MFTrainOneStepCell's first five outputs


def resume_step(env: Mapping[str, str] | None = None) -> int:
    """The step the run resumes after: that of the checkpoint `Client.restore` will load (the newest verified one of
    the client's format, either tier); 0 outside the daemon or before the first checkpoint."""
    from checkpointing import layout, reader
    from llm_pretrain_client.store import FORMAT

    s = settings.from_env(os.environ if env is None else env)
    if not s.supervised:
        return 0
    cfg = s.config
    memory = (layout.memory_root(s.run_dir, cfg.checkpoint.memory_dir) if cfg.checkpoint.memory_interval_steps
              else None)
    found = reader.find_newest(s.run_dir / "checkpoints", memory,
                               accept=lambda m: m["run_state"].get("format") == FORMAT)
    return 0 if found is None else int(found[1]["run_state"]["step"])


def prepare(config: Any, env: Mapping[str, str] | None = None) -> int:
    """Sets a MindFormers config (a MindFormerConfig or a dict, before the Trainer is built from it) for a
    supervised run; returns the step it resumes after. The dataset skips the steps the checkpoint already trained
    (data_skip_steps, ignore_data_skip off); MindFormers' own resume is off (resume_training false, its optimizer
    state never loaded: checkpoint.no_load_optim); on a resume its load_checkpoint / checkpoint.load_path are
    cleared (the callback restores everything), on a first start they stay (pretrained weights to start from).
    The callback entry is added if the YAML lacks it, and told the step: it checks its restore against it and
    claims the data position."""
    step = resume_step(env)
    config["data_skip_steps"] = step
    config["ignore_data_skip"] = False
    config["resume_training"] = False
    checkpoint = config.get("checkpoint")
    if checkpoint is None:                       # MindFormers 1.9.0's trainer reads checkpoint.load_path
        checkpoint = {"load_path": ""} if type(config) is dict else type(config)(load_path="")
        config["checkpoint"] = checkpoint
    checkpoint["no_load_optim"] = True
    if step:
        config["load_checkpoint"] = ""
        checkpoint["load_path"] = ""
    callbacks = config.get("callbacks") or []
    entry = next((c for c in callbacks if c.get("type") == NAME), None)
    if entry is None:
        entry = {"type": NAME} if type(config) is dict else type(config)(type=NAME)
        callbacks.append(entry)
    entry["data_skip_steps"] = step
    config["callbacks"] = callbacks
    return step


def mindformers_fields(outputs: Any, names: Sequence[str] | None = None) -> dict:
    """A step's outputs by name: MFTrainOneStepCell's tuple (5 or 7 values), TrainOneStepWithLossScaleCell's
    (loss, overflow, loss scale), a bare loss, or the names given. A None (MindFormers' global norm without
    use_clip_grad) is left out."""
    if not isinstance(outputs, (tuple, list)):
        return {"loss": outputs}
    if names is None:
        names = MF_OUTPUTS if len(outputs) >= len(MF_OUTPUTS) else ("loss", "overflow", "loss_scale")[:len(outputs)]
    return {n: v for n, v in zip(names, outputs) if v is not None}


@functools.cache
def supervisor_class() -> type:
    """LlmPretrainSupervisor, made on first use: the module imports without MindSpore (its pure parts)."""
    from llm_pretrain_client.callback import Supervisor
    from llm_pretrain_client.client import Client

    class LlmPretrainSupervisor(Supervisor):
        """The Supervisor (llm_pretrain_client.callback) that MindFormers builds from a YAML entry: it makes its own
        Client and restores into the training cell at train begin. Its YAML keys: `global_batch`, `seq_len` (default:
        the daemon's config), `outputs` (the step's output names, default MindFormers'), `data_skip_steps` (set by
        `prepare`)."""

        def __init__(self, global_batch: int | None = None, seq_len: int | None = None,
                     outputs: Sequence[str] | None = None, data_skip_steps: int | None = None, **_ignored):
            super().__init__(Client(global_batch=global_batch, seq_len=seq_len), outputs=outputs)
            self.data_skip_steps = data_skip_steps

        def _fields(self, outputs) -> dict:
            return mindformers_fields(outputs, self.outputs)

        def on_train_begin(self, run_context):
            super().on_train_begin(run_context)          # the loss-scale Parameter of a loss-scale cell
            cb = run_context.original_args()
            network = cb.train_network
            client = self.client
            if not self.outputs and hasattr(network, "use_clip_grad"):       # MFTrainOneStepCell: lr always, norm if
                client._claims["lr"] = True                                  # it clips
                client._claims["grad_norm"] = bool(network.use_clip_grad)
            step = client.restore(network.get_parameters(), loss_scale=client.loss_scale_param)
            if client.skips:
                print(f"llm_pretrain_client: MindFormers' dataset cannot skip {client.skips}: trained again",
                      file=sys.stderr)
                client.skips = []
            if self.data_skip_steps is not None and client.supervised:
                if int(self.data_skip_steps) != step:
                    raise RuntimeError(f"the dataset was set to skip {self.data_skip_steps} steps but the "
                                       f"checkpoint restored is step {step}'s: call llm_pretrain_client.mindformers"
                                       ".prepare(config) on the config the Trainer is built from")
                client._claims["data_position"] = True

    return LlmPretrainSupervisor


def __getattr__(name: str):
    if name == NAME:
        return supervisor_class()
    raise AttributeError(name)


def register() -> bool:
    """Registers LlmPretrainSupervisor as a MindFormers callback type; False when MindFormers is not importable."""
    try:
        from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
    except ImportError:
        return False
    MindFormerRegister.register_cls(supervisor_class(), module_type=MindFormerModuleType.CALLBACK, alias=NAME)
    return True


register()
