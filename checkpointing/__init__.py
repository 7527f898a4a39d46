"""Sharded asynchronous checkpoints: named numpy arrays plus JSON metadata, committed atomically.

Modules: layout (names and paths), partition (which rank writes what),
writer (background shard writing and the commit), reader (verify, load,
set a corrupt one aside, fall back), retention (what to delete). Imports neither `daemon`
nor `engine`: the engine adapts its state to named arrays and a JSON dict.
No pickle anywhere: tensors in safetensors, everything else JSON.
"""


class CheckpointError(Exception):
    """A checkpoint that cannot be written, read or trusted; the message names it."""
