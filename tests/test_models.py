"""End-to-end acceptance on real models: the CLI's `run --json` against onnxruntime."""
import json
import subprocess
import sys

import pytest

from util import REPO, assert_arena_tight, mlperf_model

FP32_MODELS = ["ic_resnet8_fp32.onnx", "kws_dscnn_fp32.onnx", "vww_mobilenetv1_fp32.onnx", "ad_autoencoder_fp32.onnx"]


def run_json(model, tmp_path, *extra):
    r = subprocess.run([sys.executable, "-m", "tinydeploy", "run", "--board", "host", str(model), "--json",
                        "-o", str(tmp_path / "out"), *extra], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"--json must print exactly one JSON object, got {r.stdout!r}"
    return json.loads(lines[0])


@pytest.mark.parametrize("name", FP32_MODELS)
def test_mlperf_fp32_matches_onnxruntime_with_a_tight_arena(name, tmp_path):
    res = run_json(mlperf_model(name), tmp_path)
    assert set(res) >= {"model", "board", "outputs_match", "max_abs_error", "max_rel_error", "tolerance",
                        "latency", "memory"}
    assert res["outputs_match"] is True
    assert res["max_rel_error"] <= 1e-4
    assert res["latency"]["median_ms"] > 0 and res["latency"]["runs"] >= 3
    assert_arena_tight(mlperf_model(name), res["memory"])
    assert res["memory"]["weights_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_resnet_matches_onnxruntime(name, resnets, tmp_path):
    res = run_json(resnets[name], tmp_path)
    assert res["outputs_match"] is True and res["max_rel_error"] <= 1e-4
    assert_arena_tight(resnets[name], res["memory"])


def test_symbolic_batch_resnet_defaults_to_one(tmp_path):
    sys.path.insert(0, str(REPO / "models"))
    import make_models
    import onnx
    p = tmp_path / "r18dyn.onnx"
    onnx.save(make_models.build("resnet18", seed=1, dynamic_batch=True), p)
    r = subprocess.run([sys.executable, "-m", "tinydeploy", "build", str(p), "-o", str(tmp_path / "b")],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "batch dimension 'N' set to 1" in r.stdout
