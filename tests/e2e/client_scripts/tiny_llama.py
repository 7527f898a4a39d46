"""A small LLaMA-like network built from MindSpore's own `nn` layers (not this project's engine), and a
learnable synthetic corpus: what the client's end-to-end tests supervise as a user's script would be."""
import math

import mindspore as ms
import numpy as np
from mindspore import nn, ops

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 64, 32, 2, 2, 16     # the tests' shape; bench/client_overhead.py a bigger one


class Block(nn.Cell):
    def __init__(self, width=WIDTH, heads=HEADS, seq=SEQ, hidden=4 * WIDTH):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm((width,)), nn.LayerNorm((width,))
        self.qkv = nn.Dense(width, 3 * width, has_bias=False)
        self.out = nn.Dense(width, width, has_bias=False)
        self.up = nn.Dense(width, hidden, has_bias=False)
        self.down = nn.Dense(hidden, width, has_bias=False)
        self.mask = ms.Tensor(np.triu(np.full((seq, seq), -1e9, np.float32), 1))
        self.scale = 1.0 / math.sqrt(width // heads)

    def construct(self, x):
        b, t, d = x.shape
        q, k, v = ops.split(self.qkv(self.norm1(x)), d, axis=-1)
        heads = lambda a: a.reshape(b, t, self.heads, d // self.heads).transpose(0, 2, 1, 3)
        q, k, v = heads(q), heads(k), heads(v)
        att = ops.softmax(ops.matmul(q, k.swapaxes(-1, -2)) * self.scale + self.mask, -1)
        x = x + self.out(ops.matmul(att, v).transpose(0, 2, 1, 3).reshape(b, t, d))
        return x + self.down(ops.silu(self.up(self.norm2(x))))


class TinyLlama(nn.Cell):
    """Token ids (batch, SEQ) and their next tokens -> the mean cross entropy."""

    def __init__(self, vocab=VOCAB, width=WIDTH, heads=HEADS, layers=LAYERS, seq=SEQ, hidden=4 * WIDTH):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.CellList([Block(width, heads, seq, hidden) for _ in range(layers)])
        self.norm = nn.LayerNorm((width,))
        self.head = nn.Dense(width, vocab, has_bias=False)
        self.loss = nn.CrossEntropyLoss()

    def construct(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return self.loss(logits.reshape(-1, self.vocab), labels.reshape(-1))


class Corpus:
    """Sample i: an arithmetic sequence of token ids (its start and stride from i), which the model learns to
    continue — so a batch of uniformly random ids (the spike drill's bad data) is a real loss spike."""

    def __init__(self, vocab=VOCAB, seq=SEQ):
        self.vocab, self.seq = vocab, seq

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        start, stride = (i * 7) % self.vocab, 1 + i % 3
        tokens = (start + stride * np.arange(self.seq + 1)) % self.vocab
        return tokens[:-1].astype(np.int32), tokens[1:].astype(np.int32)
