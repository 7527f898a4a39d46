"""Strict JSON for records that may hold non-finite floats: NaN and infinities are written as the strings
'nan', 'inf' and '-inf' (JSON has no literal for them), at any depth, and read back where a number is
expected. The one encoding of the events' datagrams (contracts.protocol), the event log and state.json
(daemon.records). Stdlib only.
"""
from __future__ import annotations

import math
from typing import Any

NON_FINITE = ("nan", "inf", "-inf")


def encode(value: Any) -> Any:
    """`value` with every non-finite float, in lists, tuples and dicts too, as its string."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    """The reverse of `encode`, for a value known to hold numbers: 'nan'/'inf'/'-inf' become floats again."""
    if isinstance(value, str) and value in NON_FINITE:
        return float(value)
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value
