"""QOperator import (tinydeploy/frontend/qoperator.py: QLinear* and com.microsoft contrib operators become
QDQ subgraphs) and the quantisation schemes tinydeploy refuses (quant.scheme_problem)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto as TP, helper, numpy_helper

from tinydeploy import flow
from util import check_model_lsb, save

MS = "com.microsoft"


def _model(nodes, inputs, outputs, inits, opset=13):
    g = helper.make_graph(nodes, "t", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)],
                             ir_version=8)


def _c(name, value, dtype):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _vi(name, t, shape):
    return helper.make_tensor_value_info(name, t, shape)


def test_qlinearconv_and_qgemm(tmp_path):
    """QLinearConv (per-channel int8 weights, int32 bias) -> QLinearAveragePool -> QGemm."""
    rng = np.random.default_rng(0)
    M = 8
    ws = np.geomspace(1e-3, 8e-3, M).astype(np.float32)
    inits = [_c("xs", 0.02, np.float32), _c("xz", 121, np.uint8), _c("w", rng.integers(-127, 128, (M, 3, 3, 3)), np.int8),
             _c("ws", ws, np.float32), _c("wz", np.zeros(M), np.int8), _c("ys", 0.05, np.float32), _c("yz", 7, np.uint8),
             _c("b", rng.integers(-2000, 2000, M), np.int32), _c("ps", 0.03, np.float32), _c("pz", 3, np.uint8),
             _c("g", rng.integers(-127, 128, (M * 16, 10)), np.int8), _c("gs", 4e-3, np.float32), _c("gz", 0, np.int8),
             _c("gb", rng.integers(-500, 500, 10), np.int32), _c("os", 0.1, np.float32), _c("oz", 128, np.uint8),
             _c("shape", [1, -1], np.int64)]
    nodes = [helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["c"], name="conv",
                              pads=[1, 1, 1, 1]),
             helper.make_node("QLinearAveragePool", ["c", "ys", "yz", "ps", "pz"], ["p"], name="pool", domain=MS,
                              kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Reshape", ["p", "shape"], ["f"], name="flatten"),
             helper.make_node("QGemm", ["f", "ps", "pz", "g", "gs", "gz", "gb", "os", "oz"], ["y"], name="gemm",
                              domain=MS)]
    m = _model(nodes, [_vi("x", TP.UINT8, [1, 3, 8, 8])], [_vi("y", TP.UINT8, [1, 10])], inits)
    check_model_lsb(m, tmp_path, seeds=(0, 1, 2), variants=("gcc",))
    b = flow.build(save(m, tmp_path, "m2.onnx"), "host", tmp_path / "b", quiet=True)
    assert [n.op for n in b.compiled.graph.nodes] == ["QConv", "QAveragePool", "Reshape", "QDense"]


def test_contrib_elementwise_concat_softmax(tmp_path):
    """QLinearAdd, QLinearMul, QLinearLeakyRelu, QLinearSigmoid, QLinearConcat,
    QLinearGlobalAveragePool, QLinearMatMul and QLinearSoftmax, on int8."""
    rng = np.random.default_rng(1)
    T = TP.INT8
    inits = [_c("as", 0.05, np.float32), _c("az", -3, np.int8), _c("bs", 0.07, np.float32), _c("bz", 5, np.int8),
             _c("s1", 0.09, np.float32), _c("z1", 1, np.int8), _c("s2", 0.2, np.float32), _c("z2", -10, np.int8),
             _c("s3", 0.04, np.float32), _c("z3", -2, np.int8), _c("s4", 1 / 256, np.float32), _c("z4", -128, np.int8),
             _c("s5", 0.1, np.float32), _c("z5", 0, np.int8), _c("s6", 0.05, np.float32), _c("z6", 4, np.int8),
             _c("w", rng.integers(-127, 128, (6, 5)), np.int8), _c("wsc", 0.01, np.float32), _c("wz", 0, np.int8),
             _c("s7", 0.08, np.float32), _c("z7", 2, np.int8), _c("sm", 1 / 256, np.float32), _c("zm", -128, np.int8)]
    nodes = [helper.make_node("QLinearAdd", ["a", "as", "az", "b", "bs", "bz", "s1", "z1"], ["add"], name="add", domain=MS),
             helper.make_node("QLinearMul", ["add", "s1", "z1", "b", "bs", "bz", "s2", "z2"], ["mul"], name="mul", domain=MS),
             helper.make_node("QLinearLeakyRelu", ["mul", "s2", "z2", "s3", "z3"], ["lr"], name="lrelu", domain=MS,
                              alpha=0.1),
             helper.make_node("QLinearSigmoid", ["lr", "s3", "z3", "s4", "z4"], ["sg"], name="sigmoid", domain=MS),
             helper.make_node("QLinearConcat", ["s5", "z5", "sg", "s4", "z4", "a", "as", "az"], ["cat"], name="concat",
                              domain=MS, axis=1),
             helper.make_node("QLinearGlobalAveragePool", ["cat", "s5", "z5", "s6", "z6"], ["gap"], name="gap",
                              domain=MS, channels_last=0),
             helper.make_node("Reshape", ["gap", "shape"], ["flat"], name="flat"),
             helper.make_node("QLinearMatMul", ["flat", "s6", "z6", "w", "wsc", "wz", "s7", "z7"], ["mm"], name="matmul"),
             helper.make_node("QLinearSoftmax", ["mm", "s7", "z7", "sm", "zm"], ["y"], name="softmax", domain=MS,
                              axis=-1, opset=13)]
    inits.append(_c("shape", [1, 6], np.int64))
    m = _model(nodes, [_vi("a", T, [1, 3, 4, 5]), _vi("b", T, [1, 3, 4, 5])], [_vi("y", T, [1, 5])], inits)
    check_model_lsb(m, tmp_path, seeds=(0, 1, 2), variants=("gcc",))
    b = flow.build(save(m, tmp_path, "m2.onnx"), "host", tmp_path / "b", quiet=True)
    ops = [n.op for n in b.compiled.graph.nodes]
    assert {"QAdd", "QGlobalAveragePool", "QDense", "QSoftmax"} <= set(ops), ops


def test_softmax_scale_1_255_follows_the_graph(tmp_path):
    """y_scale = 1/255: QuantizeLinear divides by the scale (the graph's meaning), where
    onnxruntime's fused QLinearSoftmax multiplies by floor(1 / y_scale) = 254 and so lands up to
    1 LSB lower on ~10% of the elements."""
    inits = [_c("xs", 0.1734, np.float32), _c("xz", 3, np.uint8), _c("ys", 1 / 255, np.float32), _c("yz", 0, np.uint8)]
    nodes = [helper.make_node("DequantizeLinear", ["x", "xs", "xz"], ["f"]),
             helper.make_node("Softmax", ["f"], ["s"], axis=1),
             helper.make_node("QuantizeLinear", ["s", "ys", "yz"], ["y"])]
    m = _model(nodes, [_vi("x", TP.UINT8, [4, 10, 3])], [_vi("y", TP.UINT8, [4, 10, 3])], inits)
    res = check_model_lsb(m, tmp_path, seeds=(0, 1, 2), variants=("gcc", "gcc-asan-ubsan"))
    assert all(r["max_abs_error"] <= 1 and r["identical_fraction"] >= 0.99 for r in res), res


def test_rewrite_agrees_with_onnx_reference_evaluator(tmp_path):
    """The QDQ form the oracle runs for QOperator models means what the QOperator model means:
    onnx's reference evaluator on QLinearConv / QLinearMatMul themselves agrees with tinydeploy
    except at rounding ties (which it rounds from float64 sums)."""
    import onnx
    from onnx.reference import ReferenceEvaluator
    from tinydeploy.quant import exact
    rng = np.random.default_rng(4)
    inits = [_c("xs", 0.02, np.float32), _c("xz", 121, np.uint8), _c("w", rng.integers(-127, 128, (6, 3, 3, 3)), np.int8),
             _c("ws", np.geomspace(1e-3, 8e-3, 6), np.float32), _c("wz", np.zeros(6), np.int8),
             _c("ys", 0.05, np.float32), _c("yz", 7, np.uint8), _c("b", rng.integers(-2000, 2000, 6), np.int32),
             _c("m", rng.integers(-127, 128, (8, 5)), np.int8), _c("ms", 4e-3, np.float32), _c("mz", 0, np.int8),
             _c("os", 0.1, np.float32), _c("oz", 128, np.uint8)]
    nodes = [helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("QLinearMatMul", ["c", "ys", "yz", "m", "ms", "mz", "os", "oz"], ["y"])]
    m = _model(nodes, [_vi("x", TP.UINT8, [1, 3, 6, 8])], [_vi("y", TP.UINT8, [1, 6, 6, 5])], inits)
    path = save(m, tmp_path)
    for seed in range(3):
        x = {"x": rng.integers(0, 256, (1, 3, 6, 8)).astype(np.uint8)}
        want = ReferenceEvaluator(onnx.load(path)).run(None, x)[0].astype(np.int64)
        got = exact.run_model(path, x)[0].astype(np.int64)
        assert np.abs(got - want).max() <= 1 and (got == want).mean() >= 0.99


# ---- refused quantisation schemes -----------------------------------------------------------

def _conv_qdq(w_type, w_vals, block=None, act=TP.UINT8, scale_shape=()):
    inits = [helper.make_tensor("w", w_type, [4, 4, 3, 3], w_vals),
             numpy_helper.from_array(np.full(scale_shape, 0.01, np.float32), "ws"),
             numpy_helper.from_array(np.float32(0.05), "xs"), helper.make_tensor("xz", act, [], [0])]
    kw = {} if block is None else {"axis": 1, "block_size": block}
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q_in"),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xf"], name="dq_in"),
             helper.make_node("DequantizeLinear", ["w", "ws"], ["wf"], name="dq_weights", **kw),
             helper.make_node("Conv", ["xf", "wf"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "t", [_vi("x", TP.FLOAT, [1, 4, 6, 6])], [_vi("y", TP.FLOAT, [1, 4, 6, 6])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


INTS = [int(v) for v in np.random.default_rng(0).integers(-7, 8, 144)]


def _dynamic_scale():
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "xz"], ["xq"], name="q_dynamic"),
             helper.make_node("DequantizeLinear", ["xq", "s", "xz"], ["y"], name="dq_dynamic")]
    g = helper.make_graph(nodes, "t", [_vi("x", TP.FLOAT, [1, 4]), _vi("s", TP.FLOAT, [])], [_vi("y", TP.FLOAT, [1, 4])],
                          [numpy_helper.from_array(np.zeros((), np.uint8), "xz")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _integer_op(op):
    rng = np.random.default_rng(0)
    if op == "MatMulInteger":
        w, x, y, attrs = rng.integers(-5, 5, (6, 3)), [2, 6], [2, 3], {}
    else:
        w, x, y, attrs = rng.integers(-5, 5, (3, 2, 3, 3)), [1, 2, 5, 5], [1, 3, 3, 3], {}
    g = helper.make_graph([helper.make_node(op, ["x", "w"], ["y"], name="integer_op", **attrs)], "t",
                          [_vi("x", TP.UINT8, x)], [_vi("y", TP.INT32, y)], [_c("w", w, np.int8)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _qlinearconv_runtime_scale():
    rng = np.random.default_rng(0)
    inits = [_c("xz", 0, np.uint8), _c("w", rng.integers(-5, 5, (2, 2, 1, 1)), np.int8), _c("ws", 0.1, np.float32),
             _c("wz", 0, np.int8), _c("ys", 0.1, np.float32), _c("yz", 0, np.uint8)]
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"], ["y"], name="qconv_rt")
    g = helper.make_graph([node], "t", [_vi("x", TP.UINT8, [1, 2, 3, 3]), _vi("xs", TP.FLOAT, [])],
                          [_vi("y", TP.UINT8, [1, 2, 3, 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


REFUSED = {
    "int4": (lambda: _conv_qdq(TP.INT4, INTS), "dq_weights", "4-bit (int4)"),
    "uint4": (lambda: _conv_qdq(TP.UINT4, [abs(v) for v in INTS]), "dq_weights", "4-bit (uint4)"),
    "float8": (lambda: _conv_qdq(TP.FLOAT8E4M3FN, [float(v) for v in INTS]), "dq_weights", "float8_e4m3fn quantisation"),
    "int16-activations": (lambda: _conv_qdq(TP.INT8, INTS, act=TP.INT16), "q_in", "16-bit (int16) activations"),
    "blocked": (lambda: _conv_qdq(TP.INT8, INTS, block=2, scale_shape=(4, 2, 3, 3)), "dq_weights",
                "blocked quantisation (block_size=2)"),
    "runtime-scale": (_dynamic_scale, "q_dynamic", "scale 's' is not a constant"),
    "qlinearconv-runtime-scale": (_qlinearconv_runtime_scale, "qconv_rt", "input 'xs' is not a constant"),
    "matmulinteger": (lambda: _integer_op("MatMulInteger"), "integer_op", "dynamic quantisation"),
    "convinteger": (lambda: _integer_op("ConvInteger"), "integer_op", "dynamic quantisation"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_scheme_is_refused_with_node_and_reason(case, tmp_path):
    make, node, reason = REFUSED[case]
    path = save(make(), tmp_path)
    r = subprocess.run([sys.executable, "-m", "tinydeploy", "build", str(path), "-o", str(tmp_path / "b")],
                       capture_output=True, text=True, cwd=tmp_path)
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert node in last and reason in last, last


# ---- inspect ---------------------------------------------------------------------------------

def _inspect(path, cwd):
    return subprocess.run([sys.executable, "-m", "tinydeploy", "inspect", str(path)], capture_output=True, text=True,
                          cwd=cwd)


def test_inspect_shows_integer_operators_of_an_int8_model(tmp_path):
    from util import mlperf_model
    r = _inspect(mlperf_model("ic_resnet8_int8.onnx"), tmp_path)
    assert r.returncode == 0, r.stderr
    assert "QConv" in r.stdout and "QAdd" in r.stdout and "QSoftmax" in r.stdout, r.stdout
    assert "UNSUPPORTED" not in r.stdout and "all operators are supported" in r.stdout, r.stdout


def test_inspect_marks_refused_schemes(tmp_path):
    r = _inspect(save(_conv_qdq(TP.INT4, INTS), tmp_path), tmp_path)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "dq_weights" in ln)
    assert "UNSUPPORTED: 4-bit (int4) quantisation" in line, r.stdout
