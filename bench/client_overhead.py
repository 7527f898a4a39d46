"""What supervising a user's script costs per step (issue 49: ≤ 1% of step time): the same `Model.train` script
on a small-20m-shaped network of MindSpore's own `nn` layers (tests/e2e/client_scripts/tiny_llama.py: vocab
8192, width 384, 6 heads, 9 layers, 1024 hidden, 16 × 256 tokens a step), unsupervised and supervised through
llm_pretrain_client's callback, in one process, alternating rounds on the one compiled graph.

Supervised means what a rank under the daemon does each step: a step event sent on a UNIX datagram socket
(drained by a thread here, as the daemon's reader would), the commands file polled and agreed, the phase board
written, the lr multiplier set. No checkpoint is due in the measured steps (saves are bench/checkpoint_stall.py's).
Two figures: the callback's own time per step (perf_counter around its two calls: the cost, without the
machine's noise) as a share of the step, and the whole step's median time supervised over unsupervised (the
same cost seen through the noise of a shared machine).

    python bench/client_overhead.py [--rounds 3] [--steps 8] [--shape small|tiny]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import results_file  # noqa: E402  bench/results_file.py: the one writer of bench/results

SHAPES = {"small": dict(vocab=8192, width=384, heads=6, layers=9, seq=256, hidden=1024, batch=16),
          "tiny": dict(vocab=64, width=32, heads=2, layers=2, seq=16, hidden=128, batch=8)}


def _daemon_side(tmp: Path, shape: dict) -> dict[str, str]:
    """What the daemon hands a rank: the resolved config, an event socket (drained), a commands file."""
    from contracts.config import load_config, to_toml

    cfg = load_config(None, [f"run.dir={str(tmp / 'run')!r}", "train.steps=100000",
                             f"train.global_batch={shape['batch']}", f"train.micro_batch={shape['batch']}",
                             f"data.seq_len={shape['seq']}", "checkpoint.interval_steps=0",
                             "script.command='bench'", "train.log_interval_steps=10"])
    (tmp / "run").mkdir()
    (tmp / "config.toml").write_text(to_toml(cfg))
    (tmp / "commands.jsonl").write_text("")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp / "events.sock"))

    def drain():
        while True:
            sock.recv(1 << 16)

    threading.Thread(target=drain, daemon=True).start()
    return {"LLM_PRETRAIN_CONFIG": str(tmp / "config.toml"), "LLM_PRETRAIN_EVENT_SOCKET": str(tmp / "events.sock"),
            "LLM_PRETRAIN_COMMANDS": str(tmp / "commands.jsonl"), "LLM_PRETRAIN_GENERATION": "1",
            "LLM_PRETRAIN_PHASE_BOARD": str(tmp / "board")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round and arm (after one untimed)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    args = ap.parse_args()
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore import nn
    from mindspore.train import Model
    from mindspore.train.callback import Callback

    from llm_pretrain_client import Client, Supervisor
    from tests.e2e.client_scripts.tiny_llama import Corpus, TinyLlama

    shape = SHAPES[args.shape]
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.set_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="client-overhead-"))
    client = Client(env=_daemon_side(tmp, shape))
    net = TinyLlama(shape["vocab"], shape["width"], shape["heads"], shape["layers"], shape["seq"], shape["hidden"])
    optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=client.lr(1e-4))
    train_net = nn.TrainOneStepCell(net, optimizer)
    client.restore(train_net.get_parameters())
    model = Model(train_net)
    corpus = Corpus(shape["vocab"], shape["seq"])

    class StepClock(Callback):
        """Each step's wall time: from one step's end to the next's (the first of a round is not counted)."""

        def __init__(self):
            super().__init__()
            self.times, self.last = [], None

        def on_train_step_end(self, run_context):
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now

    class TimedSupervisor(Supervisor):
        """The callback, with the time its two calls take."""

        spent: list[float] = []

        def on_train_step_begin(self, run_context):
            started = time.perf_counter()
            super().on_train_step_begin(run_context)
            self._begin = time.perf_counter() - started

        def on_train_step_end(self, run_context):
            started = time.perf_counter()
            super().on_train_step_end(run_context)
            self.spent.append(self._begin + time.perf_counter() - started)

        def on_train_end(self, run_context):
            pass                          # the run goes on in the next round

    def round_of(supervised: bool) -> list[float]:
        samples = client.source(corpus) if supervised else corpus
        # num_samples, not take(): the sampler makes only the ids a round reads (take() reads the source to its end)
        dataset = ds.GeneratorDataset(samples, ["input_ids", "labels"], shuffle=False,
                                      num_samples=(args.steps + 1) * shape["batch"]).batch(shape["batch"])
        clock = StepClock()
        callbacks = [TimedSupervisor(client), clock] if supervised else [clock]
        model.train(1, dataset, callbacks=callbacks, dataset_sink_mode=False)
        return clock.times

    round_of(False)                                     # the compile, and a warm-up of both arms
    round_of(True)
    TimedSupervisor.spent.clear()
    bare, supervised = [], []
    for r in range(args.rounds):
        for arm, out in ((False, bare), (True, supervised)) if r % 2 == 0 else ((True, supervised), (False, bare)):
            out.append(statistics.median(round_of(arm)))
    step_s = statistics.median(bare)
    callback_s = statistics.median(TimedSupervisor.spent)
    result = {"shape": args.shape, **shape, "rounds": args.rounds, "steps_per_round": args.steps,
              "unsupervised_step_s": [round(x, 5) for x in bare], "supervised_step_s": [round(x, 5) for x in supervised],
              "step_ratio": round(statistics.median(supervised) / step_s, 4),
              "callback_ms_per_step": round(1000 * callback_s, 3),
              "callback_share_of_step": round(callback_s / step_s, 5), "target_share": 0.01}
    path = results_file.write("client_overhead" if args.shape == "small" else f"client_overhead_{args.shape}", result)
    print(f"{args.shape}: step {step_s:.4f} s unsupervised, {statistics.median(supervised):.4f} s supervised "
          f"(x{result['step_ratio']}); the callback {1000 * callback_s:.3f} ms a step = "
          f"{100 * callback_s / step_s:.3f}% of the step (target <= 1%); wrote {path}")
    client.store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
