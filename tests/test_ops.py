"""Every supported FP32 operator against onnxruntime, over a matrix of attributes.

Each case is a small single-operator model (or operator + fused activation) built with
onnx.helper and checked by `check_model`: generated C built with gcc and clang at -std=c99
-Wall -Wextra -Werror and with ASan+UBSan, run, and compared with onnxruntime.

To keep the file's runtime reasonable, the long parameter sweeps build with gcc only, except
for the cases listed as `full=True`, which use all three compiler variants; every operator has
at least one such case.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinydeploy.errors import TinydeployError
from tinydeploy.ops.elementwise import BINARY, UNARY
from tinydeploy.pipeline import compile_model
from tinydeploy.targets import get_target
from util import check_model, make_model, save

ALL = ("gcc", "clang", "gcc-asan-ubsan")
QUICK = ("gcc",)
I64_MAX = np.iinfo(np.int64).max


# ----------------------------------------------------------------------------- helpers

def rnd(shape, seed: int, lo: float | None = None, hi: float | None = None) -> np.ndarray:
    """Seeded float32 data: standard normal, or uniform in [lo, hi)."""
    rng = np.random.default_rng(seed)
    if lo is None:
        return rng.standard_normal(shape).astype(np.float32)
    return rng.uniform(lo, hi, shape).astype(np.float32)


def i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def build(nodes, inputs: dict, outputs: list[str], inits: dict | None = None, opset: int = 13) -> onnx.ModelProto:
    """A model whose graph inputs are float32 `inputs` (name -> shape) and whose initializers are
    `inits` (name -> numpy array). Output shapes are filled in by onnx shape inference, as an
    exporter would write them."""
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs.items()]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, inputs.get(n)) for n in outputs]
    inis = [numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()]
    m = make_model(nodes, ins, outs, inis, opset=opset)
    m = onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True)
    # Shape inference leaves an output listed twice untyped: copy the type.
    known = {v.name: v.type for v in [*m.graph.input, *m.graph.value_info, *m.graph.output]
             if v.type.tensor_type.HasField("shape")}
    for o in m.graph.output:
        if not o.type.tensor_type.HasField("shape") and o.name in known:
            o.type.CopyFrom(known[o.name])
        # an op unknown at this opset would also leave its output untyped
        assert o.type.tensor_type.HasField("shape"), f"invalid test model: no shape inferred for {o.name}"
    return m


def first_opset(op: str) -> int:
    """The lowest opset >= 13 that has `op` (HardSwish, for one, is new in opset 14)."""
    for v in range(13, onnx.defs.onnx_opset_version() + 1):
        try:
            onnx.defs.get_schema(op, v)
            return v
        except onnx.defs.SchemaError:
            continue
    raise AssertionError(f"onnx knows no operator {op}")


def case(*values, id: str, full: bool = False):
    """A parameter set; `full` cases are built with every compiler variant, the rest with gcc."""
    return pytest.param(*values, ALL if full else QUICK, id=id)


def layer_count(model: onnx.ModelProto, tmp_path) -> int:
    c = compile_model(save(model, tmp_path, "count.onnx"), get_target("host"))
    return sum(1 for k in c.kernels if k is not None)


# ----------------------------------------------------------------------------- Conv

CONV_CASES = [
    # x shape, w shape, attributes, bias
    case([1, 4, 6, 6], [8, 4, 1, 1], {}, True, id="k1x1", full=True),
    case([1, 3, 8, 8], [4, 3, 3, 3], {"pads": [1, 1, 1, 1]}, True, id="k3x3_pad1", full=True),
    case([1, 3, 8, 8], [4, 3, 3, 3], {}, False, id="k3x3_nopad_nobias"),
    case([1, 2, 9, 9], [3, 2, 5, 5], {"pads": [2, 2, 2, 2]}, True, id="k5x5_pad2"),
    case([1, 2, 9, 9], [3, 2, 5, 5], {}, False, id="k5x5_valid_nobias"),
    case([1, 3, 6, 8], [4, 3, 1, 3], {"pads": [0, 1, 0, 1]}, True, id="k1x3"),
    case([1, 3, 8, 6], [4, 3, 3, 1], {"pads": [1, 0, 1, 0]}, False, id="k3x1"),
    case([1, 2, 12, 5], [3, 2, 7, 1], {"pads": [3, 0, 3, 0]}, True, id="k7x1"),
    case([1, 3, 8, 8], [4, 3, 3, 3], {"strides": [2, 2], "pads": [1, 1, 1, 1]}, True, id="stride2", full=True),
    case([1, 3, 8, 8], [4, 3, 3, 3], {"strides": [2, 2]}, False, id="stride2_nopad"),
    case([1, 3, 8, 8], [4, 3, 3, 3], {"strides": [2, 1], "pads": [1, 1, 1, 1]}, True, id="stride2x1"),
    case([1, 2, 10, 10], [3, 2, 2, 2], {"strides": [3, 3]}, True, id="stride3_k2_skips_input"),
    case([1, 3, 9, 9], [4, 3, 3, 3], {"dilations": [2, 2], "pads": [2, 2, 2, 2]}, True, id="dilation2"),
    case([1, 3, 9, 9], [4, 3, 3, 3], {"dilations": [2, 1], "strides": [1, 2]}, False, id="dilation2x1_stride1x2"),
    case([1, 3, 7, 7], [4, 3, 3, 3], {"dilations": [2, 2], "strides": [2, 2], "pads": [1, 0, 2, 1]}, True,
         id="dilation2_stride2_asym_pads"),
    case([1, 3, 6, 6], [4, 3, 3, 3], {"pads": [0, 1, 2, 0]}, True, id="asym_pads", full=True),
    case([1, 3, 6, 6], [4, 3, 3, 3], {"pads": [2, 0, 0, 2]}, False, id="asym_pads2"),
    case([1, 2, 5, 5], [3, 2, 3, 3], {"pads": [3, 3, 3, 3]}, True, id="pads_wider_than_kernel"),
    case([1, 2, 3, 3], [3, 2, 5, 5], {"pads": [2, 2, 2, 2]}, True, id="kernel_larger_than_input"),
    case([1, 3, 7, 9], [4, 3, 3, 3], {"auto_pad": "SAME_UPPER"}, True, id="same_upper", full=True),
    case([1, 3, 7, 9], [4, 3, 3, 3], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, True, id="same_upper_stride2"),
    case([1, 3, 8, 8], [4, 3, 4, 4], {"auto_pad": "SAME_UPPER"}, True, id="same_upper_even_kernel"),
    case([1, 3, 7, 9], [4, 3, 3, 3], {"auto_pad": "SAME_LOWER"}, True, id="same_lower"),
    case([1, 3, 7, 9], [4, 3, 3, 3], {"auto_pad": "SAME_LOWER", "strides": [2, 2]}, False, id="same_lower_stride2"),
    case([1, 3, 8, 8], [4, 3, 4, 4], {"auto_pad": "SAME_LOWER"}, True, id="same_lower_even_kernel"),
    case([1, 3, 7, 9], [4, 3, 3, 3], {"auto_pad": "VALID"}, True, id="valid"),
    case([1, 3, 7, 9], [4, 3, 3, 3], {"auto_pad": "VALID", "strides": [2, 2]}, False, id="valid_stride2"),
    case([1, 4, 6, 6], [6, 2, 3, 3], {"group": 2, "pads": [1, 1, 1, 1]}, True, id="group2", full=True),
    case([1, 6, 5, 5], [3, 2, 1, 1], {"group": 3}, False, id="group3_1x1"),
    case([1, 4, 6, 6], [4, 1, 3, 3], {"group": 4, "pads": [1, 1, 1, 1]}, True, id="depthwise", full=True),
    case([1, 4, 7, 9], [4, 1, 3, 3], {"group": 4, "strides": [2, 2], "pads": [1, 1, 1, 1]}, False,
         id="depthwise_stride2"),
    case([1, 4, 6, 6], [8, 1, 3, 3], {"group": 4, "pads": [1, 1, 1, 1]}, True, id="depthwise_multiplier2"),
    case([1, 3, 10], [4, 3, 3], {"pads": [1, 1]}, True, id="conv1d", full=True),
    case([1, 3, 11], [4, 3, 3], {"strides": [2], "dilations": [2], "pads": [2, 1]}, False, id="conv1d_stride2_dil2"),
    case([1, 3, 11], [4, 3, 4], {"auto_pad": "SAME_UPPER"}, True, id="conv1d_same_upper"),
    case([1, 4, 9], [4, 1, 5], {"group": 4, "auto_pad": "SAME_LOWER"}, True, id="conv1d_depthwise_same_lower"),
    case([2, 3, 6, 6], [4, 3, 3, 3], {"pads": [1, 1, 1, 1]}, True, id="batch2", full=True),
    case([2, 4, 5, 5], [4, 2, 3, 3], {"group": 2}, True, id="batch2_group2"),
    case([1, 3, 7, 9], [5, 3, 3, 3], {"pads": [1, 1, 1, 1]}, True, id="odd_7x9", full=True),
    case([1, 3, 7, 9], [5, 3, 2, 4], {"strides": [2, 3]}, False, id="odd_7x9_k2x4_stride2x3"),
]


@pytest.mark.parametrize("xs, ws, attrs, bias, variants", CONV_CASES)
def test_conv(tmp_path, xs, ws, attrs, bias, variants):
    inits = {"w": rnd(ws, 1)}
    ins = ["x", "w"]
    if bias:
        inits["b"] = rnd([ws[0]], 2)
        ins.append("b")
    m = build([helper.make_node("Conv", ins, ["y"], **attrs)], {"x": xs}, ["y"], inits)
    check_model(m, tmp_path, variants=variants)


def test_conv_explicit_kernel_shape(tmp_path):
    m = build([helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
              {"x": [1, 2, 5, 5]}, ["y"], {"w": rnd([3, 2, 3, 3], 1), "b": rnd([3], 2)})
    check_model(m, tmp_path, variants=QUICK)


# ----------------------------------------------------------------------------- Gemm / MatMul

GEMM_CASES = [
    # A shape (runtime), B shape (constant), C shape or None, attributes
    case([3, 5], [5, 4], [4], {}, id="C_vector", full=True),
    case([3, 5], [5, 4], None, {}, id="no_C"),
    case([1, 16], [16, 10], [10], {}, id="fc_M1"),
    case([3, 5], [4, 5], [4], {"transB": 1}, id="transB", full=True),
    case([3, 5], [5, 4], [4], {"alpha": 0.5}, id="alpha"),
    case([3, 5], [5, 4], [4], {"beta": 2.0}, id="beta"),
    case([3, 5], [4, 5], [3, 4], {"alpha": 0.25, "beta": -1.5, "transB": 1}, id="alpha_beta_transB_C_MxN"),
    case([3, 5], [5, 4], [], {}, id="C_scalar"),
    case([3, 5], [5, 4], [1], {"beta": 3.0}, id="C_1"),
    case([3, 5], [5, 4], [3, 4], {}, id="C_MxN", full=True),
    case([3, 5], [5, 4], [1, 4], {}, id="C_1xN"),
    case([3, 5], [5, 4], [3, 1], {}, id="C_Mx1"),
    case([1, 5], [5, 4], [1, 4], {"beta": 0.5}, id="M1_C_1xN"),
]


@pytest.mark.parametrize("a_shape, b_shape, c_shape, attrs, variants", GEMM_CASES)
def test_gemm(tmp_path, a_shape, b_shape, c_shape, attrs, variants):
    inits = {"B": rnd(b_shape, 1)}
    ins = ["A", "B"]
    if c_shape is not None:
        inits["C"] = rnd(c_shape, 2)
        ins.append("C")
    m = build([helper.make_node("Gemm", ins, ["y"], **attrs)], {"A": a_shape}, ["y"], inits)
    check_model(m, tmp_path, variants=variants)


@pytest.mark.parametrize("attrs", [{"transA": 1}, {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0}],
                         ids=["transA", "transA_transB_alpha_beta"])
def test_gemm_trans_a_constant_a(tmp_path, attrs):
    """transA needs a constant A; the (constant) product is then added to a runtime tensor."""
    b_shape = [4, 5] if attrs.get("transB") else [5, 4]
    m = build([helper.make_node("Gemm", ["A", "B", "C"], ["p"], **attrs),
               helper.make_node("Add", ["p", "x"], ["y"])],
              {"x": [3, 4]}, ["y"], {"A": rnd([5, 3], 1), "B": rnd(b_shape, 2), "C": rnd([4], 3)})
    check_model(m, tmp_path)


MATMUL_CONST_CASES = [
    # x shape (runtime), W shape (constant)
    case([3, 5], [5, 4], id="2d", full=True),
    case([1, 8], [8, 3], id="M1"),
    case([2, 3, 5], [5, 4], id="3d_x_2d_weights"),
    case([5], [5, 4], id="1d_x"),
    case([3, 5], [5], id="1d_weights"),
    case([2, 3, 5], [2, 5, 4], id="3d_weights", full=True),
]


@pytest.mark.parametrize("xs, ws, variants", MATMUL_CONST_CASES)
def test_matmul_const_weights(tmp_path, xs, ws, variants):
    m = build([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": xs}, ["y"], {"w": rnd(ws, 1)})
    check_model(m, tmp_path, variants=variants)


MATMUL_CASES = [
    # a shape, b shape (both runtime)
    case([3, 5], [5, 4], id="2d", full=True),
    case([2, 3, 5], [2, 5, 4], id="batched_3d", full=True),
    case([2, 3, 5], [5, 4], id="3d_x_2d"),
    case([3, 5], [2, 5, 4], id="2d_x_3d"),
    case([1, 3, 5], [2, 5, 4], id="3d_broadcast_batch1"),
    case([2, 2, 3, 5], [2, 2, 5, 4], id="batched_4d"),
    case([2, 1, 3, 5], [1, 3, 5, 2], id="4d_broadcast_both", full=True),
    case([2, 3, 3, 5], [3, 5, 4], id="4d_x_3d"),
    case([5], [5, 4], id="1d_x_2d"),
    case([3, 5], [5], id="2d_x_1d"),
    case([5], [5], id="1d_x_1d_dot", full=True),
    case([2, 3, 5], [5], id="3d_x_1d"),
    case([5], [2, 5, 4], id="1d_x_3d"),
]


@pytest.mark.parametrize("a_shape, b_shape, variants", MATMUL_CASES)
def test_matmul_runtime(tmp_path, a_shape, b_shape, variants):
    m = build([helper.make_node("MatMul", ["a", "b"], ["y"])], {"a": a_shape, "b": b_shape}, ["y"])
    check_model(m, tmp_path, variants=variants)


# ----------------------------------------------------------------------------- unary

X_UNARY = [2, 3, 4, 5]

# Inputs in each op's valid domain (default: standard normal).
UNARY_DOMAINS = {
    "Log": (0.05, 10.0),
    "Sqrt": (0.0, 10.0),
    "Reciprocal": (0.2, 5.0),
    "Softplus": (-30.0, 30.0),      # both sides of the large-input branch
    "Exp": (-10.0, 10.0),
    "Erf": (-3.0, 3.0),
    "Sin": (-7.0, 7.0),
    "Cos": (-7.0, 7.0),
    "Tanh": (-5.0, 5.0),
    "Sigmoid": (-10.0, 10.0),
    "HardSigmoid": (-5.0, 5.0),
    "HardSwish": (-5.0, 5.0),
    "Floor": (-5.0, 5.0),
    "Ceil": (-5.0, 5.0),
    "Elu": (-5.0, 5.0),
    "Selu": (-5.0, 5.0),
}


def unary_feeds(op: str, shape) -> dict | None:
    dom = UNARY_DOMAINS.get(op)
    return None if dom is None else {"x": rnd(shape, 7, *dom)}


def _sign_flipped_reciprocal_feeds(shape):
    x = rnd(shape, 7, 0.2, 5.0)
    return {"x": np.where(rnd(shape, 8) < 0, -x, x).astype(np.float32)}


UNARY_EXTRA_ATTRS = {
    "HardSigmoid": {"alpha": 0.3, "beta": 0.4},
    "Elu": {"alpha": 0.5},
    "Selu": {"alpha": 1.5, "gamma": 2.0},
}


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(tmp_path, op):
    """Every op in elementwise.UNARY with default attributes, all compiler variants."""
    m = build([helper.make_node(op, ["x"], ["y"])], {"x": X_UNARY}, ["y"], opset=first_opset(op))
    feeds = _sign_flipped_reciprocal_feeds(X_UNARY) if op == "Reciprocal" else unary_feeds(op, X_UNARY)
    check_model(m, tmp_path, feeds=feeds)


@pytest.mark.parametrize("op", sorted(UNARY_EXTRA_ATTRS))
def test_unary_attributes(tmp_path, op):
    m = build([helper.make_node(op, ["x"], ["y"], **UNARY_EXTRA_ATTRS[op])], {"x": X_UNARY}, ["y"],
              opset=first_opset(op))
    check_model(m, tmp_path, feeds=unary_feeds(op, X_UNARY), variants=QUICK)


ACTIVATION_CASES = [
    # op, attributes, extra constant inputs (name -> value; "" = omitted), opset
    case("Relu", {}, None, 13, id="relu", full=True),
    case("LeakyRelu", {}, None, 13, id="leakyrelu_default", full=True),
    case("LeakyRelu", {"alpha": 0.2}, None, 13, id="leakyrelu_0.2"),
    case("Clip", {}, {"min": -0.5}, 13, id="clip_min_only", full=True),
    case("Clip", {}, {"": None, "max": 0.7}, 13, id="clip_max_only"),
    case("Clip", {}, {"min": -0.5, "max": 0.7}, 13, id="clip_both"),
    case("Clip", {}, {"min": 0.0, "max": 6.0}, 13, id="clip_relu6"),
    case("Clip", {}, {}, 13, id="clip_no_bounds"),
    case("Clip", {}, {"min": 1.0, "max": -1.0}, 13, id="clip_min_above_max"),
    case("Clip", {"min": -0.5, "max": 0.7}, None, 6, id="clip_opset6_attributes"),
    case("Clip", {"min": -0.5}, None, 6, id="clip_opset6_min_attribute"),
]


@pytest.mark.parametrize("op, attrs, bounds, opset, variants", ACTIVATION_CASES)
def test_activation(tmp_path, op, attrs, bounds, opset, variants):
    ins, inits = ["x"], {}
    for name, v in (bounds or {}).items():
        ins.append(name)
        if name:
            inits[name] = np.asarray(v, dtype=np.float32)
    m = build([helper.make_node(op, ins, ["y"], **attrs)], {"x": X_UNARY}, ["y"], inits, opset=opset)
    check_model(m, tmp_path, feeds={"x": rnd(X_UNARY, 7, -8.0, 8.0)}, variants=variants)


def test_clip_bounds_from_constant_nodes(tmp_path):
    nodes = [helper.make_node("Constant", [], ["lo"], value=numpy_helper.from_array(np.float32(-1.0))),
             helper.make_node("Constant", [], ["hi"], value=numpy_helper.from_array(np.float32(1.0))),
             helper.make_node("Clip", ["x", "lo", "hi"], ["y"])]
    check_model(build(nodes, {"x": X_UNARY}, ["y"]), tmp_path, variants=QUICK)


# ----------------------------------------------------------------------------- fusion / BatchNorm

def _bn_params(c: int, seed: int) -> dict:
    return {"bn_scale": rnd([c], seed), "bn_bias": rnd([c], seed + 1), "bn_mean": rnd([c], seed + 2),
            "bn_var": rnd([c], seed + 3, 0.5, 2.0)}


BN_INPUTS = ["bn_scale", "bn_bias", "bn_mean", "bn_var"]


def fusion_model(kind: str) -> onnx.ModelProto:
    """The models of the fusion matrix; each is 2 or 3 ONNX nodes that become one layer."""
    conv_w = {"w": rnd([4, 3, 3, 3], 1), "b": rnd([4], 2)}
    conv = helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1])
    x4 = {"x": [1, 3, 6, 6]}
    if kind == "conv_relu":
        return build([conv, helper.make_node("Relu", ["c"], ["y"])], x4, ["y"], conv_w)
    if kind == "conv_clip06":
        return build([conv, helper.make_node("Clip", ["c", "lo", "hi"], ["y"])], x4, ["y"],
                     {**conv_w, "lo": np.float32(0.0), "hi": np.float32(6.0)})
    if kind == "conv_clip_max_only":
        return build([conv, helper.make_node("Clip", ["c", "", "hi"], ["y"])], x4, ["y"], {**conv_w, "hi": np.float32(0.5)})
    if kind == "conv1d_bn_relu":
        return build([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1]),
                      helper.make_node("BatchNormalization", ["c", *BN_INPUTS], ["n"]),
                      helper.make_node("Relu", ["n"], ["y"])], {"x": [1, 3, 9]}, ["y"],
                     {"w": rnd([4, 3, 3], 1), **_bn_params(4, 10)})
    if kind == "gemm_transB_C_1xN_bn":
        return build([helper.make_node("Gemm", ["x", "B", "C"], ["g"], transB=1, alpha=2.0),
                      helper.make_node("BatchNormalization", ["g", *BN_INPUTS], ["y"])],
                     {"x": [3, 6]}, ["y"], {"B": rnd([5, 6], 1), "C": rnd([1, 5], 2), **_bn_params(5, 10)})
    if kind == "conv_leakyrelu":
        return build([conv, helper.make_node("LeakyRelu", ["c"], ["y"], alpha=0.1)], x4, ["y"], conv_w)
    if kind == "depthwise_clip06":
        dw = helper.make_node("Conv", ["x", "w"], ["c"], group=3, pads=[1, 1, 1, 1])
        return build([dw, helper.make_node("Clip", ["c", "lo", "hi"], ["y"])], x4, ["y"],
                     {"w": rnd([3, 1, 3, 3], 1), "lo": np.float32(0.0), "hi": np.float32(6.0)})
    if kind == "gemm_leakyrelu":
        return build([helper.make_node("Gemm", ["x", "B", "C"], ["g"], transB=1),
                      helper.make_node("LeakyRelu", ["g"], ["y"], alpha=0.2)],
                     {"x": [2, 6]}, ["y"], {"B": rnd([5, 6], 1), "C": rnd([5], 2)})
    if kind == "matmul_relu":
        return build([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
                     {"x": [3, 6]}, ["y"], {"w": rnd([6, 4], 1)})
    if kind == "batched_matmul_relu":
        return build([helper.make_node("MatMul", ["a", "b"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
                     {"a": [2, 3, 4], "b": [2, 4, 5]}, ["y"])
    if kind == "add_relu":
        return build([helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
                     {"a": [1, 4, 5, 5], "b": [1, 4, 5, 5]}, ["y"])
    if kind == "sub_clip":
        return build([helper.make_node("Sub", ["a", "b"], ["s"]), helper.make_node("Clip", ["s", "lo", "hi"], ["y"])],
                     {"a": [2, 3, 4], "b": [4]}, ["y"], {"lo": np.float32(-0.5), "hi": np.float32(0.5)})
    if kind == "mul_leakyrelu":
        return build([helper.make_node("Mul", ["a", "b"], ["s"]), helper.make_node("LeakyRelu", ["s"], ["y"])],
                     {"a": [2, 3, 4], "b": [3, 1]}, ["y"])
    if kind == "conv_bn":
        return build([conv, helper.make_node("BatchNormalization", ["c", *BN_INPUTS], ["y"])], x4, ["y"],
                     {**conv_w, **_bn_params(4, 10)})
    if kind == "conv_nobias_bn_relu":
        conv_nb = helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1])
        return build([conv_nb, helper.make_node("BatchNormalization", ["c", *BN_INPUTS], ["n"], epsilon=1e-3),
                      helper.make_node("Relu", ["n"], ["y"])], x4, ["y"], {"w": conv_w["w"], **_bn_params(4, 10)})
    if kind == "conv_bn_relu":
        return build([conv, helper.make_node("BatchNormalization", ["c", *BN_INPUTS], ["n"]),
                      helper.make_node("Relu", ["n"], ["y"])], x4, ["y"], {**conv_w, **_bn_params(4, 10)})
    if kind == "gemm_bn":
        return build([helper.make_node("Gemm", ["x", "B", "C"], ["g"], alpha=0.5, beta=2.0),
                      helper.make_node("BatchNormalization", ["g", *BN_INPUTS], ["y"])],
                     {"x": [3, 6]}, ["y"], {"B": rnd([6, 5], 1), "C": rnd([5], 2), **_bn_params(5, 10)})
    if kind == "bn_relu":
        return build([helper.make_node("BatchNormalization", ["x", *BN_INPUTS], ["n"]),
                      helper.make_node("Relu", ["n"], ["y"])], {"x": [2, 4, 3, 5]}, ["y"], _bn_params(4, 10))
    raise KeyError(kind)


FUSION_CASES = ["conv_relu", "conv_clip06", "conv_clip_max_only", "conv_leakyrelu", "depthwise_clip06", "gemm_leakyrelu",
                "matmul_relu", "batched_matmul_relu", "add_relu", "sub_clip", "mul_leakyrelu", "conv_bn",
                "conv_nobias_bn_relu", "conv_bn_relu", "conv1d_bn_relu", "gemm_bn", "gemm_transB_C_1xN_bn", "bn_relu"]


@pytest.mark.parametrize("kind", FUSION_CASES)
def test_fusion(tmp_path, kind):
    """Fused graphs compute what onnxruntime computes and are one layer where they were 2 or 3."""
    m = fusion_model(kind)
    assert layer_count(m, tmp_path) == 1 < len(m.graph.node)
    check_model(m, tmp_path)


def test_no_fusion_when_intermediate_is_an_output(tmp_path):
    """Conv's output is also a graph output, so the Relu must stay a separate layer."""
    conv = helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1])
    bn = helper.make_node("BatchNormalization", ["c", *BN_INPUTS], ["n"])
    m = build([conv, bn, helper.make_node("Relu", ["n"], ["y"])], {"x": [1, 3, 6, 6]}, ["n", "y"],
              {"w": rnd([4, 3, 3, 3], 1), **_bn_params(4, 10)})
    assert layer_count(m, tmp_path) == 2
    check_model(m, tmp_path, variants=QUICK)


