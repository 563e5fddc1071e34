"""8-bit (QDQ) deployment: the QDQ pass, the integer kernels and the LSB comparison.

Every model is built with gcc, clang and gcc+ASan/UBSan (-Werror); each result must equal
tinydeploy's exact reference (tinydeploy/quant/exact.py) bit for bit, and differ from the oracle (the
graph run node by node by onnxruntime, reference.run_oracle) only at rounding ties
(util.check_8bit). onnxruntime's fast session, whose 8-bit kernels differ by CPU, is never the
reference. The marked `haswell` subset also runs under `qemu-x86_64 -cpu Haswell` (tests/README.md).
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP, helper, numpy_helper

from tinydeploy import flow, ir, reference
from tinydeploy.frontend.importer import import_model
from tinydeploy.quant.exact import requant_exact as requantize
from tinydeploy.quant.params import quantize_multiplier
from tinydeploy.quant.qdq import quantize_qdq
from tinydeploy.runners.local import LocalRunner
from util import assert_arena_tight, check_8bit, check_model_lsb, make_model, mlperf_model, save

ONNX_T = {np.dtype(np.int8): TP.INT8, np.dtype(np.uint8): TP.UINT8, np.dtype(np.int32): TP.INT32,
          np.dtype(np.float32): TP.FLOAT}


class QDQ:
    """A tiny builder for QDQ graphs."""

    def __init__(self, seed: int = 0):
        self.nodes, self.inits, self.k = [], [], 0
        self.rng = np.random.default_rng(seed)

    def name(self, base: str) -> str:
        self.k += 1
        return f"{base}{self.k}"

    def const(self, arr) -> str:
        n = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(arr), n))
        return n

    def node(self, op: str, ins: list[str], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, ins, [out], **attrs))
        return out

    def dq(self, x: str, scale, zp, dtype, axis: int | None = None) -> str:
        kw = {} if axis is None else {"axis": axis}
        return self.node("DequantizeLinear", [x, self.const(np.asarray(scale, np.float32)),
                                              self.const(np.asarray(zp, dtype))], **kw)

    def q(self, x: str, scale, zp, dtype) -> str:
        return self.node("QuantizeLinear", [x, self.const(np.float32(scale)), self.const(np.asarray(zp, dtype))])

    def weights(self, shape, dtype, scale, zp=0, axis=None) -> str:
        info = np.iinfo(dtype)
        w = self.rng.integers(info.min, info.max + 1, shape).astype(dtype)
        return self.dq(self.const(w), scale, zp, dtype, axis)

    def bias(self, n: int, scale) -> str:
        b = self.rng.integers(-3000, 3000, n).astype(np.int32)
        return self.dq(self.const(b), np.asarray(scale, np.float32), np.zeros(np.shape(scale), np.int32), np.int32,
                       axis=0 if np.ndim(scale) else None)

    def model(self, inputs, outputs) -> onnx.ModelProto:
        """Output types and shapes come from onnx shape inference."""
        m = make_model(self.nodes, [helper.make_tensor_value_info(n, ONNX_T[np.dtype(d)], s) for n, d, s in inputs],
                       [helper.make_empty_tensor_value_info(n) for n, _ in outputs], self.inits)
        m = onnx.shape_inference.infer_shapes(m, strict_mode=True)
        del m.graph.value_info[:]
        return m


def qrange(dtype):
    i = np.iinfo(dtype)
    return int(i.min), int(i.max)


# ---- fixed-point requantisation -----------------------------------------------------------

@pytest.mark.parametrize("r", [1.0, 0.5, 0.75, 1e-3, 3.14159e-5, 2.0 ** -31, 7.5e-12, 123.456, 1e6, 0.3333333])
def test_quantize_multiplier_is_exact_for_float32(r):
    r32 = float(np.float32(r))
    m, s = quantize_multiplier(r32)
    assert 1 <= s <= 62 and 0 <= m < 2 ** 31
    if 2.0 ** -31 <= r32 < 2.0 ** 30:
        assert Fraction(m, 2 ** s) == Fraction(r32) and m >= 2 ** 30


def test_requantize_rounds_half_to_even_and_saturates():
    m, s = quantize_multiplier(0.5)
    acc = np.arange(-9, 10)
    got = requantize(acc, m, s, 0, -128, 127)
    assert got.tolist() == np.rint(acc * 0.5).astype(int).tolist()       # numpy rint: half to even
    rng = np.random.default_rng(1)
    for r in (0.0123, 0.987654, 3.3e-4):
        r32 = float(np.float32(r))
        m, s = quantize_multiplier(r32)
        acc = rng.integers(-2 ** 20, 2 ** 20, 500)
        want = [int(round(Fraction(int(a)) * Fraction(r32))) + 5 for a in acc]   # round() on Fraction: half even
        want = np.clip(want, -128, 127)
        assert requantize(acc, m, s, 5, -128, 127).tolist() == want.tolist()


# ---- the pass -----------------------------------------------------------------------------

def test_pass_is_a_noop_for_float_graphs(tmp_path):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    m = make_model([helper.make_node("Conv", ["x", "w"], ["y"])],
                   [helper.make_tensor_value_info("x", TP.FLOAT, [1, 3, 8, 8])],
                   [helper.make_tensor_value_info("y", TP.FLOAT, [1, 4, 6, 6])], [w])
    g, _ = import_model(save(m, tmp_path))
    before = [(n.op, list(n.inputs), list(n.outputs)) for n in g.nodes]
    quantize_qdq(g)
    assert [(n.op, list(n.inputs), list(n.outputs)) for n in g.nodes] == before and not g.notes


# ---- convolution --------------------------------------------------------------------------

CONV_CASES = {
    #            C, M, H, W, kernel, strides, pads, group, dilations, x_zp, y_zp, extra
    "3x3-relu": (3, 8, 9, 9, [3, 3], [1, 1], [1, 1, 1, 1], 1, [1, 1], 3, -5, {"act": "relu"}),
    "zp-min-padded": (4, 6, 7, 8, [3, 3], [1, 1], [1, 1, 1, 1], 1, [1, 1], "min", "max", {}),
    "zp-max-padded": (4, 6, 7, 8, [3, 3], [1, 1], [2, 1, 0, 2], 1, [1, 1], "max", "min", {}),
    "depthwise-s2": (8, 8, 11, 10, [3, 3], [2, 2], [0, 0, 1, 1], 8, [1, 1], 10, 0, {"act": "relu"}),
    "dilated": (5, 4, 12, 12, [3, 3], [1, 1], [2, 2, 2, 2], 1, [2, 2], -20, 7, {}),
    "depthwise-5x3-dilated": (6, 6, 9, 11, [5, 3], [1, 1], [4, 2, 3, 1], 6, [2, 1], "max", 3, {}),
    "depthwise-no-interior": (4, 4, 3, 3, [5, 5], [1, 1], [2, 2, 2, 2], 4, [1, 1], 0, 0, {"act": "relu"}),
    "grouped-5x2": (6, 4, 10, 9, [5, 2], [1, 2], [2, 0, 2, 1], 2, [1, 1], 1, 1, {}),
    "pointwise": (16, 24, 6, 6, [1, 1], [1, 1], [0, 0, 0, 0], 1, [1, 1], "min", 0, {"act": "clip"}),
    "channels-1000x": (8, 16, 8, 8, [3, 3], [1, 1], [1, 1, 1, 1], 1, [1, 1], 0, 0, {"spread": 1000.0}),
    "saturating": (8, 8, 6, 6, [3, 3], [1, 1], [1, 1, 1, 1], 1, [1, 1], 0, 0, {"y_scale": 1e-4}),
    "tiny-scales": (4, 4, 6, 6, [3, 3], [1, 1], [1, 1, 1, 1], 1, [1, 1], 2, -3, {"x_scale": 3e-7, "y_scale": 2e-9}),
    "weight-zp": (4, 5, 6, 6, [3, 3], [1, 1], [0, 0, 0, 0], 1, [1, 1], 9, 4, {"w_zp": True}),
    "no-bias-1d": (4, 6, 1, 20, [1, 3], [1, 2], [0, 1, 0, 1], 1, [1, 1], -7, 2, {"no_bias": True}),
    "bias-other-scale": (4, 6, 6, 6, [3, 3], [1, 1], [1, 1, 1, 1], 1, [1, 1], 4, -4, {"bias": "scaled"}),
    "float-bias": (4, 6, 6, 6, [3, 3], [1, 1], [0, 0, 0, 0], 1, [1, 1], 4, -4, {"bias": "float"}),
}


def _conv_model(case, act_dtype, seed=0):
    C, M, H, W, k, s, pads, group, dil, xz, yz, extra = CONV_CASES[case]
    lo, hi = qrange(act_dtype)
    pick = {"min": lo, "max": hi}
    xz, yz = pick.get(xz, xz), pick.get(yz, yz)
    if act_dtype == np.uint8:
        xz, yz = (v if isinstance(v, int) and 0 <= v <= 255 else 128 + int(v) for v in (xz, yz))
    b = QDQ(seed)
    x_scale = extra.get("x_scale", 0.05)
    x = b.dq("x", x_scale, xz, act_dtype)
    cin = C // group
    spread = extra.get("spread", 4.0)
    wk = k if H > 1 else k[1:]
    w_scale = (np.geomspace(1.0, spread, M) * 2e-3 / spread * 4).astype(np.float32)
    if extra.get("w_zp"):
        wdt = act_dtype      # uint8 weights with zero point 128 for uint8 models, int8 with 3 otherwise
        wz = 128 if act_dtype == np.uint8 else 3
        w = b.weights((M, cin, *wk), wdt, np.float32(4e-3), wz)
        bscale = np.float32(np.float32(x_scale) * np.float32(4e-3))
    else:
        w = b.weights((M, cin, *wk), np.int8, w_scale, np.zeros(M, np.int8), axis=0)
        bscale = (np.float32(x_scale) * w_scale).astype(np.float32)
    if extra.get("bias") == "scaled":      # int32 bias whose scale is not s_x * s_w: rescaled at build time
        bias = [b.bias(M, (bscale * np.float32(0.37)).astype(np.float32))]
    elif extra.get("bias") == "float":     # a plain float bias constant
        bias = [b.const((b.rng.standard_normal(M) * 0.5).astype(np.float32))]
    else:
        bias = [] if extra.get("no_bias") else [b.bias(M, bscale)]
    ins = [x, w] + bias
    attrs = dict(kernel_shape=k, strides=s, pads=pads, group=group, dilations=dil)
    if H == 1:   # a 1-D convolution
        attrs = dict(kernel_shape=k[1:], strides=s[1:], pads=[pads[1], pads[3]], group=group, dilations=dil[1:])
    y = b.node("Conv", ins, **attrs)
    if extra.get("act") == "relu":
        y = b.node("Relu", [y])
    elif extra.get("act") == "clip":
        y = b.node("Clip", [y, b.const(np.float32(0.0)), b.const(np.float32(2.5))])
    yq = b.q(y, extra.get("y_scale", 0.08), yz, act_dtype)
    shape = [1, C, H, W] if H > 1 else [1, C, W]
    return b.model([("x", act_dtype, shape)], [(yq, act_dtype)])


# The `haswell` subset (tests/README.md: also run under qemu-x86_64 -cpu Haswell, where
# onnxruntime takes its AVX2 path whatever the host): u8 x s8 products in several geometries.
HASWELL_CONV = ("3x3-relu", "pointwise", "saturating", "depthwise-s2")


@pytest.mark.parametrize("dtype", [np.int8, np.uint8], ids=["s8", "u8"])
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.haswell) if c in HASWELL_CONV else c
                                  for c in CONV_CASES])
def test_qconv(case, dtype, tmp_path):
    check_model_lsb(_conv_model(case, dtype), tmp_path, seeds=(0, 1))


def test_qconv_is_integer(tmp_path):
    b = flow.build(save(_conv_model("3x3-relu", np.int8), tmp_path), "host", tmp_path / "b", quiet=True)
    ops = [n.op for n in b.compiled.graph.nodes]
    assert ops == ["QConv"], ops
    assert any("quantised" in n for n in b.summary["notes"])


# ---- dense --------------------------------------------------------------------------------

@pytest.mark.haswell
@pytest.mark.parametrize("dtype", [np.int8, np.uint8], ids=["s8", "u8"])
@pytest.mark.parametrize("form", ["matmul-add-relu", "matmul-per-column", "gemm-transb-alpha", "matmul-nobias"])
def test_qdense(form, dtype, tmp_path):
    lo, hi = qrange(dtype)
    b = QDQ(3)
    rows, K, N = 4, 64, 48
    xz, yz = (lo + 3, hi - 10) if form != "matmul-nobias" else (hi, lo)
    x = b.dq("x", 0.02, xz, dtype)
    if form == "gemm-transb-alpha":
        w = b.weights((N, K), np.int8, np.float32(3e-3))
        y = b.node("Gemm", [x, w, b.bias(N, np.float32(0.02) * np.float32(3e-3))], transB=1, alpha=0.75)
    else:
        if form == "matmul-per-column":
            ws = np.geomspace(1e-4, 1e-1, N).astype(np.float32)
            w = b.weights((K, N), np.int8, ws, np.zeros(N, np.int8), axis=1)
            bs = (np.float32(0.02) * ws).astype(np.float32)
        else:
            ws = np.float32(3e-3)
            w = b.weights((K, N), np.int8, ws)
            bs = np.float32(0.02) * ws
        y = b.node("MatMul", [x, w])
        if form != "matmul-nobias":
            y = b.node("Add", [y, b.bias(N, bs)])
    if form == "matmul-add-relu":
        y = b.node("Relu", [y])
    yq = b.q(y, 0.05, yz if form != "matmul-add-relu" else lo, dtype)
    check_model_lsb(b.model([("x", dtype, [rows, K])], [(yq, dtype)]), tmp_path, seeds=(0, 1))


# ---- add ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int8, np.uint8], ids=["s8", "u8"])
@pytest.mark.parametrize("form", ["same-shape", "broadcast-relu", "scales-1000x", "saturating"])
def test_qadd(form, dtype, tmp_path):
    lo, hi = qrange(dtype)
    b = QDQ(5)
    sa, sb, sy = {"same-shape": (0.05, 0.07, 0.09), "broadcast-relu": (0.051, 0.023, 0.037),
                  "scales-1000x": (0.1, 1e-4, 0.08), "saturating": (0.5, 0.5, 0.01)}[form]
    shb = [1, 8, 1, 1] if form == "broadcast-relu" else [1, 8, 5, 6]
    a_ = b.dq("a", sa, lo + 1, dtype)
    b_ = b.dq("b", sb, hi - 2, dtype)
    y = b.node("Add", [a_, b_])
    if form == "broadcast-relu":
        y = b.node("Relu", [y])
    yq = b.q(y, sy, (lo + hi) // 2 + 3, dtype)
    m = b.model([("a", dtype, [1, 8, 5, 6]), ("b", dtype, shb)], [(yq, dtype)])
    check_model_lsb(m, tmp_path, seeds=(0, 1))


# ---- pooling ------------------------------------------------------------------------------

POOLS = {
    "avg-3x3-s2-pad": ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "avg-include-pad": ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1)),
    "avg-4x4-s3": ("AveragePool", dict(kernel_shape=[4, 4], strides=[3, 3])),
    "max-2x2": ("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2])),
    "max-3x3-pad": ("MaxPool", dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])),
    # ResNet's stem pool, and a dilated window with uneven pads: interior windows and clipped edges
    "max-3x3-s2-pad": ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "max-3x2-dil2": ("MaxPool", dict(kernel_shape=[3, 2], strides=[1, 2], dilations=[2, 2], pads=[2, 0, 1, 1])),
    # a window as large as the image: the whole-plane sum (as a global average)
    "avg-whole": ("AveragePool", dict(kernel_shape=[12, 12])),
    "global-avg": ("GlobalAveragePool", {}),
    "global-max": ("GlobalMaxPool", {}),
}


@pytest.mark.parametrize("dtype", [np.int8, np.uint8], ids=["s8", "u8"])
@pytest.mark.parametrize("case", list(POOLS))
def test_qpool(case, dtype, tmp_path):
    op, attrs = POOLS[case]
    lo, hi = qrange(dtype)
    b = QDQ(7)
    same = case == "max-2x2"
    x = b.dq("x", 0.03, lo + 17, dtype)
    y = b.node(op, [x], **attrs)
    yq = b.q(y, 0.03 if same else 0.011, lo + 17 if same else lo + 40, dtype)
    check_model_lsb(b.model([("x", dtype, [1, 6, 12, 12])], [(yq, dtype)]), tmp_path, seeds=(0, 1))


# ---- exact .5 ties ------------------------------------------------------------------------
# Scales with "round" ratios make exact ties k + 1/2 frequent. tinydeploy's kernels equal the
# exact reference there too; a float evaluation of the graph (the oracle) may round such a value
# either way, and reference.layerwise recognises those differences as ties, nothing else.

def _run_tied(m, tmp_path, seed=0):
    path = save(m, tmp_path)
    b = flow.build(path, "host", tmp_path / "b", quiet=True)
    specs = flow.io_specs(b.summary, "inputs")
    x = reference.random_inputs(specs, seed)
    got, _ = LocalRunner().run(b.exe, [x[n] for n, _, _ in specs], [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")])
    res = check_8bit(path, x, got)
    return x, got[0].astype(np.int64), res


@pytest.mark.parametrize("dtype", [np.int8, np.uint8], ids=["s8", "u8"])
def test_avgpool_ties(dtype, tmp_path):
    lo, _ = qrange(dtype)
    b = QDQ(7)
    zx = lo + 17
    y = b.node("AveragePool", [b.dq("x", 0.03, zx, dtype)], kernel_shape=[4, 4], strides=[4, 4])
    m = b.model([("x", dtype, [1, 6, 12, 12])], [(b.q(y, 0.03, zx, dtype), dtype)])
    for seed in range(3):
        x, got, _ = _run_tied(m, tmp_path, seed)
        sums = x["x"].astype(np.int64).reshape(1, 6, 3, 4, 3, 4).sum(axis=(3, 5)) - 16 * zx
        exact = sums / 16.0                      # in LSBs, before the zero point is added
        tie = exact - np.floor(exact) == 0.5
        assert tie.any()
        # float32 sums of the dequantised window land near, not on, those ties: either side is
        # within half an LSB (which side the kernel took is the exact reference's, checked above)
        assert np.abs((got - zx) - exact).max() <= 0.5


@pytest.mark.parametrize("dtype", [np.int8, np.uint8], ids=["s8", "u8"])
def test_add_ties(dtype, tmp_path):
    lo, hi = qrange(dtype)
    b = QDQ(5)
    za, zb, zy = lo + 1, hi - 2, (lo + hi) // 2
    y = b.node("Add", [b.dq("a", 0.05, za, dtype), b.dq("b", 0.02, zb, dtype)])
    m = b.model([("a", dtype, [1, 8, 5, 6]), ("b", dtype, [1, 8, 1, 1])], [(b.q(y, 0.04, zy, dtype), dtype)])
    ra = float(np.float32(0.05) / np.float32(0.04))
    rb = float(np.float32(0.02) / np.float32(0.04))
    for seed in range(3):
        x, got, res = _run_tied(m, tmp_path, seed)
        exact = (x["a"].astype(np.int64) - za) * ra + (x["b"].astype(np.int64) - zb) * rb
        assert (exact - np.floor(exact) == 0.5).any()
        assert np.array_equal(got, np.clip(np.rint(exact) + zy, lo, hi))


# ---- data movement, float islands, graph edges --------------------------------------------

@pytest.mark.parametrize("dtype", [np.int8, np.uint8], ids=["s8", "u8"])
def test_data_movement_stays_integer(dtype, tmp_path):
    lo, _ = qrange(dtype)
    b = QDQ(9)
    x = b.dq("x", 0.1, lo + 5, dtype)
    t = b.q(b.node("Transpose", [x], perm=[0, 2, 3, 1]), 0.1, lo + 5, dtype)
    t2 = b.dq(t, 0.1, lo + 5, dtype)
    c = b.q(b.node("Concat", [t2, t2], axis=3), 0.1, lo + 5, dtype)
    r = b.node("Reshape", [c, b.const(np.array([1, -1], np.int64))])
    m = b.model([("x", dtype, [1, 3, 4, 5])], [(r, dtype)])
    check_model_lsb(m, tmp_path, variants=("gcc", "gcc-asan-ubsan"))
    bres = flow.build(save(m, tmp_path, "m2.onnx"), "host", tmp_path / "b", quiet=True)
    assert {n.op for n in bres.compiled.graph.nodes} <= {"Transpose", "Concat", "Reshape", "Copy"}


@pytest.mark.parametrize("act", ["none", "relu", "clip"])
def test_requantize(act, tmp_path):
    """Q([Relu|Clip](DQ(x))): a change of scale, zero point and type (int8 -> uint8 -> int8)."""
    b = QDQ(17)
    x = b.dq("x", 0.037, -9, np.int8)
    if act == "relu":
        x = b.node("Relu", [x])
    elif act == "clip":
        x = b.node("Clip", [x, b.const(np.float32(-1.5)), b.const(np.float32(2.0))])
    u = b.q(x, 0.013, 101, np.uint8)
    y = b.q(b.dq(u, 0.013, 101, np.uint8), 0.29, 3, np.int8)
    m = b.model([("x", np.int8, [2, 3, 50])], [(u, np.uint8), (y, np.int8)])
    check_model_lsb(m, tmp_path, seeds=(0, 1))
    bres = flow.build(save(m, tmp_path, "m2.onnx"), "host", tmp_path / "b", quiet=True)
    assert [n.op for n in bres.compiled.graph.nodes] == ["QRequantize", "QRequantize"]


@pytest.mark.parametrize("dtype", [np.int8, np.uint8], ids=["s8", "u8"])
def test_float_island_softmax_and_sigmoid(dtype, tmp_path):
    lo, _ = qrange(dtype)
    b = QDQ(11)
    x = b.dq("x", 0.1, lo + 100, dtype)
    s = b.q(b.node("Softmax", [x], axis=-1), 1.0 / 256, lo, dtype)
    x2 = b.dq(s, 1.0 / 256, lo, dtype)
    y = b.q(b.node("Sigmoid", [x2]), 1.0 / 256, lo, dtype)
    m = b.model([("x", dtype, [2, 40])], [(y, dtype)])
    check_model_lsb(m, tmp_path, seeds=(0, 1, 2))
    bres = flow.build(save(m, tmp_path, "m2.onnx"), "host", tmp_path / "b", quiet=True)
    notes = bres.summary["notes"]   # Softmax: onnxruntime's QLinearSoftmax method; Sigmoid: float
    assert any("quantised" in n and "QSoftmax" in n for n in notes), notes
    assert any("float island" in n and "Sigmoid" in n for n in notes), notes


def test_float_graph_edges(tmp_path):
    """float input -> QuantizeLinear -> integer conv -> DequantizeLinear -> float output: the float
    output is compared in LSBs of its scale."""
    b = QDQ(13)
    xq = b.q("x", 0.04, 3, np.int8)
    x = b.dq(xq, 0.04, 3, np.int8)
    w = b.weights((6, 3, 3, 3), np.int8, np.full(6, 2e-3, np.float32), np.zeros(6, np.int8), axis=0)
    y = b.node("Conv", [x, w], pads=[1, 1, 1, 1])
    yq = b.q(y, 0.03, -2, np.int8)
    out = b.dq(yq, 0.03, -2, np.int8)
    m = b.model([("x", np.float32, [1, 3, 8, 8])], [(out, np.float32)])
    path = save(m, tmp_path)
    bres = flow.build(path, "host", tmp_path / "b", quiet=True)
    assert [n.op for n in bres.compiled.graph.nodes] == ["QuantizeLinear", "QConv", "DequantizeLinear"]
    assert bres.summary["output_lsb"] == [pytest.approx(0.03)]
    res = check_model_lsb(path, tmp_path, seeds=(0, 1, 2), variants=("gcc",))
    assert all(r["tolerance_unit"] == "LSB" for r in res)


# ---- onnxruntime's own quantiser (QDQ format: uint8 activations, int8 weights) ------------

def test_onnxruntime_quantize_static_qdq(tmp_path):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    rng = np.random.default_rng(0)
    init = [numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w1"),
            numpy_helper.from_array((rng.standard_normal(8) * 0.1).astype(np.float32), "b1"),
            numpy_helper.from_array((rng.standard_normal((8, 8, 1, 1)) * 0.3).astype(np.float32), "w2"),
            numpy_helper.from_array((rng.standard_normal((8 * 4 * 4, 10)) * 0.1).astype(np.float32), "wd"),
            numpy_helper.from_array(np.array([1, -1], np.int64), "shape")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"]),
             helper.make_node("Add", ["c2", "r1"], ["a"]),
             helper.make_node("MaxPool", ["a"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Reshape", ["p", "shape"], ["f"]),
             helper.make_node("MatMul", ["f", "wd"], ["y"])]
    fm = make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [1, 3, 8, 8])],
                    [helper.make_tensor_value_info("y", TP.FLOAT, [1, 10])], init)
    fpath, qpath = save(fm, tmp_path, "float.onnx"), tmp_path / "qdq.onnx"

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.data = iter([{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(8)])

        def get_next(self):
            return next(self.data, None)

    quantize_static(str(fpath), str(qpath), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True)
    b = flow.build(qpath, "host", tmp_path / "b", quiet=True)
    ops = [n.op for n in b.compiled.graph.nodes]
    assert "QConv" in ops and "QAdd" in ops and "QDense" in ops, ops
    # The float input and output stay float; the output, a DequantizeLinear, is compared in LSBs.
    check_model_lsb(qpath, tmp_path, seeds=(0, 1, 2), variants=("gcc",))


# ---- MLPerf Tiny int8 models end to end ---------------------------------------------------

MLPERF_INT8 = {   # model: (activation arena lower bound in bytes, from the models' README)
    "ad_autoencoder_int8.onnx": 768,
    "kws_dscnn_int8.onnx": 16000,
    "ic_resnet8_int8.onnx": 49152,
    "vww_mobilenetv1_int8.onnx": 55296,
}


@pytest.mark.parametrize("name", list(MLPERF_INT8))
def test_mlperf_int8(name, tmp_path, monkeypatch):
    path = mlperf_model(name)
    res = flow.run(path, outdir=tmp_path / "run", quiet=True, latency=False)
    assert res["outputs_match"] and res["tolerance_unit"] == "LSB", res
    assert res["max_abs_error"] <= 1 and res["exact_reference"]["identical"], res
    assert set(res["onnxruntime_fast"]) == {"max_lsb", "identical_fraction", "note"}, res
    # the activations alone take the models' README minimum (the lower bound); the ISA kernels'
    # scratch (schedule/q8.py: its size follows the host's ISA) is planned in the arena above it
    assert res["memory"]["lower_bound_bytes"] == MLPERF_INT8[name], res["memory"]
    assert_arena_tight(path, res["memory"])
    if name in ("ic_resnet8_int8.onnx", "vww_mobilenetv1_int8.onnx"):
        # the 8-bit GEMM's column blocks are cut to the room under the peak (q8.fit_gemm; IC
        # 308,992 -> 97,792 B, VWW 179,712 -> 57,344 B on AVX2), and the cut blocks, tails
        # included, give the same bits (checked above and below). The plan is made for an AVX2
        # host whatever this CPU is (the ISA whose floor, Q8.fit_cols, was measured; AVX-512 and
        # VNNI keep their blocks), so the verdict does not depend on the CPU.
        import dataclasses
        from tinydeploy import targets
        from tinydeploy.pipeline import compile_model
        from tinydeploy.targets.boards import get_board
        with monkeypatch.context() as mp:
            mp.setitem(targets.TARGETS, "host", lambda: dataclasses.replace(targets.host(), isas=["avx2"]))
            c = compile_model(path, get_board("host").make_target(), board="host")
        cut = [k.params for k in c.kernels if k is not None and k.family == "qconv2d_gemm"
               and k.params["NC"] < k.params["NC_MAX"]]
        assert cut and all(p["NC"] % p["NR"] == 0 for p in cut) and any(p["P"] % p["NC"] for p in cut), cut
        assert c.plan.arena_bytes < 2.2 * MLPERF_INT8[name], c.plan.arena_bytes
    with monkeypatch.context() as mp:
        mp.setenv("TINYDEPLOY_ALGO", "ref")
        ref = flow.build(path, "host", tmp_path / "ref", quiet=True).summary
    assert ref["arena_bytes"] == MLPERF_INT8[name] == ref["lower_bound_bytes"], ref
    b = flow.build(path, "host", tmp_path / "run", quiet=True, reuse=True)
    notes = " ".join(b.summary["notes"])
    if name != "ad_autoencoder_int8.onnx":
        assert "QSoftmax" in notes and "float island" not in notes, notes
    check_model_lsb(path, tmp_path, variants=("clang", "gcc-asan-ubsan"))


def boundary_inputs(path, count: int, seed: int) -> tuple[list[dict], object]:
    """Inputs whose two largest logits (the last QDense's outputs) are equal: the hardest case
    for agreement, as a data set labelled by some reference's argmax is. Seeded hill climbing on
    tinydeploy's exact reference (numpy, the same on every CPU), so every machine tests the same
    inputs: random int8 images, 6 pixels moved at a time, kept while the margin does not grow."""
    from tinydeploy.quant import exact
    g = exact.lowered_graph(path)
    logits = [n for n in g.nodes if n.op == "QDense"][-1].outputs[0]
    name = g.inputs[0]
    shape, dt = g.t(name).shape, np.dtype(g.t(name).dtype)
    lo, hi = qrange(dt)

    def margin(x):
        v = np.sort(exact.evaluate(g, {name: x}, keep=True)[logits].reshape(-1).astype(np.int64))
        return int(v[-1] - v[-2])

    out = []
    for k in range(count):
        rng = np.random.default_rng(seed + k)
        x = rng.integers(lo, hi + 1, shape).astype(dt)
        m = margin(x)
        for _ in range(400):
            if m == 0:
                break
            y = x.copy().reshape(-1)
            idx = rng.integers(0, y.size, 6)
            y[idx] = np.clip(y[idx].astype(np.int64) + rng.integers(-40, 41, 6), lo, hi)
            y = y.reshape(shape)
            my = margin(y)
            if my <= m:
                x, m = y, my
        assert m == 0, "hill climbing did not reach a tie of the two largest logits"
        out.append({name: x})
    return out, g


@pytest.mark.haswell
def test_kws_int8_at_decision_boundaries(tmp_path):
    """KWS int8 on inputs whose two best classes tie: the kernels equal the exact reference bit for
    bit and the oracle within its rounding ties; onnxruntime's fast session, which differs here by
    tens of LSB on the softmax outputs, is reported and never decides."""
    path = mlperf_model("kws_dscnn_int8.onnx")
    inputs, _ = boundary_inputs(path, 3, seed=100)
    b = flow.build(path, "host", tmp_path / "b", quiet=True)
    specs = flow.io_specs(b.summary, "inputs")
    out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
    for feeds in inputs:
        got, _ = LocalRunner().run(b.exe, [feeds[n] for n, _, _ in specs], out_specs)
        res = check_8bit(path, feeds, got, label="boundary input")
        assert res["max_abs_error"] <= 1, res
        assert "note" in res["onnxruntime_fast"]


@pytest.mark.haswell
def test_uint8_model_in_process(tmp_path):
    """One whole uint8 model (KWS quantised by onnxruntime's quantiser through tinydeploy quantize,
    u8 activations x s8 weights) checked in this process, so that under qemu-x86_64 -cpu Haswell
    every onnxruntime call takes the AVX2 path (tests/README.md)."""
    import sys
    from tinydeploy.frontend.quantize import quantize
    from util import REPO
    sys.path.insert(0, str(REPO / "models"))
    import make_calibration
    fp32 = mlperf_model("kws_dscnn_fp32.onnx")
    cal = tmp_path / "cal.npz"
    np.savez(cal, **make_calibration.make(str(fp32), n=8, seed=0))
    q = tmp_path / "kws_u8.onnx"
    quantize(fp32, str(cal), q, activations="uint8", weights="int8", per_channel=True, quiet=True)
    for seed in (0, 1):
        res = flow.run(q, outdir=tmp_path / "run", quiet=True, latency=False, seed=seed)
        assert res["outputs_match"] and res["exact_reference"]["identical"], res


def test_fp32_comparison_unchanged():
    a = [np.array([1.0, 2.0], np.float32)]
    res = reference.compare_outputs(a, [np.array([1.0, 2.00001], np.float32)], 1e-4)
    assert res["outputs_match"] and res["tolerance"] == 1e-4 and "identical_fraction" not in res


def test_lsb_comparison():
    """Every element within 1 LSB matches, whatever the share of identical elements (a 2-element
    output one LSB off is within the promise); 2 LSB does not."""
    want = [np.zeros(200, np.int8)]
    got = np.zeros(200, np.int8)
    got[0] = 1
    res = reference.compare_outputs([got], want, 1e-4)
    assert res["outputs_match"] and res["max_abs_error"] == 1 and res["identical_fraction"] == 0.995
    got[:] = 1
    res = reference.compare_lsb([got], want)
    assert res["outputs_match"] and res["identical_fraction"] == 0.0
    assert reference.compare_lsb([np.array([122, -122], np.int8)], [np.array([121, -121], np.int8)])["outputs_match"]
    got[0] = 2
    assert not reference.compare_lsb([got], want)["outputs_match"]     # 2 LSB
