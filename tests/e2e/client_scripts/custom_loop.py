"""A user's own training loop, supervised through the client's calls: begin a step (its drills), train it,
end it with its loss and global gradient norm, stop when told; a step whose gradients are not finite is not
applied (as the engine's is skipped), and the lr the optimizer itself computes is what is reported."""
import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import nn, ops

from llm_pretrain_client import Client
from tests.e2e.client_scripts.tiny_llama import VOCAB, Corpus, TinyLlama

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")
ms.set_seed(0)
client = Client(grad_norm=True)
net = TinyLlama()
optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=client.lr(3e-3))


def forward(x, y, poison):
    return net(x, y) * poison             # poison: 1.0, or NaN on a nan drill's step (client.begin_step's plan)


grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)


@ms.jit
def gradients(x, y, poison):
    loss, grads = grad_fn(x, y, poison)
    return loss, grads, ops.sqrt(ops.addn([ops.reduce_sum(ops.square(g)) for g in grads]))


@ms.jit
def update(grads):
    return optimizer(grads)


client.restore([*net.trainable_params(), *optimizer.get_parameters()])    # the weights, the moments, the step count
samples = client.source(Corpus(), vocab_size=VOCAB)
batches = ds.GeneratorDataset(samples, ["input_ids", "labels"], shuffle=False).batch(client.global_batch)
batches = batches.create_tuple_iterator()
while client.training:
    plan = client.begin_step()
    x, y = next(batches)
    lr = float(optimizer.get_lr().asnumpy())          # the optimizer's own lr for this step (the daemon's cut in it)
    loss, grads, norm = gradients(x, y, ms.Tensor(plan.poison, ms.float32))
    finite = bool(np.isfinite(norm.asnumpy()))
    if finite:
        update(grads)
    if not client.end_step(loss, grad_norm=norm, overflow=not finite, lr=lr):
        break
client.finish()
