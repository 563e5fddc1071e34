"""The vector fp32 kernels of schedule/depthwise.py, first.py and gemv.py (conv2d_dw, conv2d_first,
dense_gemv for avx2, avx512 and neon) against onnxruntime and against the reference kernels, over
shapes that hit their edges: odd channels, channel multipliers, tails of vectors, pixel tiles and
channel blocks, flat (narrow, same-padded) and row-blocked depthwise planes, stride 2 through
column-phase planes, asymmetric and no padding, dilation, 5x5, 3x1 and 1x1 windows, 1 to 4 input
channels, NHWC inputs whose Transpose the first layer reads through (and one it must not),
batch 2, no bias, 2-D bias, vector and scalar activations. Each family is one model whose
branches are the cases (one build per compiler, not one per shape): gcc, clang and ASan/UBSan
on the host, the NEON variants cross-built and run under qemu-aarch64; the AVX-512 variants are
compiled with gcc and clang (this CPU cannot run them, nor can QEMU 7.2)."""
from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from test_fast_kernels import HOST_ISAS, neon_matches_onnxruntime_and_ref, outputs_of, use_host
from tinydeploy import flow, reference, targets
from util import check_model, make_model, require, save

RNG = 4321


def _act(nodes, inits, src, dst, act, tag):
    if act == "relu":
        nodes.append(helper.make_node("Relu", [src], [dst]))
    elif act == "relu6":
        inits += [helper.make_tensor(f"lo{tag}", TensorProto.FLOAT, [], [0.0]),
                  helper.make_tensor(f"hi{tag}", TensorProto.FLOAT, [], [6.0])]
        nodes.append(helper.make_node("Clip", [src, f"lo{tag}", f"hi{tag}"], [dst]))
    elif act == "leaky":
        nodes.append(helper.make_node("LeakyRelu", [src], [dst], alpha=0.1))
    else:
        nodes.append(helper.make_node("Identity", [src], [dst]))