def test_no_fusion_when_intermediate_has_two_consumers(tmp_path):
    conv = helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1])
    m = build([conv, helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Sigmoid", ["c"], ["s"]),
               helper.make_node("Add", ["r", "s"], ["y"])], {"x": [1, 3, 6, 6]}, ["y"], {"w": rnd([4, 3, 3, 3], 1)})
    assert layer_count(m, tmp_path) == 4
    check_model(m, tmp_path, variants=QUICK)


BIAS_ADD_CASES = [
    # producer, constant shape, constant first, expected layers
    case("Conv", [4, 1, 1], False, 1, id="conv_plus_c11"),
    case("Conv", [1, 4, 1, 1], True, 1, id="c1c11_plus_conv"),
    case("Conv", [1], False, 1, id="conv_plus_scalar"),
    case("Conv", [4], False, 2, id="conv_plus_row_of_width_not_folded"),
    case("Conv", [1, 1, 4], False, 2, id="conv_plus_per_column_not_folded"),
    case("MatMul", [4], False, 1, id="matmul_plus_row"),
    case("MatMul", [1, 4], True, 1, id="1xN_plus_matmul"),
    case("MatMul", [4, 1], False, 2, id="matmul_plus_column_not_folded"),
    case("MatMul", [4, 4], False, 2, id="matmul_plus_matrix_not_folded"),
]


