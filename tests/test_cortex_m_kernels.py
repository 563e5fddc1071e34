"""Cortex-M4 DSP kernel variants (firmware_templates/kernels/*_cortex-m4-dsp.c.j2) and the
portable reference kernels, on the emulated Cortex-M4 (mps2-an386, QEMU).

Each single-layer 8-bit QDQ model is built twice for the same board: with the DSP variants (the
target's default) and with the reference kernels (the variant lookup told to skip the ISA). Both
firmwares run the same inputs; each output must equal tinydeploy's exact reference
(tinydeploy/quant/exact.py, numpy) bit for bit, and differ from the oracle only at rounding ties
(util.check_8bit). The DSP build must also run fewer instructions, and its generated C must
actually use the variant (no silent fallback)."""
from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinydeploy import flow, reference
from tinydeploy.codegen import kernels as kreg
from tinydeploy.runners.mcu import run_under_qemu
from util import check_8bit

ISA = "cortex-m4-dsp"
BOARD = "mps2-an386"

pytestmark = pytest.mark.skipif(shutil.which("arm-none-eabi-gcc") is None or shutil.which("qemu-system-arm") is None,
                                reason="needs arm-none-eabi-gcc and qemu-system-arm")


def _conv_model(C, M, H, W, k, s=(1, 1), pads=(0, 0, 0, 0), group=1, dil=(1, 1), xz=-128, yz=0, act=None,
                w_zp=0, seed=0, xs=0.05, ys=0.08, u8=False):
    qt, tp = (np.uint8, TensorProto.UINT8) if u8 else (np.int8, TensorProto.INT8)
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    cin = C // group
    wq = rng.integers(-128, 128, (M, cin, *k)).astype(np.int8)
    if w_zp:
        wscale = np.float32(4e-3)
        const("w_s", wscale), const("w_z", np.int8(w_zp))
        bscale = np.float32(np.float32(xs) * wscale)
        nodes.append(helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"]))
    else:
        wscale = (np.geomspace(1.0, 8.0, M) * 1e-3).astype(np.float32)
        const("w_s", wscale), const("w_z", np.zeros(M, np.int8))
        bscale = (np.float32(xs) * wscale).astype(np.float32)
        nodes.append(helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"], axis=0))
    const("w_q", wq)
    const("b_q", rng.integers(-3000, 3000, M).astype(np.int32))
    const("b_s", np.broadcast_to(bscale, (M,)).astype(np.float32))
    const("b_z", np.zeros(M, np.int32))
    nodes.append(helper.make_node("DequantizeLinear", ["b_q", "b_s", "b_z"], ["b"], axis=0))
    const("x_s", np.float32(xs)), const("x_z", qt(xz))
    nodes.append(helper.make_node("DequantizeLinear", ["x", "x_s", "x_z"], ["xf"]))
    nodes.append(helper.make_node("Conv", ["xf", "w", "b"], ["c"], kernel_shape=list(k), strides=list(s),
                                  pads=list(pads), group=group, dilations=list(dil)))
    last = "c"
    if act == "relu":
        nodes.append(helper.make_node("Relu", ["c"], ["r"]))
        last = "r"
    const("y_s", np.float32(ys)), const("y_z", qt(yz))
    nodes.append(helper.make_node("QuantizeLinear", [last, "y_s", "y_z"], ["y"]))
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", tp, [1, C, H, W])],
                              [helper.make_tensor_value_info("y", tp, None)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = 9
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    return m


def _run(path, outdir, seeds, optimize="balanced"):
    b = flow.build(path, BOARD, outdir, force=True, quiet=True, optimize=optimize)
    specs = flow.io_specs(b.summary, "inputs")
    out_specs = [(shape, dt) for _, shape, dt in flow.io_specs(b.summary, "outputs")]
    outs, instr = [], None
    for seed in seeds:
        feeds = reference.random_inputs(specs, seed)
        got, n, _ = run_under_qemu(b.firmware, [feeds[name] for name, _, _ in specs], out_specs)
        outs.append((feeds, got))
        instr = n
    source = (outdir / "src" / "td_kernels.c").read_text()
    return outs, instr, source


def _without_isa(monkeypatch):
    real = kreg.resolve
    monkeypatch.setattr(kreg, "resolve", lambda family, dtype, isas: real(family, dtype, [i for i in isas if i != ISA]))


# name: (conv arguments, whether the DSP variant must be used)
CASES = {
    # pointwise GEMM path
    "pw-64x64-odd-pixels": (dict(C=64, M=64, H=7, W=5, k=(1, 1), act="relu"), True),
    "pw-odd-channels-zp-max": (dict(C=7, M=17, H=5, W=9, k=(1, 1), xz=127, yz=-128), True),
    "pw-c3-m18": (dict(C=3, M=18, H=4, W=4, k=(1, 1), xz=0, yz=127), True),
    "pw-stride2": (dict(C=16, M=18, H=9, W=9, k=(1, 1), s=(2, 2), xz=-5), True),
    # im2col GEMM path
    "3x3-pad1-zp-in-loop": (dict(C=5, M=16, H=11, W=7, k=(3, 3), pads=(1, 1, 1, 1), xz=-128, act="relu"), True),
    "3x3-s2-asym-pad": (dict(C=16, M=19, H=10, W=10, k=(3, 3), s=(2, 2), pads=(0, 1, 1, 0), xz=100), True),
    "5x4-s2-c1": (dict(C=1, M=20, H=13, W=10, k=(5, 4), s=(2, 2), pads=(2, 1, 2, 1), xz=83, yz=-128), True),
    # flat pairs along the taps (1 or 3 input channels)
    "3x3-c3-s2-flat": (dict(C=3, M=8, H=11, W=10, k=(3, 3), s=(2, 2), pads=(0, 0, 1, 1), xz=-128), True),
    "10x4-c1-s2-flat-zp": (dict(C=1, M=6, H=13, W=10, k=(10, 4), s=(2, 2), pads=(4, 1, 5, 2), xz=17), True),
    "3x3-c1-odd-taps-flat": (dict(C=1, M=5, H=6, W=7, k=(3, 3), pads=(1, 1, 1, 1), xz=-128, act="relu"), True),
    "3x3-dil2": (dict(C=6, M=16, H=9, W=8, k=(3, 3), pads=(2, 2, 2, 2), dil=(2, 2), xz=-128), True),
    "3x3-c64-tiled": (dict(C=64, M=16, H=5, W=5, k=(3, 3), pads=(1, 1, 1, 1), xz=-128, ys=0.5), True),
    "3x3-c65-chunked-row-form": (dict(C=65, M=6, H=4, W=5, k=(3, 3), pads=(1, 1, 1, 1), xz=-128, ys=0.5), True),
    "3x3-valid-folded-zp": (dict(C=9, M=20, H=6, W=7, k=(3, 3), xz=-77), True),
    # depthwise
    "dw-3x3-pad1": (dict(C=7, M=7, H=9, W=6, k=(3, 3), pads=(1, 1, 1, 1), group=7, xz=-128, act="relu"), True),
    "dw-3x3-s2": (dict(C=16, M=16, H=12, W=11, k=(3, 3), s=(2, 2), pads=(0, 0, 1, 1), group=16, xz=-128), True),
    "dw-3x3-valid-zp": (dict(C=5, M=5, H=7, W=8, k=(3, 3), group=5, xz=37, yz=-100), True),
    "dw-5x5-zp-max": (dict(C=3, M=3, H=8, W=9, k=(5, 5), pads=(2, 2, 2, 2), group=3, xz=127), False),
    "dw-3x3-tiny": (dict(C=4, M=4, H=2, W=3, k=(3, 3), pads=(1, 1, 1, 1), group=4, xz=-128), True),
    "dw-3x3-zx0-padded": (dict(C=3, M=3, H=6, W=7, k=(3, 3), pads=(1, 1, 1, 1), group=3, xz=0), True),
    "dw-3x3-large-plane": (dict(C=2, M=2, H=66, W=65, k=(3, 3), pads=(1, 1, 1, 1), group=2, xz=-128), True),
    "dw-3x3-large-plane-s2": (dict(C=2, M=2, H=67, W=66, k=(3, 3), s=(2, 2), pads=(0, 0, 1, 1), group=2, xz=5), True),
    # uint8 activations (zero-extended)
    "u8-pw": (dict(C=16, M=12, H=5, W=6, k=(1, 1), xz=128, yz=0, u8=True, act="relu"), True),
    "u8-3x3-pad-words": (dict(C=6, M=9, H=9, W=10, k=(3, 3), pads=(1, 1, 1, 1), xz=200, yz=255, u8=True), True),
    "u8-3x3-c3-flat": (dict(C=3, M=8, H=8, W=7, k=(3, 3), s=(2, 2), pads=(1, 1, 1, 1), xz=3, u8=True), True),
    "u8-dw-3x3": (dict(C=5, M=5, H=8, W=9, k=(3, 3), pads=(1, 1, 1, 1), group=5, xz=255, yz=10, u8=True), True),
    "u8-dw-3x3-large-s2": (dict(C=2, M=2, H=66, W=67, k=(3, 3), s=(2, 2), pads=(1, 1, 1, 1), group=2, xz=128, u8=True),
                           True),
    # not specialised: must fall back to the reference and still match
    "row-form-m8": (dict(C=3, M=8, H=6, W=6, k=(3, 3), pads=(1, 1, 1, 1), xz=-128), True),
    "row-form-m6-s2": (dict(C=4, M=6, H=9, W=7, k=(3, 3), s=(2, 2), pads=(1, 1, 1, 1), xz=-128), True),
    "grouped-conv": (dict(C=8, M=8, H=5, W=5, k=(3, 3), pads=(1, 1, 1, 1), group=2, xz=-128), False),
    # int16 weights (w - zw): packed in pairs like int8 ones
    "weight-zero-point": (dict(C=8, M=16, H=4, W=4, k=(1, 1), w_zp=3), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qconv_dsp_matches_reference(case, tmp_path, monkeypatch):
    kw, specialised = CASES[case]
    path = tmp_path / "m.onnx"
    onnx.save(_conv_model(**kw), str(path))
    _check(path, case, specialised, "qconv2d", tmp_path, monkeypatch)


def _dense_model(M, K, N, xz=-128, yz=0, relu=False, trans_b=False, w_zp=0, seed=0, u8=False):
    rng = np.random.default_rng(seed)
    qt, tp = (np.uint8, TensorProto.UINT8) if u8 else (np.int8, TensorProto.INT8)
    inits, nodes = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))

    shape = (N, K) if trans_b else (K, N)
    const("w_q", rng.integers(-128, 128, shape).astype(np.int8))
    if w_zp:
        ws = np.float32(3e-3)
        const("w_s", ws), const("w_z", np.int8(w_zp))
        nodes.append(helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"]))
        bs = np.full(N, np.float32(0.05) * ws, np.float32)
    else:
        ws = (np.geomspace(1.0, 6.0, N) * 1e-3).astype(np.float32)
        const("w_s", ws), const("w_z", np.zeros(N, np.int8))
        nodes.append(helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"], axis=0 if trans_b else 1))
        bs = (np.float32(0.05) * ws).astype(np.float32)
    const("b_q", rng.integers(-3000, 3000, N).astype(np.int32)), const("b_s", bs), const("b_z", np.zeros(N, np.int32))
    nodes.append(helper.make_node("DequantizeLinear", ["b_q", "b_s", "b_z"], ["b"], axis=0))
    const("x_s", np.float32(0.05)), const("x_z", qt(xz))
    nodes.append(helper.make_node("DequantizeLinear", ["x", "x_s", "x_z"], ["xf"]))
    nodes.append(helper.make_node("Gemm", ["xf", "w", "b"], ["g"], transB=int(trans_b)))
    last = "g"
    if relu:
        nodes.append(helper.make_node("Relu", ["g"], ["r"]))
        last = "r"
    const("y_s", np.float32(0.06)), const("y_z", qt(yz))
    nodes.append(helper.make_node("QuantizeLinear", [last, "y_s", "y_z"], ["y"]))
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", tp, [M, K])],
                              [helper.make_tensor_value_info("y", tp, None)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = 9
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


DENSE_CASES = {
    "1x640x128-relu": (dict(M=1, K=640, N=128, relu=True), True),
    "3x37x7-odd": (dict(M=3, K=37, N=7, xz=127, yz=-128), True),
    "2x8x5-transb": (dict(M=2, K=8, N=5, trans_b=True, xz=0, yz=127), True),
    "k3-odd-pairs": (dict(M=1, K=3, N=4), True),
    "k2-one-pair-n7": (dict(M=2, K=2, N=7, xz=-1), True),
    "k9-n6-relu": (dict(M=1, K=9, N=6, relu=True), True),
    "weight-zero-point": (dict(M=1, K=16, N=8, w_zp=-2), True),
    "u8-1x33x10": (dict(M=1, K=33, N=10, xz=128, yz=3, u8=True), True),
}


def _check(path, case, specialised, family, tmp_path, monkeypatch, marker="smlad"):
    seeds = (0, 1)
    dsp, n_dsp, src = _run(path, tmp_path / "dsp", seeds)
    with monkeypatch.context() as mp:
        _without_isa(mp)
        ref, n_ref, ref_src = _run(path, tmp_path / "ref", seeds)
    assert ISA not in ref_src
    for (feeds, got), (_, ref_got) in zip(dsp, ref):
        # both firmwares, bit for bit against the exact reference; within the oracle's ties
        check_8bit(path, feeds, got, label=f"{case}: the {ISA} variant")
        check_8bit(path, feeds, ref_got, label=f"{case}: the reference kernels")
    if specialised:
        assert marker in src, f"{case}: the {family} variant fell back to the reference"
        assert n_dsp < n_ref, f"{case}: {n_dsp} instructions with the DSP variant, {n_ref} without"
    else:
        assert marker not in src


@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_qdense_dsp_matches_reference(case, tmp_path, monkeypatch):
    kw, specialised = DENSE_CASES[case]
    path = tmp_path / "m.onnx"
    onnx.save(_dense_model(**kw), str(path))
    _check(path, case, specialised, "qdense", tmp_path, monkeypatch)


@pytest.mark.parametrize("case", ["1x640x128-relu", "3x37x7-odd", "k3-odd-pairs", "u8-1x33x10"])
def test_qdense_int16_weights_inputs_widened_in_registers(case, tmp_path):
    """--optimize speed: int16 weights; with no room for a widened input row under the peak (a
    lone layer has none) the inputs are widened in registers (two groups per iteration where
    their number is even, one otherwise, the last 1-3 inputs apart). Bit-exact."""
    path = tmp_path / "m.onnx"
    onnx.save(_dense_model(**DENSE_CASES[case][0]), str(path))
    outs, _, src = _run(path, tmp_path / "speed", (0,), optimize="speed")
    K = DENSE_CASES[case][0]["K"]
    if K >= 4:
        assert f"td_dsp_dense_i16x_4_u{2 if K // 4 % 2 == 0 else 1}" in src, case
    for feeds, got in outs:
        check_8bit(path, feeds, got, label=f"{case}: int16 weights, inputs widened in registers")


def _add_model(shape_a, shape_b, za, zb, zy, sa, sb, sy, relu=False, u8=False):
    inits, nodes = [], []
    qt, tp = (np.uint8, TensorProto.UINT8) if u8 else (np.int8, TensorProto.INT8)

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))

    for n, z, sc in (("a", za, sa), ("b", zb, sb)):
        const(f"{n}_s", np.float32(sc)), const(f"{n}_z", qt(z))
        nodes.append(helper.make_node("DequantizeLinear", [n, f"{n}_s", f"{n}_z"], [f"{n}f"]))
    nodes.append(helper.make_node("Add", ["af", "bf"], ["s"]))
    last = "s"
    if relu:
        nodes.append(helper.make_node("Relu", ["s"], ["r"]))
        last = "r"
    const("y_s", np.float32(sy)), const("y_z", qt(zy))
    nodes.append(helper.make_node("QuantizeLinear", [last, "y_s", "y_z"], ["y"]))
    graph = helper.make_graph(nodes, "add", [helper.make_tensor_value_info("a", tp, list(shape_a)),
                                             helper.make_tensor_value_info("b", tp, list(shape_b))],
                              [helper.make_tensor_value_info("y", tp, None)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = 9
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


ADD_CASES = {
    # the SMLAL path: same shapes, shift S < 32 (output scale below twice the input scales)
    "resnet-like-relu": (dict(shape_a=(1, 16, 9, 7), shape_b=(1, 16, 9, 7), za=-128, zb=4, zy=-128,
                              sa=0.05, sb=0.11, sy=0.12, relu=True), True),
    "saturating-zp-extremes": (dict(shape_a=(1, 3, 5, 5), shape_b=(1, 3, 5, 5), za=127, zb=-128, zy=0,
                                    sa=0.02, sb=0.03, sy=0.01), True),
    "u8-relu": (dict(shape_a=(1, 8, 5, 5), shape_b=(1, 8, 5, 5), za=128, zb=100, zy=0, sa=0.05, sb=0.07, sy=0.1,
                     relu=True, u8=True), True),
    "exact-ties": (dict(shape_a=(2, 33), shape_b=(2, 33), za=0, zb=0, zy=3, sa=0.5, sb=0.25, sy=1.0), True),
    # the reference: broadcasting, or a shift of 32 or more (output scale far above the inputs')
    "broadcast": (dict(shape_a=(1, 4, 3, 3), shape_b=(1, 4, 1, 1), za=-128, zb=0, zy=0,
                       sa=0.05, sb=0.05, sy=0.1), False),
    "large-shift": (dict(shape_a=(1, 40), shape_b=(1, 40), za=5, zb=-7, zy=0, sa=0.01, sb=0.02, sy=0.5), False),
}


@pytest.mark.parametrize("case", list(ADD_CASES))
def test_qadd_dsp_matches_reference(case, tmp_path, monkeypatch):
    kw, specialised = ADD_CASES[case]
    path = tmp_path / "m.onnx"
    onnx.save(_add_model(**kw), str(path))
    _check(path, case, specialised, "qadd", tmp_path, monkeypatch, marker="smlal")


def test_pack_pairs_layout():
    """Blocks of 4 rows, then per pair the rows of the block; low half column 2k, high 2k + 1."""
    from tinydeploy.schedule.mcu import pack_pairs
    rows = np.arange(-17, 18).reshape(5, 7).astype(np.int32) * 7
    words = pack_pairs(rows).view(np.uint32)
    kp = 4                                   # 7 columns -> 4 pairs, the last with a zero column
    assert words.size == 5 * kp
    for r in range(5):
        block, i, nb = r // 4, r % 4, (4 if r < 4 else 1)
        for k in range(kp):
            w = int(words[block * 4 * kp + k * nb + i])
            lo, hi = (w & 0xFFFF) - ((w & 0x8000) << 1), (w >> 16) - ((w & 0x80000000) >> 15)
            assert lo == rows[r, 2 * k]
            assert hi == (rows[r, 2 * k + 1] if 2 * k + 1 < 7 else 0)


def test_weight_layouts_follow_optimize(monkeypatch):
    """--optimize size keeps every 8-bit weight at one byte; speed takes int16 pairs within
    EXTRA_FLASH_BYTES, the most instructions per extra byte first; balanced only where a layer
    saves at least BALANCED_RATE instructions per byte, within BALANCED_SHARE of the weights."""
    from tests.util import mlperf_model
    from tinydeploy.schedule import mcu
    from tinydeploy.pipeline import compile_model
    from tinydeploy.targets import get_target
    target = get_target("cortex-m4")

    def layouts(name, optimize):
        c = compile_model(mlperf_model(name), target, board="mps2-an386", optimize=optimize)
        return [k for k in c.kernels if k is not None and "WL" in k.params]

    ad = layouts("ad_autoencoder_int8.onnx", "size")
    assert len(ad) == 10 and {k.params["WL"] for k in ad} == {"i8pair"}
    assert all(k.scratch_bytes == 0 for k in ad)      # the inputs are widened in registers
    assert {k.params["WL"] for k in layouts("ad_autoencoder_int8.onnx", "speed")} == {"i16"}
    # dense layers gain a sixteenth of an instruction per extra byte: balanced keeps one byte
    assert {k.params["WL"] for k in layouts("ad_autoencoder_int8.onnx", "balanced")} == {"i8pair"}
    monkeypatch.setattr(mcu, "EXTRA_FLASH_BYTES", 50_000)   # 640x128 needs 81,920 more bytes
    some = [k for k in layouts("ad_autoencoder_int8.onnx", "speed") if k.params["WL"] == "i16"]
    assert 0 < len(some) < 10
    assert all(k.params["K"] * k.params["N"] < 640 * 128 for k in some)
    assert sum(k.params["FLASH_EXTRA"] for k in some) <= 50_000
    # balanced on VWW: the high-resolution early layers (most MACs per weight) get int16 pairs
    vww = [k for k in layouts("vww_mobilenetv1_int8.onnx", "balanced") if k.family == "qconv2d"]
    wide = [k for k in vww if k.params["WL"] == "i16"]
    weights = sum(k.params["M"] * k.params["C"] * k.params["KH"] * k.params["KW"] for k in vww)
    assert wide and sum(k.params["FLASH_EXTRA"] for k in wide) <= weights * mcu.BALANCED_SHARE
    assert min(k.params["OH"] * k.params["OW"] for k in wide) >= max(
        k.params["OH"] * k.params["OW"] for k in vww if k.params["WL"] != "i16")


def _f32_conv_model(C, M, H, W, k, s=(1, 1), pads=(0, 0, 0, 0), dil=(1, 1), bias=True, act=None, seed=0):
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((M, C, *k)).astype(np.float32) * 0.3, "w")]
    ins = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(M).astype(np.float32), "b"))
        ins.append("b")
    nodes = [helper.make_node("Conv", ins, ["c"], kernel_shape=list(k), strides=list(s), pads=list(pads),
                              dilations=list(dil))]
    if act == "relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", ["c"], ["y"]))
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, H, W])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


