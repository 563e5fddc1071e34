"""The 8-bit verdicts do not depend on the CPU the tests run on.

The tests marked `haswell` (single-layer u8 x s8 and s8 x s8 convolutions and dense layers, KWS
int8 at its decision boundaries, one whole uint8 model) are run again in this process's Python
under `qemu-x86_64 -cpu Haswell`: QEMU 7.2 emulates AVX2 without AVX-512 or VNNI, so onnxruntime
(and numpy) take their AVX2 paths there whatever this machine has, the paths on which
onnxruntime's fast u8 x s8 kernels saturate. The compiled models still run natively (QEMU user
mode does not follow exec). Every test must pass there as it does here (tests/README.md).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from util import REPO, require


@pytest.mark.slow
def test_8bit_subset_gives_the_same_verdicts_on_an_avx2_cpu(tmp_path):
    require("qemu-x86_64")
    python = os.path.realpath(sys.executable)
    cmd = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", "haswell",
           "--basetemp", str(tmp_path / "t"), "tests/test_quantized.py"]
    native = subprocess.run([python, *cmd, "--collect-only"], capture_output=True, text=True, cwd=REPO)
    m = re.search(r"(\d+)/\d+ tests collected|(\d+) tests? collected", native.stdout)
    assert native.returncode == 0 and m, native.stdout[-2000:]
    collected = int(m.group(1) or m.group(2))
    r = subprocess.run(["qemu-x86_64", "-cpu", "Haswell", python, *cmd], capture_output=True, text=True, cwd=REPO,
                       timeout=1800)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:]
    assert r.returncode == 0, r.stdout[-4000:]
    assert re.search(rf"\b{collected} passed\b", summary) and "failed" not in summary, summary