@pytest.mark.parametrize("prod, c_shape, const_first, layers, variants", BIAS_ADD_CASES)
def test_bias_add_folding(tmp_path, prod, c_shape, const_first, layers, variants):
    """Add of a constant after a bias-free Conv or a MatMul becomes the layer's bias only when the
    constant is per output channel. The outputs are 4 channels wide and 4 columns wide, so a
    constant along the wrong axis has the right size but must not be folded."""
    if prod == "Conv":
        first = helper.make_node("Conv", ["x", "w"], ["p"], pads=[1, 1, 1, 1])
        xs, inits = [1, 3, 4, 4], {"w": rnd([4, 3, 3, 3], 1)}
    else:
        first = helper.make_node("MatMul", ["x", "w"], ["p"])
        xs, inits = [4, 6], {"w": rnd([6, 4], 1)}
    inits["c"] = rnd(c_shape, 2)
    add = helper.make_node("Add", ["c", "p"] if const_first else ["p", "c"], ["a"])
    m = build([first, add, helper.make_node("Relu", ["a"], ["y"])], {"x": xs}, ["y"], inits)
    assert layer_count(m, tmp_path) == layers
    check_model(m, tmp_path, variants=variants)


BN_CASES = [
    case([1, 4, 5, 5], {}, id="nchw", full=True),
    case([2, 4, 3, 5], {"epsilon": 1e-2}, id="batch2_epsilon"),
    case([2, 4], {}, id="2d"),
    case([1, 4, 7], {}, id="3d"),
]