F32_CASES = {
    "3x3-pad1-odd-pixels": dict(C=5, M=9, H=7, W=5, k=(3, 3), pads=(1, 1, 1, 1), act="relu"),
    "1x1-c64-m64": dict(C=64, M=64, H=5, W=5, k=(1, 1)),
    "10x4-s2-c1-no-bias": dict(C=1, M=6, H=13, W=10, k=(10, 4), s=(2, 2), pads=(4, 1, 5, 2), bias=False),
    "3x3-s2-asym-dil": dict(C=3, M=4, H=11, W=9, k=(3, 3), s=(2, 2), pads=(2, 0, 1, 2), dil=(2, 1)),
    "3x3-c96-two-pixel-tiles": dict(C=96, M=3, H=4, W=3, k=(3, 3), pads=(1, 1, 1, 1)),
    "5x5-odd-k-m1": dict(C=1, M=1, H=12, W=11, k=(5, 5)),
}


@pytest.mark.parametrize("case", list(F32_CASES))
def test_conv_f32_fpu_variant(case, tmp_path, monkeypatch):
    """The FPU GEMM variant (cortex-m4-fpu) against onnxruntime (fp32 tolerance; it fuses the
    multiply-adds, so it is not bit-identical to the reference) and cheaper than the reference."""
    path = tmp_path / "m.onnx"
    onnx.save(_f32_conv_model(**F32_CASES[case]), str(path))
    got, n_fpu, src = _run(path, tmp_path / "fpu", (0, 1))
    with monkeypatch.context() as mp:
        real = kreg.resolve
        mp.setattr(kreg, "resolve", lambda family, dtype, isas: real(family, dtype, [i for i in isas if i != "cortex-m4-fpu"]))
        _, n_ref, ref_src = _run(path, tmp_path / "ref", (0,))
    assert "vfma" in src and "vfma" not in ref_src, f"{case}: the FPU variant was not used"
    assert n_fpu < n_ref, f"{case}: {n_fpu} instructions with the FPU variant, {n_ref} without"
    for feeds, outs in got:
        want = reference.run_onnxruntime(path.read_bytes(), feeds)
        for a, b in zip(outs, want):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))


