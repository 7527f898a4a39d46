"""The C++ compiler the fused CPU kernels are built with (engine/model/fused_cpu.py): tests that need it
skip without one, saying how to get it, except under CI, where .ci/run installs it and a skip would
hide a missing install step."""
from __future__ import annotations

import os
import shlex
import shutil

import pytest


def cxx() -> str:
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(shlex.split(compiler)[0]) is None:
        message = f"no C++ compiler ({compiler}) on PATH (Debian: apt-get install g++)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return compiler