@pytest.mark.parametrize("xs, attrs, variants", BN_CASES)
def test_batchnorm_standalone(tmp_path, xs, attrs, variants):
    m = build([helper.make_node("BatchNormalization", ["x", *BN_INPUTS], ["y"], **attrs)], {"x": xs}, ["y"],
              _bn_params(xs[1], 20))
    check_model(m, tmp_path, variants=variants)


# ----------------------------------------------------------------------------- pooling

POOL_CASES = [
    # op, x shape, attributes
    case("MaxPool", [1, 3, 8, 8], {"kernel_shape": [2, 2], "strides": [2, 2]}, id="max_k2_s2", full=True),
    case("MaxPool", [1, 3, 7, 9], {"kernel_shape": [3, 3]}, id="max_k3_s1"),
    case("MaxPool", [1, 3, 7, 9], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
         id="max_k3_s2_pad1"),
    case("MaxPool", [1, 3, 7, 9], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
         id="max_k3_s2_ceil"),
    case("MaxPool", [1, 3, 8, 8], {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1, "pads": [1, 1, 1, 1]},
         id="max_k2_s2_pad1_ceil"),
    case("MaxPool", [1, 2, 8, 9], {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 0, 1]},
         id="max_k3x2_s2x1_asym_pads"),
    case("MaxPool", [1, 2, 9, 9], {"kernel_shape": [3, 3], "dilations": [2, 2]}, id="max_dilation2", full=True),
    case("MaxPool", [1, 2, 10, 9], {"kernel_shape": [2, 3], "dilations": [2, 1], "strides": [2, 2],
                                    "pads": [1, 1, 1, 1], "ceil_mode": 1}, id="max_dilation2x1_ceil_pads"),
    case("MaxPool", [1, 3, 7, 9], {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
         id="max_same_upper"),
    case("MaxPool", [1, 3, 8, 8], {"kernel_shape": [2, 2], "auto_pad": "SAME_LOWER"}, id="max_same_lower"),
    case("MaxPool", [1, 3, 7, 9], {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "VALID"}, id="max_valid"),
    case("MaxPool", [2, 3, 11], {"kernel_shape": [3], "strides": [2]}, id="max_1d", full=True),
    case("MaxPool", [1, 3, 10], {"kernel_shape": [2], "strides": [2], "pads": [1, 1], "ceil_mode": 1},
         id="max_1d_pad_ceil"),
    case("AveragePool", [1, 3, 8, 8], {"kernel_shape": [2, 2], "strides": [2, 2]}, id="avg_k2_s2", full=True),
    case("AveragePool", [1, 3, 7, 9], {"kernel_shape": [3, 3]}, id="avg_k3_s1"),
    case("AveragePool", [1, 3, 7, 9], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, id="avg_pad1_exclude_pad",
         full=True),
    case("AveragePool", [1, 3, 7, 9], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
         id="avg_pad1_include_pad", full=True),
    case("AveragePool", [1, 3, 7, 9], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
         id="avg_ceil"),
    case("AveragePool", [1, 3, 7, 9], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1,
                                       "pads": [1, 1, 1, 1]}, id="avg_ceil_pad1_exclude_pad"),
    case("AveragePool", [1, 3, 7, 9], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1,
                                       "pads": [1, 1, 1, 1], "count_include_pad": 1}, id="avg_ceil_pad1_include_pad"),
    case("AveragePool", [1, 3, 8, 8], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1,
                                       "count_include_pad": 1}, id="avg_ceil_nopad_include_pad"),
    case("AveragePool", [1, 2, 8, 9], {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [2, 0, 0, 1],
                                       "count_include_pad": 1}, id="avg_asym_pads_include_pad"),
    case("AveragePool", [1, 2, 8, 9], {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [2, 0, 0, 1]},
         id="avg_asym_pads_exclude_pad"),
    case("AveragePool", [1, 3, 7, 9], {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
         id="avg_same_upper"),
    case("AveragePool", [1, 3, 7, 9], {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER",
                                       "count_include_pad": 1}, id="avg_same_lower_include_pad"),
    case("AveragePool", [2, 3, 11], {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}, id="avg_1d",
         full=True),
    case("AveragePool", [1, 3, 11], {"kernel_shape": [4], "strides": [3], "pads": [1, 2], "count_include_pad": 1,
                                     "ceil_mode": 1}, id="avg_1d_include_pad_ceil_window_in_padding"),
    # one window over the whole plane: lowered to the global pool (8-lane sums, tail)
    case("AveragePool", [2, 3, 25, 5], {"kernel_shape": [25, 5]}, id="avg_whole_plane_125", full=True),
    case("AveragePool", [1, 4, 2, 3], {"kernel_shape": [2, 3], "strides": [2, 2]}, id="avg_whole_plane_6"),
    case("MaxPool", [1, 3, 4, 4], {"kernel_shape": [4, 4]}, id="max_whole_plane"),
    # ceil_mode windows that would start in the right padding are dropped (ONNX spec, onnxruntime)
    case("MaxPool", [1, 3, 11], {"kernel_shape": [4], "strides": [3], "pads": [1, 2], "ceil_mode": 1},
         id="max_1d_ceil_window_in_padding"),
    case("MaxPool", [1, 2, 7, 9], {"kernel_shape": [2, 2], "strides": [3, 3], "pads": [0, 0, 1, 1], "ceil_mode": 1},
         id="max_ceil_window_in_padding", full=True),
    case("AveragePool", [1, 2, 7, 9], {"kernel_shape": [2, 2], "strides": [3, 3], "pads": [0, 0, 1, 1],
                                       "ceil_mode": 1, "count_include_pad": 1}, id="avg_ceil_window_in_padding"),
    case("AveragePool", [1, 2, 7, 7], {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
         id="avg_ceil_partial_window_no_pads"),
]


@pytest.mark.parametrize("op, xs, attrs, variants", POOL_CASES)
def test_pool(tmp_path, op, xs, attrs, variants):
    m = build([helper.make_node(op, ["x"], ["y"], **attrs)], {"x": xs}, ["y"])
    check_model(m, tmp_path, variants=variants)


def test_pool_ceil_window_in_padding_on_one_axis_only_is_refused(tmp_path):
    """Height needs ceil_mode (its extra window starts inside the input), width's extra window
    starts in the padding: no ceil_mode value gives onnxruntime's shape; refused, not miscomputed."""
    m = build([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 3], pads=[0, 0, 0, 1],
                                ceil_mode=1)], {"x": [1, 1, 7, 9]}, ["y"])
    with pytest.raises(TinydeployError, match="right padding"):
        compile_model(save(m, tmp_path), get_target("host"))


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("xs", [[1, 3, 5, 7], [2, 4, 6, 6], [1, 4, 10]], ids=["1x3x5x7", "2x4x6x6", "1d_1x4x10"])
def test_global_pool(tmp_path, op, xs):
    m = build([helper.make_node(op, ["x"], ["y"])], {"x": xs}, ["y"])
    check_model(m, tmp_path, variants=ALL if xs == [1, 3, 5, 7] else QUICK)