def test_fp32_selection_on_cortex_m():
    """fp32 on Cortex-M4: one-group convolutions take the FPU GEMM (weights in 4-channel blocks,
    same bytes), depthwise ones the padded-plane kernel, tiny ones the reference."""
    from tests.util import mlperf_model
    from tinydeploy.pipeline import compile_model
    from tinydeploy.targets import get_target
    c = compile_model(mlperf_model("kws_dscnn_fp32.onnx"), get_target("cortex-m4"), board="mps2-an386")
    convs = [k for k in c.kernels if k is not None and k.family in ("conv2d", "conv2d_dw")]
    assert [k.family for k in convs] == ["conv2d"] + ["conv2d_dw", "conv2d"] * 4
    assert all(k.params.get("PACKED") for k in convs if k.family == "conv2d")
    # the GEMM tiles are sized to the room under the peak (planner): never above the lower bound
    assert all(k.scratch_bytes <= 4 * 64 * 64 for k in convs if k.family == "conv2d")
    assert c.plan.arena_bytes <= c.plan.lower_bound


def _chain_model(layers, C, H, W, nhwc=False, seed=0):
    """An int8 QDQ model of consecutive convolutions (each (M, k, stride, pads, group) with a
    Relu), optionally reading an NHWC input through a Transpose: what patch-based execution runs
    row by row (schedule/stream.py)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    const("x_s", np.float32(0.05)), const("x_z", np.int8(-128))
    src = "x"
    if nhwc:
        nodes.append(helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 3, 1, 2]))
        src = "xt"
    nodes.append(helper.make_node("DequantizeLinear", [src, "x_s", "x_z"], ["a0"]))
    cin, scale = C, np.float32(0.05)
    for i, (M, k, s, pads, group) in enumerate(layers):
        ws = (np.geomspace(1.0, 4.0, M) * 2e-3).astype(np.float32)
        const(f"w{i}_q", rng.integers(-128, 128, (M, cin // group, k, k)).astype(np.int8))
        const(f"w{i}_s", ws), const(f"w{i}_z", np.zeros(M, np.int8))
        const(f"b{i}_q", rng.integers(-2000, 2000, M).astype(np.int32))
        const(f"b{i}_s", (scale * ws).astype(np.float32)), const(f"b{i}_z", np.zeros(M, np.int32))
        nodes.append(helper.make_node("DequantizeLinear", [f"w{i}_q", f"w{i}_s", f"w{i}_z"], [f"w{i}"], axis=0))
        nodes.append(helper.make_node("DequantizeLinear", [f"b{i}_q", f"b{i}_s", f"b{i}_z"], [f"b{i}"], axis=0))
        nodes.append(helper.make_node("Conv", [f"a{i}", f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[k, k],
                                      strides=[s, s], pads=list(pads), group=group))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        scale = np.float32(0.06 + 0.01 * i)
        const(f"y{i}_s", scale), const(f"y{i}_z", np.int8(-128))
        out = "y" if i == len(layers) - 1 else f"q{i}"
        nodes.append(helper.make_node("QuantizeLinear", [f"r{i}", f"y{i}_s", f"y{i}_z"], [out]))
        if out != "y":
            nodes.append(helper.make_node("DequantizeLinear", [out, f"y{i}_s", f"y{i}_z"], [f"a{i + 1}"]))
        cin = M
    shape = [1, H, W, C] if nhwc else [1, C, H, W]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.INT8, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.INT8, None)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = 9
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


CHAIN_CASES = {
    # MobileNet's start: 3x3 s2 with asymmetric padding, depthwise, pointwise; odd sizes so the
    # last row and column of every layer are borders, the input NHWC (the Transpose folded in)
    "nhwc-s2-dw-pw-odd": (dict(layers=[(8, 3, 2, (0, 0, 1, 1), 1), (8, 3, 1, (1, 1, 1, 1), 8),
                                       (16, 1, 1, (0, 0, 0, 0), 1), (16, 3, 2, (1, 1, 1, 1), 16),
                                       (4, 1, 1, (0, 0, 0, 0), 1)], C=3, H=37, W=35, nhwc=True)),
    # NCHW source, a stride-1 3x3 GEMM layer with padding on every side, then strided depthwise
    "nchw-3x3-dw-s2": (dict(layers=[(16, 3, 1, (1, 1, 1, 1), 1), (16, 3, 2, (1, 1, 1, 1), 16),
                                    (4, 1, 1, (0, 0, 0, 0), 1), (4, 3, 2, (0, 0, 1, 1), 4)], C=8, H=33, W=30)),
}


@pytest.mark.parametrize("case", list(CHAIN_CASES))
def test_patch_based_chain_matches_reference(case, tmp_path, monkeypatch):
    """Patch-based execution (the planner's choice, schedule/stream.py): the chain is taken (the
    arena below the per-layer lower bound) and every output equals the exact reference bit for
    bit, rows at the top and bottom borders (padding rows) included."""
    path = tmp_path / "m.onnx"
    onnx.save(_chain_model(**CHAIN_CASES[case]), str(path))
    b = flow.build(path, BOARD, tmp_path / "p", force=True, quiet=True)
    src = (tmp_path / "p" / "src" / "td_kernels.c").read_text()
    mem = {key: b.summary[key] for key in ("arena_bytes", "lower_bound_bytes", "notes")}
    assert "patch-based" in src, f"{case}: no patch-based chain taken ({mem})"
    assert mem["arena_bytes"] < mem["lower_bound_bytes"], mem
    specs = flow.io_specs(b.summary, "inputs")
    out_specs = [(shape, dt) for _, shape, dt in flow.io_specs(b.summary, "outputs")]
    for seed in (0, 1):
        feeds = reference.random_inputs(specs, seed)
        got, _, _ = run_under_qemu(b.firmware, [feeds[name] for name, _, _ in specs], out_specs)
        check_8bit(path, feeds, got, label=f"{case}: patch-based")
