"""Acceptance: FP32 models quantised to uint8 by `tinydeploy quantize` (onnxruntime's static
quantiser), in both of its formats, run by `tinydeploy run --board host --json`: bit for bit with
tinydeploy's exact reference, and within 1 LSB of the oracle (onnxruntime running the graph node
by node) or further only through rounding ties (reference.check_outputs).

QDQ models go through the QDQ pass (tinydeploy/quant/); QOperator models (QLinearConv,
com.microsoft QLinearAdd / QGemm / QLinearSoftmax, ...) are first rewritten into QDQ form
(tinydeploy/frontend/qoperator.py). The models' float outputs are DequantizeLinear outputs, compared in
LSBs of their scale (flow.run, reference.compare_outputs).
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from util import REPO, assert_arena_tight, mlperf_model

sys.path.insert(0, str(REPO / "models"))
import make_calibration  # noqa: E402

MLPERF = {   # model: image input (calibrate and run on 0..255 pixels)
    "ic_resnet8": True,
    "kws_dscnn": False,
    "vww_mobilenetv1": True,
    "ad_autoencoder": False,
}


def td(*args, cwd):
    return subprocess.run([sys.executable, "-m", "tinydeploy", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=900)


def quantize_and_run(fp32, fmt, tmp_path, image: bool, samples: int = 10, seeds=(0,)) -> list[dict]:
    cal = tmp_path / "cal.npz"
    np.savez(cal, **make_calibration.make(str(fp32), n=samples, seed=0, image_range=image))
    q = tmp_path / f"q_{fmt}.onnx"
    r = td("quantize", fp32, "--calibration", cal, "-o", q, "--format", fmt, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    results = []
    for seed in seeds:
        args = ["run", "--board", "host", q, "--json", "-o", tmp_path / "build"]
        if image:   # pixels, like the calibration data (standard normal inputs would barely move the input quantiser)
            data = make_calibration.make(str(fp32), n=1, seed=1000 + seed, image_range=True)
            np.savez(tmp_path / "inputs.npz", **{k: v[0] for k, v in data.items()})
            args += ["--inputs", tmp_path / "inputs.npz"]
        else:
            args += ["--seed", seed]
        r = td(*args, cwd=tmp_path)
        assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
        res = json.loads(r.stdout)
        assert res["outputs_match"] and res["tolerance_unit"] == "LSB", res
        # bit for bit with the exact reference; within 1 LSB of the oracle, or further only
        # through rounding ties that a deep network carries to its outputs (reference.check_outputs)
        assert res["exact_reference"]["identical"], res
        assert res["max_abs_error"] <= 1 or (res["layerwise"]["disagreements"] == 0 and res["layerwise"]["ties"]), res
        results.append(res)
    return results


@pytest.mark.parametrize("fmt", ["qdq", "qoperator"])
@pytest.mark.parametrize("name", list(MLPERF))
def test_mlperf_uint8(name, fmt, tmp_path):
    res = quantize_and_run(mlperf_model(f"{name}_fp32.onnx"), fmt, tmp_path, MLPERF[name], seeds=(0, 1))
    assert_arena_tight(tmp_path / f"q_{fmt}.onnx", res[-1]["memory"])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["qdq", "qoperator"])
def test_resnet18_uint8(fmt, resnets, tmp_path):
    res = quantize_and_run(resnets["resnet18"], fmt, tmp_path, False, samples=8)
    assert_arena_tight(tmp_path / f"q_{fmt}.onnx", res[-1]["memory"])