# ----------------------------------------------------------------------------- binary broadcasting

# the bidirectionally broadcasting binary ops of the registry (PRelu's slope broadcasts one way:
# test_prelu), and the variadic Sum
BINARY_OPS = sorted(op for op in BINARY if op != "PRelu") + ["Sum"]

BROADCASTS = [
    # id, a shape, b shape
    ("same_shape", [2, 3, 4, 5], [2, 3, 4, 5]),
    ("scalar", [2, 3, 4], []),
    ("scalar_first", [], [2, 3, 4]),
    ("per_channel", [1, 4, 5, 6], [4, 1, 1]),
    ("row", [4, 5], [5]),
    ("column", [4, 5], [4, 1]),
    ("rank_mismatch", [2, 3, 4], [3, 4]),
    ("rank_mismatch_first_smaller", [4], [2, 3, 4]),
    ("both_broadcast", [3, 1], [1, 4]),
    ("both_broadcast_4d", [2, 1, 4, 1], [3, 1, 5]),
    ("middle_axis", [2, 3, 4], [2, 1, 4]),
    ("all_ones", [1, 1], [1]),
]


def binary_feeds(op: str, names_shapes: dict) -> dict | None:
    """Div needs divisors away from zero; Pow needs positive bases and moderate exponents."""
    if op == "Div":
        (a, sa), (b, sb) = names_shapes.items()
        mag = rnd(sb, 11, 0.5, 2.0)
        return {a: rnd(sa, 10), b: np.where(rnd(sb, 12) < 0, -mag, mag).astype(np.float32)}
    if op == "Pow":
        (a, sa), (b, sb) = names_shapes.items()
        return {a: rnd(sa, 10, 0.1, 3.0), b: rnd(sb, 11, -2.0, 2.0)}
    return None


@pytest.mark.parametrize("bid, a_shape, b_shape", BROADCASTS, ids=[b[0] for b in BROADCASTS])
@pytest.mark.parametrize("op", BINARY_OPS)
def test_binary(tmp_path, op, bid, a_shape, b_shape):
    m = build([helper.make_node(op, ["a", "b"], ["y"])], {"a": a_shape, "b": b_shape}, ["y"])
    feeds = binary_feeds(op, {"a": a_shape, "b": b_shape})
    check_model(m, tmp_path, feeds=feeds, variants=ALL if bid in ("same_shape", "both_broadcast") else QUICK)


@pytest.mark.parametrize("const_first", [False, True], ids=["x_op_const", "const_op_x"])
@pytest.mark.parametrize("op", BINARY_OPS)
def test_binary_constant_operand(tmp_path, op, const_first):
    c = rnd([4, 1, 1], 3, 0.5, 2.0) if op in ("Div", "Pow") else rnd([4, 1, 1], 3)
    ins = ["c", "x"] if const_first else ["x", "c"]
    m = build([helper.make_node(op, ins, ["y"])], {"x": [1, 4, 3, 5]}, ["y"], {"c": c})
    feeds = {"x": rnd([1, 4, 3, 5], 4, 0.5, 2.0)} if op == "Pow" else None
    check_model(m, tmp_path, feeds=feeds, variants=QUICK)


def test_pow_square_constant_exponent(tmp_path):
    m = build([helper.make_node("Pow", ["x", "two"], ["y"])], {"x": [2, 3, 4]}, ["y"], {"two": np.float32(2.0)})
    check_model(m, tmp_path, variants=QUICK)


def test_binary_same_tensor_twice(tmp_path):
    m = build([helper.make_node("Mul", ["x", "x"], ["y"])], {"x": [2, 3, 4]}, ["y"])
    check_model(m, tmp_path)


def test_binary_scalar_constant_node(tmp_path):
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.float32(0.5))),
             helper.make_node("Mul", ["x", "k"], ["y"])]
    check_model(build(nodes, {"x": [2, 3, 4]}, ["y"]), tmp_path, variants=QUICK)


VARIADIC_CASES = [
    case("Sum", [[2, 3, 4], [4], [3, 1]], id="sum3_broadcast", full=True),
    case("Max", [[2, 3, 4], [4], [3, 1]], id="max3_broadcast", full=True),
    case("Min", [[2, 3, 4], [4], [3, 1]], id="min3_broadcast", full=True),
    case("Sum", [[3, 4], [3, 4], [3, 4], [3, 4]], id="sum4_same"),
    case("Max", [[1, 4], [3, 1], [3, 4]], id="max3_outer_product"),
    case("Sum", [[2, 3]], id="sum1"),
    case("Max", [[2, 3]], id="max1"),
    case("Min", [[2, 3], [2, 3]], id="min2"),
]


@pytest.mark.parametrize("op, shapes, variants", VARIADIC_CASES)
def test_variadic(tmp_path, op, shapes, variants):
    names = [f"x{k}" for k in range(len(shapes))]
    m = build([helper.make_node(op, names, ["y"])], dict(zip(names, shapes)), ["y"])
    check_model(m, tmp_path, variants=variants)


def test_variadic_with_constant_operand(tmp_path):
    m = build([helper.make_node("Sum", ["x", "c", "z"], ["y"])], {"x": [2, 3], "z": [3]}, ["y"],
              {"c": rnd([2, 1], 5)})
    check_model(m, tmp_path, variants=QUICK)


# ----------------------------------------------------------------------------- Concat / Split / Slice

CONCAT_CASES = [
    case(0, [[1, 3, 4, 5], [2, 3, 4, 5]], id="axis0", full=True),
    case(1, [[2, 1, 4, 5], [2, 3, 4, 5], [2, 2, 4, 5]], id="axis1_three_inputs", full=True),
    case(2, [[2, 3, 1, 5], [2, 3, 4, 5]], id="axis2"),
    case(3, [[2, 3, 4, 2], [2, 3, 4, 5]], id="axis3"),
    case(-1, [[2, 3, 4, 2], [2, 3, 4, 5]], id="axis_neg1"),
    case(-3, [[2, 2, 4, 5], [2, 3, 4, 5]], id="axis_neg3"),
    case(1, [[3, 2], [3, 5]], id="2d_axis1"),
    case(0, [[4], [2], [3]], id="1d"),
]


@pytest.mark.parametrize("axis, shapes, variants", CONCAT_CASES)
def test_concat(tmp_path, axis, shapes, variants):
    names = [f"x{k}" for k in range(len(shapes))]
    m = build([helper.make_node("Concat", names, ["y"], axis=axis)], dict(zip(names, shapes)), ["y"])
    check_model(m, tmp_path, variants=variants)


