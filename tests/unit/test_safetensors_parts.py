"""The checkpoint writer's streamed safetensors file: what the safetensors library reads back."""
import json

import numpy as np
import pytest
import safetensors.numpy

from checkpointing.safetensors_parts import safetensors_parts

pytestmark = pytest.mark.unit


def test_the_parts_concatenated_are_a_safetensors_file_of_the_same_tensors_and_metadata():
    rng = np.random.default_rng(0)
    tensors = {"model.layers.0.mlp.up_proj.weight": rng.normal(size=(5, 3)).astype(np.float32),
               "adam_step": np.array(7, np.int32), "b": np.arange(6, dtype=np.int64).reshape(2, 3)[:, ::2],
               "half": rng.normal(size=4).astype(np.float16), "flag": np.array([True, False]),
               "empty": np.zeros((0, 4), np.float32)}
    parts = safetensors_parts(tensors, {"step": "3", "rank": "0"})
    blob = b"".join(bytes(p) for p in parts)
    header_len = int.from_bytes(blob[:8], "little")
    assert (8 + header_len) % 8 == 0                      # the data starts 8-byte aligned
    back = safetensors.numpy.load(blob)
    assert sorted(back) == sorted(tensors)
    for name, a in tensors.items():
        assert back[name].dtype == a.dtype and back[name].shape == a.shape and np.array_equal(back[name], a)
    assert back["b"].tolist() == [[0, 2], [3, 5]]        # a strided view is written as its values
    assert json.loads(blob[8:8 + header_len])["__metadata__"] == {"step": "3", "rank": "0"}


def test_a_dtype_the_format_has_no_code_for_here_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="'c'.*complex64"):
        safetensors_parts({"c": np.zeros(2, np.complex64)})
    with pytest.raises(ValueError, match="little-endian"):
        safetensors_parts({"be": np.zeros(2, ">f4")})


def test_a_cache_lays_the_same_arrays_out_once_and_writes_what_they_hold_now():
    """The RAM tier copies into the same staging arrays save after save: the layout is reused, the
    bytes are always the arrays' current values, and other arrays (or none, or no metadata) lay out anew."""
    from checkpointing.safetensors_parts import PartsCache

    cache = PartsCache()
    staging = {"w": np.zeros((2, 3), np.float32), "step": np.array(1, np.int32)}
    first = safetensors_parts(staging, {"step": "1"}, cache=cache)
    np.copyto(staging["w"], np.arange(6, dtype=np.float32).reshape(2, 3))
    second = safetensors_parts(staging, {"step": "12"}, cache=cache)
    assert all(a is b for a, b in zip(first[1:], second[1:]))            # the buffers: laid out once
    back = safetensors.numpy.load(b"".join(bytes(p) for p in second))
    assert back["w"].tolist() == [[0, 1, 2], [3, 4, 5]] and back["step"] == 1
    assert b"".join(bytes(p) for p in second) == b"".join(bytes(p) for p in safetensors_parts(staging, {"step": "12"}))
    other = {"w": np.ones((2, 3), np.float32), "step": np.array(1, np.int32)}
    assert safetensors.numpy.load(b"".join(bytes(p) for p in safetensors_parts(other, cache=cache)))["w"].sum() == 6
    strided = {"s": np.arange(6, dtype=np.float32)[::2]}
    safetensors_parts(strided, cache=cache)
    strided["s"][:] = 9                                    # a strided array is copied each save, never cached
    assert safetensors.numpy.load(b"".join(bytes(p) for p in safetensors_parts(strided, cache=cache)))["s"].tolist() == [9] * 3
    assert safetensors.numpy.load(b"".join(bytes(p) for p in safetensors_parts({}, {"step": "1"}))) == {}
