"""`tinydeploy quantize`: onnxruntime's static quantiser behind a checked calibration reader."""
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from util import REPO, mlperf_model

sys.path.insert(0, str(REPO / "models"))
import make_calibration  # noqa: E402


def tdq(*args, cwd):
    return subprocess.run([sys.executable, "-m", "tinydeploy", "quantize", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("fmt", ["qdq", "qoperator"])
def test_quantize_reports_accuracy_on_held_out_samples(fmt, tmp_path):
    m = mlperf_model("kws_dscnn_fp32.onnx")
    np.savez(tmp_path / "cal.npz", **make_calibration.make(str(m), n=10, seed=0))
    r = tdq(m, "--calibration", tmp_path / "cal.npz", "-o", tmp_path / "q.onnx", "--format", fmt,
            "--per-channel", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["calibration_samples"] == 8 and rep["samples"] == 2 and rep["held_out"] is True
    assert 0.0 <= rep["top1_agreement"] <= 1.0 and rep["max_abs_error"] < 0.5
    ops = {n.op_type for n in onnx.load(tmp_path / "q.onnx").graph.node}
    assert ("QLinearConv" in ops) == (fmt == "qoperator") and ("QuantizeLinear" in ops)


@pytest.mark.parametrize("reduce", [False, True], ids=["full", "reduce-range"])
def test_reduce_range_gives_7_bit_weights(reduce, tmp_path):
    """--reduce-range: onnxruntime's 7-bit weights, every int8 weight in [-64, 64] (its symmetric
    weights reach +64: any two of them sum to at most 128 in magnitude, 255 * 128 <= 32767, which
    lets x86 without VNNI multiply by vpmaddubsw exactly); without it the weights use the full range."""
    m = mlperf_model("kws_dscnn_fp32.onnx")
    np.savez(tmp_path / "cal.npz", **make_calibration.make(str(m), n=6, seed=0))
    r = tdq(m, "--calibration", tmp_path / "cal.npz", "-o", tmp_path / "q.onnx", "--json",
            *(["--reduce-range"] if reduce else []), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["reduce_range"] is reduce
    g = onnx.load(tmp_path / "q.onnx").graph
    weights = [onnx.numpy_helper.to_array(t) for t in g.initializer if t.data_type == onnx.TensorProto.INT8]
    assert weights
    lo, hi = min(int(w.min()) for w in weights), max(int(w.max()) for w in weights)
    assert (-64 <= lo and hi <= 64) if reduce else (lo < -64 or hi > 63)


def test_calibration_folder_of_single_samples(tmp_path):
    m = mlperf_model("ad_autoencoder_fp32.onnx")
    data = make_calibration.make(str(m), n=6, seed=1)
    (tmp_path / "cal").mkdir()
    name = next(iter(data))
    for i in range(6):
        np.save(tmp_path / "cal" / f"{i:02d}.npy", data[name][i])
    r = tdq(m, "--calibration", tmp_path / "cal", "-o", tmp_path / "q.onnx", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["calibration_samples"] == 5 and "top1_agreement" not in rep   # not a classifier


@pytest.mark.parametrize("bad,needle", [
    (lambda d: {k: v[:, :, :5] for k, v in d.items()}, "expected 1x49x10x1 or Nx1x49x10x1"),
    (lambda d: {k: v.astype(np.float64) for k, v in d.items()}, "is float64; expected float32 1x49x10x1"),
    (lambda d: {"wrong_name": v for v in d.values()}, "has no array for input 'input_1'"),
], ids=["shape", "dtype", "name"])
def test_bad_calibration_data_is_refused_naming_input_and_shape(bad, needle, tmp_path):
    m = mlperf_model("kws_dscnn_fp32.onnx")
    np.savez(tmp_path / "cal.npz", **bad(make_calibration.make(str(m), n=3)))
    r = tdq(m, "--calibration", tmp_path / "cal.npz", "-o", tmp_path / "q.onnx", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert needle in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "q.onnx").exists()


def test_existing_output_is_never_overwritten(tmp_path):
    m = mlperf_model("kws_dscnn_fp32.onnx")
    np.savez(tmp_path / "cal.npz", **make_calibration.make(str(m), n=3))
    (tmp_path / "q.onnx").write_text("mine")
    r = tdq(m, "--calibration", tmp_path / "cal.npz", "-o", tmp_path / "q.onnx", cwd=tmp_path)
    assert r.returncode == 2 and (tmp_path / "q.onnx").read_text() == "mine"