def test_concat_with_empty_input(tmp_path):
    m = build([helper.make_node("Concat", ["x", "e", "z"], ["y"], axis=1)], {"x": [2, 3], "z": [2, 1]}, ["y"],
              {"e": np.zeros([2, 0], np.float32)})
    check_model(m, tmp_path, variants=QUICK)


def test_concat_with_constant_and_same_input_twice(tmp_path):
    m = build([helper.make_node("Concat", ["x", "c", "x"], ["y"], axis=1)], {"x": [2, 3, 4]}, ["y"],
              {"c": rnd([2, 2, 4], 1)})
    check_model(m, tmp_path, variants=QUICK)


SPLIT_CASES = [
    # x shape, attributes, split sizes (input form) or None, number of outputs, opset
    case([2, 6, 4], {"axis": 1}, [1, 2, 3], 3, 13, id="opset13_explicit_sizes", full=True),
    case([2, 3, 6], {"axis": 2}, None, 3, 13, id="opset13_equal", full=True),
    case([2, 3, 6], {"axis": -1}, None, 2, 13, id="opset13_equal_axis_neg1"),
    case([4, 3], {}, [3, 1], 2, 13, id="opset13_axis0_default"),
    case([2, 6, 4], {"axis": 1, "num_outputs": 3}, None, 3, 18, id="opset18_num_outputs", full=True),
    case([2, 7, 4], {"axis": 1, "num_outputs": 3}, None, 3, 18, id="opset18_num_outputs_uneven"),
    case([2, 3, 8], {"axis": -1}, [5, 3], 2, 18, id="opset18_explicit_sizes"),
    case([2, 6, 4], {"axis": 1, "split": [4, 2]}, None, 2, 11, id="opset11_split_attribute"),
]


@pytest.mark.parametrize("xs, attrs, sizes, n_out, opset, variants", SPLIT_CASES)
def test_split(tmp_path, xs, attrs, sizes, n_out, opset, variants):
    outs = [f"y{k}" for k in range(n_out)]
    ins, inits = ["x"], {}
    if sizes is not None:
        ins.append("split")
        inits["split"] = i64(sizes)
    m = build([helper.make_node("Split", ins, outs, **attrs)], {"x": xs}, outs, inits, opset=opset)
    check_model(m, tmp_path, variants=variants)


def test_split_with_unused_output(tmp_path):
    """Only outputs 0 and 2 are used; the kernel still writes output 1 somewhere harmless."""
    m = build([helper.make_node("Split", ["x", "split"], ["a", "b", "c"], axis=1),
               helper.make_node("Relu", ["c"], ["r"])], {"x": [2, 6, 3]}, ["a", "r"], {"split": i64([2, 3, 1])})
    check_model(m, tmp_path)


X_SLICE = [4, 6, 8]
SLICE_CASES = [
    # starts, ends, axes, steps (None = omitted input)
    case([1], [3], [0], None, id="axis0", full=True),
    case([-3], [-1], [2], None, id="negative_starts_ends", full=True),
    case([0], [8], [2], [2], id="step2", full=True),
    case([1, 1], [6, 7], [1, 2], [2, 3], id="step2_step3"),
    case([-1], [-I64_MAX], [1], [-1], id="step_neg1_reverse", full=True),
    case([5], [0], [1], [-2], id="step_neg2"),
    case([-2, 3], [-I64_MAX, 0], [0, 2], [-1, -1], id="reverse_two_axes"),
    case([1, 1], [100, 3], [-1, 0], [3, 1], id="axes_subset_negative_axes_clamped_end"),
    case([0, 1, 2], [4, 5, 7], None, None, id="all_axes_default"),
    case([-100], [2], [1], None, id="start_clamped"),
    case([1, 2], [3, 5], [2, 1], None, id="axes_out_of_order"),
]


@pytest.mark.parametrize("starts, ends, axes, steps, variants", SLICE_CASES)
def test_slice(tmp_path, starts, ends, axes, steps, variants):
    ins, inits = ["x", "starts", "ends"], {"starts": i64(starts), "ends": i64(ends)}
    for name, v in (("axes", axes), ("steps", steps)):
        if v is not None:
            inits[name] = i64(v)
            ins.append(name)
        elif name == "axes" and steps is not None:
            ins.append("")
    m = build([helper.make_node("Slice", ins, ["y"])], {"x": X_SLICE}, ["y"], inits)
    check_model(m, tmp_path, variants=variants)


# ----------------------------------------------------------------------------- Pad

X_PAD = [1, 2, 4, 5]
PAD_CASES = [
    # mode, pads, constant value (None = omitted), axes (opset 18 only; None = omitted), opset
    case("constant", [0, 0, 1, 2, 0, 0, 2, 1], 1.5, None, 13, id="opset13_constant_value", full=True),
    case("constant", [0, 0, 1, 2, 0, 0, 2, 1], None, None, 13, id="opset13_constant_default_zero"),
    case("constant", [1, 1, 0, 0, 0, 1, 0, 0], -2.0, None, 13, id="opset13_constant_batch_channel"),
    case("edge", [0, 0, 2, 3, 0, 0, 1, 4], None, None, 13, id="opset13_edge", full=True),
    case("reflect", [0, 0, 3, 1, 0, 0, 2, 4], None, None, 13, id="opset13_reflect", full=True),
    case("reflect", [0, 0, 1, 0, 0, 0, 0, 1], None, None, 11, id="opset11_reflect"),
    case("constant", [0, 0, -1, 1, 0, 0, 1, -2], 0.5, None, 13, id="opset13_negative_pads_crop"),
    case("constant", [1, 2, 2, 1], 3.0, [2, 3], 18, id="opset18_axes_constant", full=True),
    case("constant", [2, 1], None, [-1], 18, id="opset18_negative_axis"),
    case("edge", [1, 2, 3, 0], None, [3, 2], 18, id="opset18_axes_edge_reordered"),
    case("reflect", [2, 3, 1, 2], None, [2, 3], 18, id="opset18_axes_reflect"),
    case("reflect", [0, 0, 2, 3, 0, 0, 1, 4], None, None, 18, id="opset18_no_axes_reflect"),
]


@pytest.mark.parametrize("mode, pads, value, axes, opset, variants", PAD_CASES)
def test_pad(tmp_path, mode, pads, value, axes, opset, variants):
    ins, inits = ["x", "pads"], {"pads": i64(pads)}
    if value is not None:
        ins.append("value")
        inits["value"] = np.float32(value)
    if axes is not None:
        if value is None:
            ins.append("")
        ins.append("axes")
        inits["axes"] = i64(axes)
    m = build([helper.make_node("Pad", ins, ["y"], mode=mode)], {"x": X_PAD}, ["y"], inits, opset=opset)
    check_model(m, tmp_path, variants=variants)


def test_pad_opset2_attribute_form(tmp_path):
    """The old attribute form (pads / value attributes) goes through the opset converter."""
    m = build([helper.make_node("Pad", ["x"], ["y"], mode="constant", pads=[0, 0, 1, 1, 0, 0, 2, 0], value=0.25)],
              {"x": X_PAD}, ["y"], opset=2)
    check_model(m, tmp_path, variants=QUICK)


# ----------------------------------------------------------------------------- Softmax, LRN, Reduce

SOFTMAX_CASES = [
    case([2, 3, 4], -1, 13, id="axis_neg1", full=True),
    case([2, 3, 4], 1, 13, id="axis1", full=True),
    case([2, 3, 4], 0, 13, id="axis0", full=True),
    case([3, 10], 1, 13, id="2d_axis1"),
    case([1, 10], -1, 13, id="logits_1x10"),
    case([2, 3, 4], -2, 13, id="axis_neg2"),
    case([2, 1, 4], 1, 13, id="axis_of_size1"),
    case([2, 3, 4], 1, 11, id="opset11_axis1_flattens"),
    case([2, 3, 4], 2, 11, id="opset11_axis2"),
]


@pytest.mark.parametrize("xs, axis, opset, variants", SOFTMAX_CASES)
def test_softmax(tmp_path, xs, axis, opset, variants):
    m = build([helper.make_node("Softmax", ["x"], ["y"], axis=axis)], {"x": xs}, ["y"], opset=opset)
    check_model(m, tmp_path, feeds={"x": rnd(xs, 3) * 4}, variants=variants)


