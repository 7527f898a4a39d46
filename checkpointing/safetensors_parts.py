"""A safetensors file as parts to write and hash one after another, without building it in memory.

Owns: the layout of the safetensors format (an 8-byte little-endian header length, the JSON header
padded with spaces to 8 bytes, then each tensor's raw bytes at its `data_offsets`). The writer
hashes and writes the header and then each tensor's buffer straight from the caller's host copies,
where `safetensors.numpy.save` first joins them into one new bytes object (a copy of the whole
shard, and on tiny's RAM checkpoints a third of the writer's CPU, measured). Any safetensors reader
loads the result; dtypes the format names for numpy only (an unknown one is a ValueError).
"""
from __future__ import annotations

import json
import struct
from typing import Mapping

import numpy as np

DTYPES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
          "int32": "I32", "uint32": "U32", "float32": "F32", "int64": "I64", "uint64": "U64", "float64": "F64"}


def safetensors_parts(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> list:
    """[header bytes, then one buffer per tensor, in name order]: concatenated, a safetensors file."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    buffers, at = [], 0
    for name in sorted(tensors):
        a = tensors[name]
        code = DTYPES.get(a.dtype.name)
        if code is None or a.dtype.byteorder == ">":
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors code here "
                             f"(one of {', '.join(sorted(DTYPES))}, little-endian)")
        a = a if a.flags.c_contiguous else a.copy()      # (ascontiguousarray would make a 0-d array 1-d)
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
        buffers.append(memoryview(a.reshape(-1)).cast("B"))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return [struct.pack("<Q", len(text)) + text, *buffers]
