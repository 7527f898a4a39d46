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


def safetensors_parts(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None,
                      cache: "PartsCache | None" = None) -> list:
    """[header bytes, then one buffer per tensor, in name order]: concatenated, a safetensors file.
    `cache`: where the same arrays come save after save, their entries and buffers are made once."""
    return parts_and_table(tensors, metadata, cache)[0]


def parts_and_table(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None,
                    cache: "PartsCache | None" = None) -> tuple[list, dict]:
    """(safetensors_parts, the tensor table a checkpoint's manifest lists: {name: {"shape": [...],
    "dtype": numpy's name}}), from one layout (numpy's dtype.name costs ~10 us a call: made once
    where `cache` has the arrays)."""
    entries, buffers, table = cache.layout(tensors) if cache is not None else _layout(tensors)
    meta = json.dumps(dict(metadata), separators=(",", ":")) if metadata else ""
    text = ("{" + (f'"__metadata__":{meta}' if meta else "") + ("," if meta and entries else "")
            + entries + "}").encode()
    text += b" " * (-(8 + len(text)) % 8)
    return [struct.pack("<Q", len(text)) + text, *buffers], table


class PartsCache:
    """The header entries and buffers of the last arrays laid out, reused while the same arrays (the
    same objects, shapes and dtypes: a RAM tier's staging buffers, written into in place) come again:
    on tiny's 67 tensors the layout cost its writer 0.9 ms a save, measured."""

    def __init__(self):
        self._key: tuple | None = None
        self._layout: tuple[str, list, dict] = ("", [], {})

    def layout(self, tensors: Mapping[str, np.ndarray]) -> tuple[str, list, dict]:
        if not all(a.flags.c_contiguous for a in tensors.values()):
            return _layout(tensors)                 # those are copied: a copy is of this save only
        key = tuple((name, id(a), a.shape, a.dtype.str) for name, a in sorted(tensors.items()))
        if key != self._key:
            self._layout, self._key = _layout(tensors), key      # the buffers keep the arrays (and ids) alive
        return self._layout


def _layout(tensors: Mapping[str, np.ndarray]) -> tuple[str, list, dict]:
    """(the header's tensor entries as JSON members, without braces; one buffer per tensor; tensor_table)."""
    header: dict = {}
    table = {name: {"shape": list(a.shape), "dtype": a.dtype.name} for name, a in tensors.items()}
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
    return json.dumps(header, separators=(",", ":"))[1:-1], buffers, table
