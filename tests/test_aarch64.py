"""Cortex-A boards: cross-built static binaries run under qemu-aarch64 and compared with
onnxruntime; 8-bit ones also bit for bit with tinydeploy's exact reference (correctness only:
user-mode QEMU says nothing about speed)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from test_models import FP32_MODELS
from tinydeploy import flow
from util import mlperf_model, require, save

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


# ---- 8-bit under qemu-aarch64: the same kernels, bit for bit against the exact reference ----

INT8_MODELS = [m.replace("_fp32", "_int8") for m in FP32_MODELS]


@pytest.mark.parametrize("name", INT8_MODELS)
def test_mlperf_int8_under_qemu_aarch64(name, tmp_path):
    res = run_emulated(mlperf_model(name), "rpi4", tmp_path)
    assert res["outputs_match"] is True and res["max_abs_error"] <= 1, res
    assert res["exact_reference"]["identical"], res


def _layer_cases():
    from test_quantized import CONV_CASES, _conv_model
    cases = [(f"conv-{c}-{t}", lambda c=c, d=d: _conv_model(c, d)) for c in CONV_CASES
             for t, d in (("s8", np.int8), ("u8", np.uint8))]
    return dict(cases)


LAYERS = _layer_cases()


@pytest.mark.parametrize("case", list(LAYERS))
def test_8bit_layers_under_qemu_aarch64(case, tmp_path):
    """The attribute matrix of tests/test_quantized.py, cross-built for the Pi 4 and run under
    qemu-aarch64: outputs equal the exact reference (tinydeploy/quant/exact.py) bit for bit."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    path = save(LAYERS[case](), tmp_path)
    for seed in (0, 1):
        res = flow.run(path, "rpi4", outdir=tmp_path / "b", quiet=True, latency=False, emulate=True, seed=seed)
        assert res["exact_reference"]["identical"] and res["outputs_match"], res
