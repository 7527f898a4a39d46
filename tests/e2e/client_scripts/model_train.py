"""A user's script under `Model.train` (what MindFormers' Trainer calls), supervised through the callback: the
ten-line change of docs/bring-your-own-script.md, on the small LLaMA-like network of tiny_llama.py."""
import sys

import mindspore as ms
import mindspore.dataset as ds
from mindspore import nn
from mindspore.train import Model

from llm_pretrain_client import Client, Supervisor
from tests.e2e.client_scripts.tiny_llama import VOCAB, Corpus, TinyLlama

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")
ms.set_seed(0)
client = Client()                                                    # what the daemon handed this rank
if client.world > 1:                                                 # data parallel, as under msrun
    from mindspore.communication import init
    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
net = TinyLlama()
optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=client.lr(3e-3))
train_net = nn.TrainOneStepCell(net, optimizer)
client.restore(train_net.get_parameters())                           # the newest checkpoint, if any
samples = client.source(Corpus(), vocab_size=VOCAB)                  # resumed, skips applied, drills' bad data
micro = client.global_batch // client.world
dataset = ds.GeneratorDataset(samples, ["input_ids", "labels"], shuffle=False).batch(micro)
print(f"model_train: resuming after step {client.step}, {len(samples) // micro} steps to go", file=sys.stderr)
Model(train_net).train(1, dataset, callbacks=[Supervisor(client)], dataset_sink_mode=False)
