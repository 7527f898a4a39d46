#!/usr/bin/env bash
# Checks an export against mindformers' own LlamaForCausalLM, in a separate virtual environment
# (mindformers 1.9.0 pins mindspore 2.9.0; the project's runs on 2.10):
#
#   llm-pretrain export RUN --format mindformers -o /tmp/mf
#   scripts/check_mindformers.sh /tmp/mf
#
# Builds the model from the exported model.yaml and loads the exported weights into it; fails if
# any name or shape differs. (mindformers' Llama compiles only on Ascend; building and loading
# the parameters is what a CPU can prove.)
set -euo pipefail
export_dir=$(realpath "${1:?usage: scripts/check_mindformers.sh EXPORT_DIR}")
venv=$(realpath -m "${MF_VENV:-$(dirname "$0")/../.venv-mindformers}")
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "mindformers==1.9.0" "numpy<2" pyyaml safetensors
fi
cd "$(mktemp -d)"            # mindformers writes ./output/log wherever it runs
"$venv/bin/python" - "$export_dir" <<'PY'
import sys
from pathlib import Path

import mindspore as ms
import yaml
from mindformers import LlamaConfig, LlamaForCausalLM

export = Path(sys.argv[1])
model_config = yaml.safe_load((export / "model.yaml").read_text())["model"]["model_config"]
model_config.pop("type")
net = LlamaForCausalLM(LlamaConfig(**model_config))
ours = {p.name: tuple(p.shape) for p in net.get_parameters()}
weights = ms.load_checkpoint(str(export / "llama.safetensors"), format="safetensors")
theirs = {k: tuple(v.shape) for k, v in weights.items()}
missing = sorted(set(ours) - set(theirs))
unexpected = sorted(set(theirs) - set(ours))
wrong = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])
not_loaded, _ = ms.load_param_into_net(net, weights, strict_load=True)
print(f"mindformers LlamaForCausalLM: {len(ours)} parameters; export: {len(theirs)} tensors")
for label, names in (("missing from the export", missing), ("unexpected in the export", unexpected),
                     ("shape differs", wrong), ("not loaded", not_loaded)):
    for name in names:
        print(f"  {label}: {name} {ours.get(name)} vs {theirs.get(name)}")
sys.exit(1 if missing or unexpected or wrong or not_loaded else 0)
PY
