"""A small LLaMA-like network built from MindSpore's own `nn` layers (not this project's engine), and a
learnable synthetic corpus: what the client's end-to-end tests supervise as a user's script would be."""
import math

import mindspore as ms
import numpy as np
from mindspore import nn, ops

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 64, 32, 2, 2, 16


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm((WIDTH,)), nn.LayerNorm((WIDTH,))
        self.qkv = nn.Dense(WIDTH, 3 * WIDTH, has_bias=False)
        self.out = nn.Dense(WIDTH, WIDTH, has_bias=False)
        self.up = nn.Dense(WIDTH, 4 * WIDTH, has_bias=False)
        self.down = nn.Dense(4 * WIDTH, WIDTH, has_bias=False)
        self.mask = ms.Tensor(np.triu(np.full((SEQ, SEQ), -1e9, np.float32), 1))
        self.scale = 1.0 / math.sqrt(WIDTH // HEADS)

    def construct(self, x):
        b, t, d = x.shape
        q, k, v = ops.split(self.qkv(self.norm1(x)), d, axis=-1)
        heads = lambda a: a.reshape(b, t, HEADS, d // HEADS).transpose(0, 2, 1, 3)
        q, k, v = heads(q), heads(k), heads(v)
        att = ops.softmax(ops.matmul(q, k.swapaxes(-1, -2)) * self.scale + self.mask, -1)
        x = x + self.out(ops.matmul(att, v).transpose(0, 2, 1, 3).reshape(b, t, d))
        return x + self.down(ops.silu(self.up(self.norm2(x))))


class TinyLlama(nn.Cell):
    """Token ids (batch, SEQ) and their next tokens -> the mean cross entropy."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.CellList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm((WIDTH,))
        self.head = nn.Dense(WIDTH, VOCAB, has_bias=False)
        self.loss = nn.CrossEntropyLoss()

    def construct(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return self.loss(logits.reshape(-1, VOCAB), labels.reshape(-1))


class Corpus:
    """Sample i: an arithmetic sequence of token ids (its start and stride from i), which the model learns to
    continue — so a batch of uniformly random ids (the spike drill's bad data) is a real loss spike."""

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        start, stride = (i * 7) % VOCAB, 1 + i % 3
        tokens = (start + stride * np.arange(SEQ + 1)) % VOCAB
        return tokens[:-1].astype(np.int32), tokens[1:].astype(np.int32)