def branches(cases: dict, seed: int = RNG) -> onnx.ModelProto:
    """One model, one input and one output per case: conv (NCHW, or NHWC through a Transpose,
    `shared`: the transposed tensor has a second reader) or gemm."""
    rng = np.random.default_rng(seed)
    nodes, inits, ins, outs = [], [], [], []

    def const(name, shape):
        inits.append(helper.make_tensor(name, TensorProto.FLOAT, list(shape),
                                        rng.standard_normal(shape).astype(np.float32).ravel()))
        return name
    for i, (name, c) in enumerate(cases.items()):
        x, y, act = f"x{i}", f"y_{name}", c.get("act")
        if c["op"] == "gemm":
            m, k, n = c["m"], c["k"], c["n"]
            args = [x, const(f"w{i}", (n, k))]
            if c.get("bias", "row"):
                args.append(const(f"b{i}", (m, n) if c.get("bias") == "2d" else (n,)))
            nodes.append(helper.make_node("Gemm", args, [f"g{i}"], transB=1))
            _act(nodes, inits, f"g{i}", y, act, i)
            ins.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, [m, k]))
            outs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, [m, n]))
            continue
        nb, ch, h, w, m = c.get("n", 1), c["c"], c["h"], c["w"], c["m"]
        kh, kw = c.get("k", (3, 3))
        sh, sw = c.get("s", (1, 1))
        dh, dw = c.get("d", (1, 1))
        pads = c.get("pads", (1, 1, 1, 1))
        g = c.get("group", 1)
        src = x
        if c.get("nhwc"):
            nodes.append(helper.make_node("Transpose", [x], [f"t{i}"], perm=[0, 3, 1, 2]))
            src = f"t{i}"
            ins.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, [nb, h, w, ch]))
        else:
            ins.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, [nb, ch, h, w]))
        args = [src, const(f"w{i}", (m, ch // g, kh, kw))]
        if c.get("bias", True):
            args.append(const(f"b{i}", (m,)))
        nodes.append(helper.make_node("Conv", args, [f"c{i}"], kernel_shape=[kh, kw], strides=[sh, sw],
                                      dilations=[dh, dw], pads=list(pads), group=g))
        _act(nodes, inits, f"c{i}", y, act, i)
        oh = (h + pads[0] + pads[2] - dh * (kh - 1) - 1) // sh + 1
        ow = (w + pads[1] + pads[3] - dw * (kw - 1) - 1) // sw + 1
        outs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, [nb, m, oh, ow]))
        if c.get("shared"):     # a second reader of the transposed input: nothing to fold
            nodes.append(helper.make_node("ReduceMean", [src], [f"r_{name}"], keepdims=0))
            outs.append(helper.make_tensor_value_info(f"r_{name}", TensorProto.FLOAT, []))
    return make_model(nodes, ins, outs, inits)


DW = {
    "flat_narrow_odd": dict(c=5, h=7, w=5, act="relu6"),                          # flat, mask both columns
    "flat_mult2_nobias": dict(c=3, m=6, h=6, w=6, bias=False),                    # flat, 2 outputs per plane
    "flat_tiny": dict(c=4, h=3, w=3, act="relu"),                                 # one vector per plane
    "rows_wide_tail": dict(c=4, h=11, w=19, act="relu"),                          # 2 vectors + 3-lane tail
    "rows_12": dict(c=3, h=12, w=12, act="leaky"),                                # scalar activation pass
    "s2_asym_odd": dict(c=3, h=9, w=13, s=(2, 2), pads=(0, 0, 1, 1), act="relu6"),
    "s2_tiny": dict(c=2, h=2, w=3, s=(2, 2)),
    "s2_5x5_pad2": dict(c=4, h=13, w=12, k=(5, 5), s=(2, 2), pads=(2, 2, 2, 2), bias=False),
    "dilation2": dict(c=3, h=11, w=9, d=(2, 2), pads=(2, 2, 2, 2)),
    "nopad_batch2": dict(n=2, c=5, h=6, w=10, pads=(0, 0, 0, 0)),
    "k3x1": dict(c=3, h=8, w=9, k=(3, 1), pads=(1, 0, 1, 0), act="relu"),
    "k1x1": dict(c=6, h=4, w=5, k=(1, 1), pads=(0, 0, 0, 0)),
    "s2_mult2_wide": dict(c=2, m=4, h=20, w=33, s=(2, 2), pads=(1, 1, 1, 1), act="relu"),
    # avx2 splits 16 columns into the two phases at once (depthwise.py SPLIT8): whole vectors,
    # then the columns left over on each side, with and without left padding
    "s2_split_tails": dict(c=3, h=9, w=41, s=(2, 2), pads=(0, 0, 1, 1), act="relu6"),
    "s2_split_5x5": dict(c=2, h=11, w=40, k=(5, 5), s=(2, 2), pads=(2, 2, 2, 2)),
}
DW = {k: dict(v, op="conv", m=v.get("m", v["c"]), group=v["c"]) for k, v in DW.items()}

FIRST = {
    "c1_10x4_s2": dict(c=1, h=49, w=10, m=20, k=(10, 4), s=(2, 2), pads=(4, 1, 5, 1), act="relu"),
    "c3_nhwc_s2": dict(c=3, h=17, w=15, m=8, s=(2, 2), pads=(0, 0, 1, 1), act="relu6", nhwc=True),
    "c3_nhwc_s1_tail": dict(c=3, h=9, w=11, m=16, act="relu", nhwc=True),
    "c3_7x7_s2_odd_m": dict(c=3, h=23, w=21, m=13, k=(7, 7), s=(2, 2), pads=(3, 3, 3, 3), bias=False),
    "c2_dilated_leaky": dict(c=2, h=12, w=11, m=9, d=(2, 2), pads=(2, 2, 2, 2), act="leaky"),
    "c4_batch2": dict(n=2, c=4, h=7, w=6, m=8),
    "c3_nhwc_shared": dict(c=3, h=8, w=8, m=8, nhwc=True, shared=True),
    "c3_fewer_pixels_than_tile": dict(c=3, h=3, w=3, m=5, pads=(0, 0, 0, 0), s=(2, 2), k=(1, 1)),
    # output rows of whole tiles (OW % 8 == 0): one origin per tile, the pixels at fixed offsets
    "c3_nhwc_s2_rows": dict(c=3, h=33, w=32, m=8, s=(2, 2), pads=(0, 0, 1, 1), act="relu", nhwc=True),
    "c1_rows_batch2_odd_m": dict(n=2, c=1, h=5, w=16, m=12, act="relu6"),
    # NEON, stride 1 and rows of whole vectors: pixels in the lanes (LD2/LD3 of NHWC rows, one load
    # per NCHW plane), 16-channel blocks with channels past M, the scalar activation pass
    "c3_nhwc_lanes_two_blocks": dict(c=3, h=10, w=12, m=20, act="relu", nhwc=True),
    "c2_nhwc_lanes_dilated": dict(c=2, h=11, w=12, m=16, d=(2, 2), pads=(2, 2, 2, 2), act="relu6", nhwc=True),
    "c1_lanes_5x5_nobias": dict(c=1, h=9, w=8, m=16, k=(5, 5), pads=(2, 2, 2, 2), bias=False),
    "c4_nchw_lanes_batch2_leaky": dict(n=2, c=4, h=6, w=8, m=8, act="leaky"),
}
FIRST = {k: dict(v, op="conv") for k, v in FIRST.items()}

GEMV = {
    "n2_k256": dict(m=1, k=256, n=2),
    "n12_k64_relu": dict(m=1, k=64, n=12, act="relu"),
    "n37_k33": dict(m=1, k=33, n=37, bias=None),
    "n130_k19_tail": dict(m=1, k=19, n=130, act="relu6"),
    "m2_bias2d_leaky": dict(m=2, k=40, n=9, bias="2d", act="leaky"),
    "m3_n64": dict(m=3, k=7, n=64),
    # NEON: 16-vector panels, a partial last panel of 2 and of 3 vectors, the 16-input loop with
    # groups of four and single inputs after it, fewer than four inputs, no bias under ReLU
    "n200_k21_relu": dict(m=1, k=21, n=200, act="relu"),
    "n75_k3_nobias_relu": dict(m=1, k=3, n=75, bias=None, act="relu"),
    "m2_n10_k48_relu6": dict(m=2, k=48, n=10, act="relu6"),
}
GEMV = {k: dict(v, op="gemm") for k, v in GEMV.items()}

FAMILIES = {"conv2d_dw": DW, "conv2d_first": FIRST, "dense_gemv": GEMV}
SIMD = [isa for isa in HOST_ISAS if isa != "ref"]


def _model(tmp_path, algo):
    return save(branches(FAMILIES[algo]), tmp_path, f"{algo}.onnx")


def _expect(src: str, algo: str, isa: str) -> None:
    """Every branch got the vector kernel (the generated code names each function's ISA)."""
    n = len(FAMILIES[algo])
    calls = len(re.findall(rf"/\* {algo} f32 \({isa}\)", src))
    assert calls >= 1 and f"{algo} f32 (ref)" not in src, src[:400]
    assert len(re.findall(rf"\[{algo} {isa}", src)) >= min(n, calls)


@pytest.mark.parametrize("algo", list(FAMILIES))
@pytest.mark.parametrize("isa", SIMD[:1] or ["avx2"])
def test_vector_kernels_on_host(algo, isa, tmp_path, monkeypatch):
    """gcc, clang and ASan/UBSan builds match onnxruntime; gcc matches the reference kernels."""
    if isa not in HOST_ISAS:
        pytest.skip(f"this CPU has no {isa}")
    use_host(monkeypatch, isa)
    monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
    path = _model(tmp_path, algo)
    check_model(path, tmp_path)
    fast, x, src = outputs_of(path, tmp_path / "build-gcc")
    _expect(src, algo, isa)
    monkeypatch.setenv("TINYDEPLOY_ALGO", "ref")
    ref, _, ref_src = outputs_of(path, tmp_path / "ref", x)
    assert f"{algo} f32" not in ref_src
    res = reference.compare(fast, ref, 1e-5)
    assert res["outputs_match"], res


def test_the_input_transpose_is_read_through(tmp_path, monkeypatch):
    """The first layers of the NHWC branches read the graph input: their Transposes have no code
    and no buffer; the Transpose with a second reader stays."""
    use_host(monkeypatch, SIMD[0] if SIMD else "ref")
    monkeypatch.setenv("TINYDEPLOY_ALGO", "conv2d_first")
    path = _model(tmp_path, "conv2d_first")
    b = flow.build(path, "host", tmp_path / "b", quiet=True)
    if not SIMD:
        pytest.skip("no vector ISA here: the reference kernels keep the Transposes")
    comp = b.compiled
    names = list(FIRST)
    folded = {f"t{names.index(n)}" for n, c in FIRST.items() if c.get("nhwc") and not c.get("shared")}
    kept = {f"t{names.index(n)}" for n, c in FIRST.items() if c.get("shared")}
    assert folded and not folded & set(comp.plan.offsets), "a folded Transpose's output has a buffer"
    assert kept <= set(comp.plan.offsets)
    model_c = (tmp_path / "b" / "model.c").read_text()
    assert model_c.count("read through by a later layer's kernel: no code") == len(folded)
    assert (tmp_path / "b" / "td_kernels.c").read_text().count("NHWC input: transpose folded") == len(folded)
    # the same model without the fold, arena for arena: the fold saves the transposed copies
    monkeypatch.setenv("TINYDEPLOY_ALGO", "conv2d_igemm")
    plain = flow.build(path, "host", tmp_path / "plain", quiet=True).compiled
    assert all(t in plain.plan.offsets for t in folded)


@pytest.mark.parametrize("algo", list(FAMILIES))
def test_avx512_variants_compile(algo, tmp_path, monkeypatch):
    """This CPU has no AVX-512 (nor does qemu-x86_64 7.2): the variants are built with gcc and
    clang (-mavx512f), not run; their code is AVX-512 code."""
    use_host(monkeypatch, "avx512")
    monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
    path = _model(tmp_path, algo)
    for cc in ("gcc", "clang"):
        require(cc)
        flow.build(path, "host", tmp_path / cc, quiet=True, cc=cc)
        src = (tmp_path / cc / "td_kernels.c").read_text()
        _expect(src, algo, "avx512")
        assert "_mm512_" in src


@pytest.mark.parametrize("algo", list(FAMILIES))
def test_neon_variants_under_qemu(algo, tmp_path, monkeypatch):
    """The NEON variants, cross-built for the Raspberry Pi 4 and run under qemu-aarch64: against
    onnxruntime, and against the reference kernels in the same emulator."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
    path = _model(tmp_path, algo)
    _expect(neon_matches_onnxruntime_and_ref(path, tmp_path, monkeypatch), algo, "neon")


def test_no_reference_dense_on_aarch64(tmp_path):
    """Unforced, every fp32 dense layer of a Cortex-A build is a vector kernel (dense_gemv or
    dense_packed), however small (MLPerf AD has 128x8 layers)."""
    path = _model(tmp_path, "dense_gemv")
    from tinydeploy.pipeline import compile_model
    from tinydeploy.targets import boards
    for board in ("rpi4", "jetson-orin", "jetson-xavier"):
        comp = compile_model(path, boards.get_board(board).make_target(), board=board)
        fams = [k.family for k in comp.kernels if k is not None]
        assert fams and all(f in ("dense_gemv", "dense_packed") for f in fams), fams
        src = comp.files["td_kernels.c"]
        assert "vfmaq_f32(" in src or "fmla %[a0].4s" in src
