"""MindFormers' own Trainer supervised through llm_pretrain_client.mindformers, on a CPU (issue 49; the recipe:
docs/bring-your-own-script.md#mindformers). Run by the MindFormers venv's interpreter with this repository on the
path (mindformers 1.9.0 pins mindspore 2.9.0; the client needs Python >= 3.11 and crc32c, safetensors there):

    PYTHONPATH=<repo> ~/.cache/llm-pretrain/venv-mindformers-1.9.0/bin/python scripts/check_mindformers_client.py

What runs, three times in child processes: MindFormers' GeneralTaskTrainer.train — its config (the general task's
default YAML with a YAML of ours merged over it, whose `callbacks:` names LlmPretrainSupervisor by type), its
dataset skip (data_skip_steps, set by `prepare`), its callback registry and build_callback, its wrapper built by
type from runner_wrapper (MFTrainOneStepCell with clipping; only its overflow check replaced: the stock one calls
Ascend/GPU float-status kernels a CPU lacks), its AdamW and lr schedule, its MFLossMonitor, and MindSpore's
Model.train under it (in PyNative mode: the trainer leaves MindSpore there even with the YAML's context.mode 0
and GRAPH_MODE set first; each leg says which) — on the small LLaMA-like nn network of
tests/e2e/client_scripts/tiny_llama.py (MindFormers' LLaMA does not compile on CPU), under a fake daemon's
environment: a resolved config TOML in LLM_PRETRAIN_CONFIG, no
socket, no commands. Legs: `whole` trains 12 steps; `crashed` trains with a checkpoint every 4 steps and exits hard
after step 10 (step 8's checkpoint committed); `resumed` starts again in the same run directory. Passes when the
resumed leg restored step 8, trained steps 9-12 with the whole run's losses, and ended with its parameters.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, INTERVAL, CRASH_AFTER, BATCH = 12, 4, 10, 8

# Our part of the MindFormers YAML, merged over MindFormers' configs/general/run_general_task.yaml.
YAML = """\
seed: 0
output_dir: '{out}'
context:
  mode: 0
  device_target: CPU
runner_config:
  epochs: 1
  batch_size: {batch}
  sink_mode: False
  sink_size: 1
  gradient_accumulation_steps: 1
runner_wrapper:
  type: CpuMFTrainOneStepCell
  scale_sense: 1.0
  use_clip_grad: True
  max_grad_norm: 1.0
optimizer:
  type: AdamW
  betas: [0.9, 0.95]
  eps: 1.e-8
  weight_decay: 0.0
lr_schedule:
  type: ConstantWarmUpLR
  learning_rate: 3.e-3
  warmup_steps: 0
  total_steps: {steps}
callbacks:
  - type: MFLossMonitor
  - type: LlmPretrainSupervisor
train_dataset:
  batch_size: {batch}
  input_columns: [input_ids, labels]
  data_loader:
    type: UserGeneratorDataset
checkpoint:
  load_path: ''
  no_load_optim: True
load_ckpt_format: ckpt
"""


def child(leg: str, run: Path) -> None:
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore import ops
    from mindspore.train.callback import Callback

    import llm_pretrain_client.mindformers as supervised      # registers LlmPretrainSupervisor
    import mindformers
    from mindformers import MindFormerConfig
    from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
    from mindformers.trainer.general_task_trainer import GeneralTaskTrainer
    from mindformers.wrapper import MFTrainOneStepCell
    from tests.e2e.client_scripts.tiny_llama import Corpus, TinyLlama

    ms.set_context(mode=ms.GRAPH_MODE)         # asked for; MindFormers' trainer still runs PyNative here (reported)
    ms.set_device("CPU")
    ms.set_seed(0)

    @MindFormerRegister.register(MindFormerModuleType.WRAPPER)
    class CpuMFTrainOneStepCell(MFTrainOneStepCell):
        """MindFormers' wrapper whole, but for its overflow check: non-finite gradients, with CPU kernels."""

        def get_overflow_status(self, status, compute_output):
            total = ops.addn([ops.reduce_sum(ops.cast(g, ms.float32)) for g in compute_output])
            return ops.logical_not(ops.isfinite(total))

    class Net(TinyLlama):
        config = None                  # what MindFormers' trainer asks of a model (a PreTrainedModel's)

        def get_model_parameters(self, only_trainable=False):
            return self.trainable_params() if only_trainable else self.get_parameters()

    class Samples:
        def __len__(self):
            return STEPS * BATCH

        def __getitem__(self, i):
            return Corpus()[i]

    built = []
    init = supervised.LlmPretrainSupervisor.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    supervised.LlmPretrainSupervisor.__init__ = recording_init

    losses: dict[int, float] = {}

    def result(**more) -> None:
        client = built[0].client
        print("RESULT " + json.dumps({"leg": leg, "step": client.step, "losses": losses, "reports": client.reports,
                                      "sha256": client.params_sha256(),
                                      "mode": "graph" if ms.get_context("mode") == ms.GRAPH_MODE else "pynative",
                                      **more}), flush=True)

    class Record(Callback):
        """After the Supervisor (MindFormers runs the YAML's callbacks first): each step's loss by the client's
        step; the crashed leg exits hard after CRASH_AFTER, once the checkpoint in flight is committed."""

        def on_train_step_end(self, run_context):
            client = built[0].client
            losses[client.step] = float(run_context.original_args().net_outputs[0].asnumpy())
            if leg == "crashed" and client.step == CRASH_AFTER:
                client.store.wait()
                result()
                os._exit(3)

    default = Path(mindformers.__file__).parent.parent / "configs" / "general" / "run_general_task.yaml"
    config = MindFormerConfig(str(default))
    ours = run / f"{leg}.yaml"
    ours.write_text(YAML.format(out=run / f"mindformers-{leg}", batch=BATCH, steps=STEPS))
    config.merge_from_dict(MindFormerConfig(str(ours)))
    resumed = supervised.prepare(config)
    dataset = ds.GeneratorDataset(Samples(), ["input_ids", "labels"], shuffle=False).batch(BATCH)
    GeneralTaskTrainer().train(config=config, network=Net(), dataset=dataset, callbacks=[Record()],
                               is_full_config=True)
    result(resumed=resumed, data_skip_steps=config.data_skip_steps)