LRN_CASES = [
    case([1, 6, 4, 4], {"size": 3}, id="size3", full=True),
    case([1, 7, 3, 5], {"size": 5, "alpha": 1e-3, "beta": 0.5, "bias": 2.0}, id="size5_params", full=True),
    case([2, 6, 3, 3], {"size": 1, "bias": 0.5}, id="size1_batch2"),   # onnxruntime only has odd sizes
    case([1, 3, 4, 4], {"size": 7}, id="size7_wider_than_channels"),
]


@pytest.mark.parametrize("xs, attrs, variants", LRN_CASES)
def test_lrn(tmp_path, xs, attrs, variants):
    m = build([helper.make_node("LRN", ["x"], ["y"], **attrs)], {"x": xs}, ["y"])
    check_model(m, tmp_path, feeds={"x": rnd(xs, 3) * 10}, variants=variants)


X_RED = [2, 3, 4, 5]
REDUCE_CASES = [
    # op, axes (None: not given), keepdims (None: default), opset, extra attributes
    case("ReduceMean", [1], 1, 13, {}, id="mean_opset13_axis1_keep", full=True),
    case("ReduceMean", [2, 3], 0, 13, {}, id="mean_opset13_axes23_nokeep", full=True),
    case("ReduceMean", [0, 2], 1, 13, {}, id="mean_opset13_axes02_keep"),
    case("ReduceMean", [-1], 0, 13, {}, id="mean_opset13_neg_axis_nokeep"),
    case("ReduceMean", None, 0, 13, {}, id="mean_opset13_all_nokeep"),
    case("ReduceMean", None, None, 13, {}, id="mean_opset13_all_default_keep"),
    case("ReduceMean", [1, 2], 1, 18, {}, id="mean_opset18_axes12_keep", full=True),
    case("ReduceMean", [-1, 0], 0, 18, {}, id="mean_opset18_axes_neg1_0_nokeep"),
    case("ReduceMean", [3], 0, 18, {}, id="mean_opset18_last_axis_nokeep"),
    case("ReduceMean", None, 1, 18, {}, id="mean_opset18_no_axes_all"),
    case("ReduceMean", None, 1, 18, {"noop_with_empty_axes": 1}, id="mean_opset18_noop_empty_axes"),
    case("ReduceSum", [1], 1, 13, {}, id="sum_opset13_axis1", full=True),
    case("ReduceSum", [0, 3], 0, 13, {}, id="sum_opset13_axes03_nokeep"),
    case("ReduceMax", [2], 1, 13, {}, id="max_opset13_axis2", full=True),
    case("ReduceMax", [1, 3], 0, 18, {}, id="max_opset18_axes13_nokeep"),
    case("ReduceMin", [-2], 1, 13, {}, id="min_opset13_axis_neg2", full=True),
    case("ReduceMin", None, 0, 18, {}, id="min_opset18_all"),
]


def test_reduce_mean_over_size1_axis(tmp_path):
    m = build([helper.make_node("ReduceMean", ["x"], ["y"], axes=[1, 2], keepdims=0)], {"x": [2, 1, 4, 3]}, ["y"])
    check_model(m, tmp_path, variants=QUICK)


@pytest.mark.parametrize("op, axes, keepdims, opset, extra, variants", REDUCE_CASES)
def test_reduce(tmp_path, op, axes, keepdims, opset, extra, variants):
    attrs, ins, inits = dict(extra), ["x"], {}
    if keepdims is not None:
        attrs["keepdims"] = keepdims
    # ReduceSum takes axes as an input from opset 13, the others from opset 18.
    input_form = opset >= 18 or op == "ReduceSum"
    if axes is not None:
        if input_form:
            ins.append("axes")
            inits["axes"] = i64(axes)
        else:
            attrs["axes"] = axes
    m = build([helper.make_node(op, ins, ["y"], **attrs)], {"x": X_RED}, ["y"], inits, opset=opset)
    check_model(m, tmp_path, variants=variants)


# ----------------------------------------------------------------------------- views and Transpose

VIEW_CASES = [
    # nodes, initializers, x shape, opset
    case([helper.make_node("Reshape", ["x", "s"], ["y"])], {"s": i64([4, -1])}, [2, 3, 4], 13,
         id="reshape_minus1", full=True),
    case([helper.make_node("Reshape", ["x", "s"], ["y"])], {"s": i64([0, 0, 2, 2])}, [2, 3, 4], 13,
         id="reshape_zero_copies_dim"),
    case([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Reshape", ["r", "s"], ["y"])],
         {"s": i64([6, 4])}, [2, 3, 4], 13, id="reshape_feeding_output"),
    case([helper.make_node("Reshape", ["x", "s"], ["r"]), helper.make_node("Sigmoid", ["r"], ["y"])],
         {"s": i64([-1])}, [2, 3, 4], 13, id="reshape_then_op"),
    case([helper.make_node("Flatten", ["x"], ["y"])], {}, [2, 3, 4, 5], 13, id="flatten_default", full=True),
    case([helper.make_node("Flatten", ["x"], ["y"], axis=0)], {}, [2, 3, 4, 5], 13, id="flatten_axis0"),
    case([helper.make_node("Flatten", ["x"], ["y"], axis=2)], {}, [2, 3, 4, 5], 13, id="flatten_axis2"),
    case([helper.make_node("Flatten", ["x"], ["y"], axis=-1)], {}, [2, 3, 4, 5], 13, id="flatten_axis_neg1"),
    case([helper.make_node("Squeeze", ["x", "a"], ["y"])], {"a": i64([0, 2])}, [1, 3, 1, 5], 13,
         id="squeeze_axes_input", full=True),
    case([helper.make_node("Squeeze", ["x"], ["y"])], {}, [1, 3, 1, 5], 13, id="squeeze_all"),
    case([helper.make_node("Squeeze", ["x"], ["y"], axes=[-2])], {}, [1, 3, 1, 5], 11, id="squeeze_opset11_attribute"),
    case([helper.make_node("Unsqueeze", ["x", "a"], ["y"])], {"a": i64([0, -1])}, [3, 5], 13,
         id="unsqueeze_axes_input", full=True),
    case([helper.make_node("Unsqueeze", ["x", "a"], ["y"])], {"a": i64([1, 3])}, [3, 5], 13, id="unsqueeze_middle"),
    case([helper.make_node("Unsqueeze", ["x"], ["y"], axes=[0])], {}, [3, 5], 11, id="unsqueeze_opset11_attribute"),
    case([helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("Unsqueeze", ["f", "a"], ["u"]),
          helper.make_node("Reshape", ["u", "s"], ["y"])], {"a": i64([0]), "s": i64([2, 3, 20])}, [2, 3, 4, 5], 13,
         id="chain_of_views"),
]


@pytest.mark.parametrize("nodes, inits, xs, opset, variants", VIEW_CASES)
def test_views(tmp_path, nodes, inits, xs, opset, variants):
    m = build(nodes, {"x": xs}, ["y"], inits, opset=opset)
    check_model(m, tmp_path, variants=variants)


def test_reshape_output_used_twice(tmp_path):
    """A view that is a graph output and also feeds another layer."""
    m = build([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Reshape", ["r", "s"], ["v"]),
               helper.make_node("Neg", ["v"], ["y"])], {"x": [2, 3, 4]}, ["v", "y"], {"s": i64([6, 4])})
    check_model(m, tmp_path)


TRANSPOSE_CASES = [
    case([3, 4], None, id="2d_default", full=True),
    case([3, 4], [1, 0], id="2d"),
    case([2, 3, 4], [1, 0, 2], id="3d_102"),
    case([2, 3, 4], [2, 0, 1], id="3d_201", full=True),
    case([2, 3, 4], None, id="3d_default_reverse"),
    case([1, 3, 4, 5], [0, 2, 3, 1], id="4d_nchw_to_nhwc", full=True),
    case([2, 4, 5, 3], [0, 3, 1, 2], id="4d_nhwc_to_nchw"),
    case([2, 3, 4, 5], [3, 1, 2, 0], id="4d_3120"),
    case([2, 3, 1, 4, 2], [4, 2, 0, 3, 1], id="5d", full=True),
    case([2, 3, 2, 2, 3], [0, 2, 1, 4, 3], id="5d_pairs"),
    case([1, 1, 4, 5], [1, 0, 2, 3], id="moves_only_size1_dims"),
    case([1, 4, 5, 1], [0, 3, 1, 2], id="nhwc_to_nchw_single_channel"),
]


@pytest.mark.parametrize("xs, perm, variants", TRANSPOSE_CASES)
def test_transpose(tmp_path, xs, perm, variants):
    attrs = {} if perm is None else {"perm": perm}
    m = build([helper.make_node("Transpose", ["x"], ["y"], **attrs)], {"x": xs}, ["y"])
    check_model(m, tmp_path, variants=variants)


def test_transpose_of_transpose(tmp_path):
    m = build([helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
               helper.make_node("Transpose", ["t"], ["y"], perm=[0, 2, 1, 3])], {"x": [2, 3, 4, 5]}, ["y"])
    assert layer_count(m, tmp_path) == 1
    check_model(m, tmp_path)


def test_transpose_then_transpose_back(tmp_path):
    m = build([helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
               helper.make_node("Transpose", ["t"], ["y"], perm=[0, 3, 1, 2]),
               ], {"x": [2, 3, 4, 5]}, ["y"])
    check_model(m, tmp_path, variants=QUICK)


# ----------------------------------------------------------------------------- Gather / Expand

X_GATHER = [5, 4, 3]
GATHER_CASES = [
    # axis, indices
    case(0, [0, 2, 4], id="axis0", full=True),
    case(1, [3, 0, 1], id="axis1", full=True),
    case(1, [-1, 0, -4], id="axis1_negative_indices"),
    case(0, 2, id="scalar_index", full=True),
    case(2, -1, id="scalar_negative_index_last_axis"),
    case(-2, [[0, 1], [3, 3]], id="2d_indices_negative_axis"),
    case(0, [4, 4, 0, 0, 1], id="repeated_indices"),
]


@pytest.mark.parametrize("axis, indices, variants", GATHER_CASES)
def test_gather(tmp_path, axis, indices, variants):
    m = build([helper.make_node("Gather", ["x", "i"], ["y"], axis=axis)], {"x": X_GATHER}, ["y"],
              {"i": i64(indices)})
    check_model(m, tmp_path, variants=variants)


def test_gather_int32_indices(tmp_path):
    m = build([helper.make_node("Gather", ["x", "i"], ["y"], axis=1)], {"x": X_GATHER}, ["y"],
              {"i": np.asarray([2, -1], dtype=np.int32)})
    check_model(m, tmp_path, variants=QUICK)


EXPAND_CASES = [
    case([3, 1], [2, 3, 4], id="3x1_to_2x3x4", full=True),
    case([4], [3, 4], id="row_to_3x4"),
    case([3, 1], [1, 5], id="shape_smaller_than_output"),
    case([2, 3, 1], [4], id="shape_lower_rank"),
    case([1, 3, 1, 1], [2, 3, 4, 5], id="per_channel_to_nchw", full=True),
    case([2, 3], [2, 3], id="same_shape"),
]


@pytest.mark.parametrize("xs, shape, variants", EXPAND_CASES)
def test_expand(tmp_path, xs, shape, variants):
    m = build([helper.make_node("Expand", ["x", "s"], ["y"])], {"x": xs}, ["y"], {"s": i64(shape)})
    check_model(m, tmp_path, variants=variants)


# ----------------------------------------------------------------------------- Identity / Dropout / outputs

def test_identity_removed(tmp_path):
    m = build([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["b"]),
               helper.make_node("Neg", ["b"], ["y"])], {"x": [2, 3, 4]}, ["y"])
    assert layer_count(m, tmp_path) == 2
    check_model(m, tmp_path)


