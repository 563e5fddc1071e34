"""Cortex-A boards: cross-built static binaries run under qemu-aarch64 and compared with
onnxruntime (correctness only: user-mode QEMU says nothing about speed)."""
import json
import subprocess
import sys

import pytest

from test_models import FP32_MODELS
from util import mlperf_model, require

BOARDS = ["rpi4", "jetson-orin", "jetson-xavier"]


def run_emulated(model, board, tmp_path):
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    r = subprocess.run([sys.executable, "-m", "tinydeploy", "run", "--board", board, "--emulate", str(model),
                        "--json", "-o", str(tmp_path / "b")], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize("board", BOARDS)
@pytest.mark.parametrize("name", FP32_MODELS)
def test_mlperf_fp32_under_qemu_aarch64(board, name, tmp_path):
    res = run_emulated(mlperf_model(name), board, tmp_path)
    assert res["outputs_match"] is True and res["max_rel_error"] <= 1e-4
    assert res["board"] == board and res["emulated"] is True


@pytest.mark.slow
@pytest.mark.parametrize("board", BOARDS)
def test_resnet18_under_qemu_aarch64(board, resnets, tmp_path):
    res = run_emulated(resnets["resnet18"], board, tmp_path)
    assert res["outputs_match"] is True and res["max_rel_error"] <= 1e-4


def test_board_that_is_not_here_needs_emulate(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tinydeploy", "run", "--board", "rpi4",
                        str(mlperf_model("kws_dscnn_fp32.onnx"))], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "--emulate" in r.stderr and "Traceback" not in r.stderr
