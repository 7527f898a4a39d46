"""The one writer of a benchmark's results: bench/results/<name>.json, with the host it ran on.

Every bench ends with `write(name, payload)`: the payload under `benchmark` (its name), `machine` (CPUs,
Python, the CPU's model and its widest vector ISA: a figure is only comparable on the host it names) and
`created` (UTC), written atomically. bench/performance_table.py renders the docs' tables from these files.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


def host() -> dict[str, Any]:
    """This machine, as a result names it: the CPUs this process may use, Python, the CPU model and ISA flags."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(), "cpu": model or platform.processor(),
            "isa": [f for f in ISA_FLAGS if f in flags]}


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read(name: str) -> dict[str, Any]:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def write(name: str, payload: dict[str, Any]) -> Path:
    """bench/results/<name>.json: `payload` with the benchmark's name, the host and the time (a payload's own
    `created` stands: a file merged from several sittings keeps its date)."""
    from durable import write_atomically      # the project's root is on sys.path once a bench runs

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"benchmark": name, **payload, "machine": {**host(), **payload.get("machine", {})},
            "created": payload.get("created") or now()}
    write_atomically(path, json.dumps(data, indent=2) + "\n")
    return path