def leg(name: str, run: Path, log: Path) -> dict:
    from contracts.config import load_config, to_toml

    run.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"run.dir={str(run)!r}", f"train.steps={STEPS}", f"train.global_batch={BATCH}",
                             "data.seq_len=16", f"checkpoint.interval_steps={INTERVAL}",
                             "script.command='check_mindformers_client.py'"])
    (run / "config.toml").write_text(to_toml(cfg))
    env = {**os.environ, "LLM_PRETRAIN_CONFIG": str(run / "config.toml"), "LLM_PRETRAIN_GENERATION": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, __file__, "--leg", name, str(run)], env=env, stdout=out,
                              stderr=subprocess.STDOUT, cwd=run, timeout=300)
    lines = [l for l in log.read_text().splitlines() if l.startswith("RESULT ")]
    if not lines:
        sys.exit(f"{name}: exit {done.returncode}, no result; see {log}:\n" + log.read_text()[-3000:])
    got = json.loads(lines[-1][len("RESULT "):])
    got["returncode"], got["seconds"] = done.returncode, round(time.monotonic() - started, 1)
    got["losses"] = {int(k): v for k, v in got["losses"].items()}
    return got


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="check-mf-client-"))
    os.chdir(work)                     # mindformers writes ./output/log wherever it is imported
    import mindformers
    import mindspore

    print(f"python {sys.version.split()[0]}, mindspore {mindspore.__version__}, mindformers {mindformers.__version__}")
    whole = leg("whole", work / "whole", work / "whole.log")
    crashed = leg("crashed", work / "interrupted", work / "crashed.log")
    resumed = leg("resumed", work / "interrupted", work / "resumed.log")
    for got in (whole, crashed, resumed):
        print(f"  {got['leg']}: exit {got['returncode']}, {got['seconds']} s, ended after step {got['step']}, "
              f"trained steps {min(got['losses'])}-{max(got['losses'])} in {got['mode']} mode, "
              f"reports {got['reports']}")
    problems = []
    if whole["returncode"] != 0 or resumed["returncode"] != 0 or crashed["returncode"] != 3:
        problems.append("a leg exited unexpectedly")
    if whole["step"] != STEPS or resumed["step"] != STEPS or crashed["step"] != CRASH_AFTER:
        problems.append("a leg ended at the wrong step")
    if resumed.get("resumed") != 8 or resumed.get("data_skip_steps") != 8:
        problems.append(f"resumed from {resumed.get('resumed')} (data_skip_steps {resumed.get('data_skip_steps')}), "
                        "not step 8's checkpoint")
    if sorted(resumed["losses"]) != list(range(9, STEPS + 1)):
        problems.append(f"the resumed leg trained steps {sorted(resumed['losses'])}, not 9-{STEPS}")
    differ = [s for s in resumed["losses"] if resumed["losses"][s] != whole["losses"].get(s)]
    if differ:
        problems.append("losses differ from the uninterrupted run's at steps " + ", ".join(map(str, differ)) + ": "
                        + "; ".join(f"{s}: {resumed['losses'][s]} vs {whole['losses'].get(s)}" for s in differ))
    if any(crashed["losses"][s] != whole["losses"][s] for s in crashed["losses"]):
        problems.append("the crashed leg's losses differ from the uninterrupted run's")
    if resumed["sha256"] != whole["sha256"]:
        problems.append("the resumed run's parameters differ from the uninterrupted run's")
    if "data_position" not in resumed["reports"] or "skip_data" in resumed["reports"]:
        problems.append(f"reports {resumed['reports']}: expected data_position and no skip_data")
    if problems:
        print("FAIL:\n  " + "\n  ".join(problems) + f"\n  logs: {work}")
        sys.exit(1)
    print(f"OK: resumed from step 8's checkpoint, steps 9-{STEPS} trained with the uninterrupted run's losses, "
          f"parameters equal (sha256 {whole['sha256'][:16]}); logs: {work}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--leg":
        sys.path.insert(0, str(ROOT))
        child(sys.argv[2], Path(sys.argv[3]))
    else:
        sys.path.insert(0, str(ROOT))
        main()