@pytest.mark.parametrize("opset, with_mask, ratio", [(13, False, None), (13, True, None), (12, False, 0.3),
                                                     (10, False, None)],
                         ids=["opset13", "opset13_unused_mask", "opset12_ratio_input", "opset10"])
def test_dropout_removed(tmp_path, opset, with_mask, ratio):
    ins, inits = ["a"], {}
    if ratio is not None:
        ins.append("ratio")
        inits["ratio"] = np.float32(ratio)
    outs = ["b", "mask"] if with_mask else ["b"]
    attrs = {"ratio": 0.5} if opset == 10 else {}
    m = build([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Dropout", ins, outs, **attrs),
               helper.make_node("Neg", ["b"], ["y"])], {"x": [2, 3, 4]}, ["y"], inits, opset=opset)
    assert layer_count(m, tmp_path) == 2
    check_model(m, tmp_path, variants=ALL if opset == 13 and not with_mask else QUICK)


def test_dropout_in_training_mode_is_refused(tmp_path):
    m = build([helper.make_node("Dropout", ["x", "ratio", "train"], ["y"])], {"x": [2, 3]}, ["y"],
              {"ratio": np.float32(0.5), "train": np.array(True)})
    with pytest.raises(TinydeployError, match="training mode"):
        compile_model(save(m, tmp_path), get_target("host"))


def test_identity_output_is_graph_output(tmp_path):
    m = build([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["y"])],
              {"x": [2, 3, 4]}, ["y"])
    assert layer_count(m, tmp_path) == 1
    check_model(m, tmp_path)


def test_identity_of_graph_input_is_graph_output(tmp_path):
    m = build([helper.make_node("Identity", ["x"], ["y"])], {"x": [2, 3, 4]}, ["y"])
    check_model(m, tmp_path)


def test_identity_input_and_output_both_graph_outputs(tmp_path):
    m = build([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["y"])],
              {"x": [2, 3, 4]}, ["a", "y"])
    check_model(m, tmp_path)


def test_identity_chain_to_output(tmp_path):
    m = build([helper.make_node("Sigmoid", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["b"]),
               helper.make_node("Dropout", ["b"], ["c"]), helper.make_node("Identity", ["c"], ["y"])],
              {"x": [2, 3, 4]}, ["y"])
    assert layer_count(m, tmp_path) == 1
    check_model(m, tmp_path, variants=QUICK)


def test_identity_of_constant_is_graph_output(tmp_path):
    m = build([helper.make_node("Identity", ["c"], ["k"]), helper.make_node("Relu", ["x"], ["y"])],
              {"x": [2, 3]}, ["y", "k"], {"c": rnd([3, 2], 1)})
    check_model(m, tmp_path, variants=QUICK)


def test_graph_output_is_graph_input(tmp_path):
    """The identity model: no nodes at all."""
    m = build([], {"x": [2, 3, 4]}, ["x"])
    check_model(m, tmp_path)


def test_graph_input_is_also_an_output_beside_a_layer(tmp_path):
    m = build([helper.make_node("Relu", ["x"], ["y"])], {"x": [2, 3, 4]}, ["x", "y"])
    check_model(m, tmp_path)


def test_two_outputs_are_the_same_tensor(tmp_path):
    m = build([helper.make_node("Relu", ["x"], ["y"])], {"x": [2, 3, 4]}, ["y", "y"])
    check_model(m, tmp_path)


def test_graph_input_listed_twice_as_output(tmp_path):
    m = build([], {"x": [2, 3]}, ["x", "x"])
    check_model(m, tmp_path, variants=QUICK)


def test_unary_ops_are_all_tested():
    """The unary sweep is parametrised over elementwise.UNARY itself; make sure it is not empty and
    that the activations the fusion pass knows are covered by test_activation."""
    from tinydeploy.ir.activation import FUSABLE_ONNX
    assert len(UNARY) >= 19
    assert set(FUSABLE_ONNX) <= {p.values[0] for p in ACTIVATION_CASES}


def test_every_registered_operator_has_cases():
    """The matrix picks up the registry: the unary and binary sweeps are parametrised over the
    registry's own tables; every other ONNX operator the registry has must have cases of its own
    here (or, for QuantizeLinear / DequantizeLinear, in test_quantized.py)."""
    import onnx
    from tinydeploy.ops import REGISTRY
    here = Path(__file__).read_text() + (Path(__file__).parent / "test_quantized.py").read_text()
    swept = set(UNARY) | set(BINARY)
    missing = [op for op in sorted(REGISTRY) if onnx.defs.has(op) and op not in swept and f'"{op}"' not in here]
    assert not missing, f"registered operators without test cases: {missing}"


@pytest.mark.parametrize("slope_shape", [[4, 1, 1], [1], [], [2, 4, 3, 5], [5]], ids=str)
def test_prelu(tmp_path, slope_shape):
    """PRelu, slope as a constant (per channel, shared, scalar, full, last axis) and at run time."""
    m = build([helper.make_node("PRelu", ["x", "s"], ["y"])], {"x": [2, 4, 3, 5]}, ["y"],
              {"s": rnd(slope_shape, 5, 0.05, 0.5)})
    check_model(m, tmp_path, variants=ALL if slope_shape == [4, 1, 1] else QUICK)
    m = build([helper.make_node("PRelu", ["x", "s"], ["y"])], {"x": [2, 4, 3, 5], "s": slope_shape}, ["y"])
    check_model(m, tmp_path, variants=QUICK)
