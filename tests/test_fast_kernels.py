"""Fast fp32 kernels (tinydeploy/schedule.py): every algorithm (conv2d_gemm, conv2d_igemm,
conv2d_gemmt, conv2d_dw, dense_packed) and every micro-kernel variant against onnxruntime AND against the reference
kernel, over shapes that hit every edge: tails in M, N and K, several kc/mc/nc blocks (a target
with tiny caches), 1x1 / 3x3 / 5x5 / 7x7, strides, pads, groups, depthwise, dilation, batch 2,
layers smaller than one tile. Host variants are built with gcc, clang and gcc+ASan/UBSan; the
NEON variant is cross-built and run under qemu-aarch64."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tinydeploy import flow, reference, targets
from tinydeploy import schedule
from tinydeploy.runners import select_runner
from util import check_model, make_model, require, save

RNG_SEED = 1234


def host_isas() -> list[str]:
    f = targets.cpu_features()
    out = ["ref"]
    if f["avx2"] and f["fma"]:
        out.append("avx2")
    if f["avx2"] and f["fma"] and f["avx512f"]:
        out.append("avx512")
    return out


HOST_ISAS = host_isas() if __import__("platform").machine() in ("x86_64", "AMD64") else ["ref"]
ISA_FLAGS = {"ref": [], "avx2": ["-mavx2", "-mfma"], "avx512": ["-mavx2", "-mfma", "-mavx512f"]}


def use_host(monkeypatch, isa: str, small_caches: bool = False) -> None:
    """Make the 'host' target prefer `isa` (ref: portable micro-kernel, no SIMD flags); small
    caches shrink kc/mc/nc so that small layers run several blocks of each loop."""
    def make():
        t = targets.host()
        flags = [f for f in t.cflags if not f.startswith(("-mavx", "-mfma"))] + ISA_FLAGS[isa]
        t = dataclasses.replace(t, cflags=flags, isas=[] if isa == "ref" else [isa])
        if small_caches:
            t = dataclasses.replace(t, l1d_bytes=2048, l2_bytes=16384)
        return t
    monkeypatch.setitem(targets.TARGETS, "host", make)


# ---- models --------------------------------------------------------------------------------

def conv_model(n=1, c=4, h=8, w=8, m=8, k=(3, 3), stride=(1, 1), pads=(1, 1, 1, 1), group=1,
               dil=(1, 1), bias=True, act=None, auto_pad=None, bn=False, seed=RNG_SEED) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    one_d = len(k) == 1
    wshape = [m, c // group, *k]
    inits = [helper.make_tensor("w", TensorProto.FLOAT, wshape, rng.standard_normal(wshape).astype(np.float32).ravel())]
    ins = ["x", "w"]
    if bias:
        inits.append(helper.make_tensor("b", TensorProto.FLOAT, [m], rng.standard_normal(m).astype(np.float32)))
        ins.append("b")
    attrs = {"kernel_shape": list(k), "strides": list(stride), "dilations": list(dil), "group": group}
    if auto_pad:
        attrs["auto_pad"] = auto_pad
    else:
        attrs["pads"] = list(pads)
    nodes = [helper.make_node("Conv", ins, ["c"], **attrs)]
    last = "c"
    if bn:
        for nm, val in (("s", rng.uniform(0.5, 1.5, m)), ("bb", rng.standard_normal(m)), ("mu", rng.standard_normal(m)),
                        ("var", rng.uniform(0.5, 2.0, m))):
            inits.append(helper.make_tensor(nm, TensorProto.FLOAT, [m], val.astype(np.float32)))
        nodes.append(helper.make_node("BatchNormalization", ["c", "s", "bb", "mu", "var"], ["bn"]))
        last = "bn"
    if act == "relu":
        nodes.append(helper.make_node("Relu", [last], ["y"]))
    elif act == "relu6":
        inits += [helper.make_tensor("lo", TensorProto.FLOAT, [], [0.0]), helper.make_tensor("hi", TensorProto.FLOAT, [], [6.0])]
        nodes.append(helper.make_node("Clip", [last, "lo", "hi"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    xshape = [n, c, w] if one_d else [n, c, h, w]
    spatial = xshape[2:]
    r = len(spatial)
    if auto_pad:
        out = [-(-spatial[i] // stride[i]) for i in range(r)]
    else:
        out = [(spatial[i] + pads[i] + pads[i + r] - dil[i] * (k[i] - 1) - 1) // stride[i] + 1 for i in range(r)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, xshape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, m, *out])
    return make_model(nodes, [x], [y], inits)


def dense_model(m=7, k=33, n=21, bias="row", act=None, matmul3d=False, seed=RNG_SEED) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [n, k], rng.standard_normal((n, k)).astype(np.float32).ravel())]
    if matmul3d:   # MatMul with constant [K][N] on a 3-D input: rows = 2*m
        wt = rng.standard_normal((k, n)).astype(np.float32)
        inits = [helper.make_tensor("wt", TensorProto.FLOAT, [k, n], wt.ravel())]
        nodes = [helper.make_node("MatMul", ["x", "wt"], ["g"])]
        xshape = [2, m, k]
    else:
        ins = ["x", "w"]
        if bias:
            bshape = [m, n] if bias == "2d" else [n]
            inits.append(helper.make_tensor("c", TensorProto.FLOAT, bshape, rng.standard_normal(bshape).astype(np.float32).ravel()))
            ins.append("c")
        nodes = [helper.make_node("Gemm", ins, ["g"], transB=1, alpha=0.75, beta=1.25)]
        xshape = [m, k]
    nodes.append(helper.make_node("Relu" if act == "relu" else "Identity", ["g"], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, xshape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, m, n] if matmul3d else [m, n])
    return make_model(nodes, [x], [y], inits)


# name -> (model kwargs, algorithms that must be chosen when forced)
CONV_CASES = {
    "1x1_direct_odd": dict(c=13, h=7, w=9, m=19, k=(1, 1), pads=(0, 0, 0, 0)),
    "1x1_small_plane_batch2": dict(n=2, c=40, h=3, w=5, m=70, k=(1, 1), pads=(0, 0, 0, 0), act="relu6"),
    "1x1_deep_k1100": dict(c=1100, h=3, w=5, m=13, k=(1, 1), pads=(0, 0, 0, 0)),   # K past 1024: gemmt (stage 4)
    "1x1_stride2": dict(c=8, h=9, w=11, m=10, k=(1, 1), stride=(2, 2), pads=(0, 0, 0, 0), act="relu"),
    "3x3_pad_relu": dict(c=5, h=10, w=13, m=17, act="relu"),
    "3x3_stride2_bn": dict(c=6, h=11, w=11, m=24, stride=(2, 2), bn=True, act="relu"),
    "5x5_pad2": dict(c=3, h=12, w=10, m=7, k=(5, 5), pads=(2, 2, 2, 2), bias=False),
    "7x7_stride2_pad3": dict(c=3, h=19, w=17, m=9, k=(7, 7), stride=(2, 2), pads=(3, 3, 3, 3)),
    "3x3_dilation2": dict(c=4, h=12, w=12, m=11, dil=(2, 2), pads=(2, 2, 2, 2)),
    "asymmetric_same_upper": dict(c=4, h=7, w=8, m=6, k=(4, 3), stride=(2, 1), auto_pad="SAME_UPPER"),
    "grouped3": dict(c=12, h=8, w=9, m=18, group=3),
    "batch2": dict(n=2, c=6, h=8, w=8, m=20, act="relu6"),
    "big_k": dict(c=40, h=6, w=7, m=40),
    "smaller_than_tile": dict(c=2, h=3, w=3, m=3, pads=(0, 0, 0, 0)),
    "conv1d": dict(c=5, w=20, m=9, k=(3,), stride=(1,), pads=(1, 1), dil=(1,)),
    # implicit GEMM with whole tiles and no padding columns: tiles stored straight into y
    "1x1_stride2_whole_tiles": dict(c=16, h=16, w=16, m=48, k=(1, 1), stride=(2, 2), pads=(0, 0, 0, 0),
                                    act="relu"),
}
DW_CASES = {
    "dw_3x3_relu6": dict(c=16, h=9, w=7, m=16, group=16, act="relu6"),
    "dw_3x3_stride2_mult2": dict(c=8, h=10, w=11, m=16, group=8, stride=(2, 2)),
    # stride 2 through the 4 phase planes: odd sizes, asymmetric pads, 5x5, no bias
    "dw_3x3_stride2_asym_odd": dict(c=3, h=9, w=7, m=3, group=3, stride=(2, 2), pads=(0, 0, 1, 1), act="relu6"),
    "dw_5x5_stride2_pad2": dict(c=4, h=13, w=12, m=4, k=(5, 5), group=4, stride=(2, 2), pads=(2, 2, 2, 2),
                                bias=False),
    "dw_3x3_stride2_tiny": dict(c=2, h=2, w=3, m=2, group=2, stride=(2, 2), pads=(1, 1, 1, 1)),
    "dw_5x5_dilated_narrow": dict(c=6, h=11, w=5, m=6, k=(5, 5), group=6, pads=(4, 4, 4, 4), dil=(2, 2)),
    "dw_3x3_nopad_batch2": dict(n=2, c=5, h=6, w=6, m=5, group=5, pads=(0, 0, 0, 0), bias=False),
}
DENSE_CASES = {
    "gemm_7x33x21_relu": dict(m=7, k=33, n=21, act="relu"),
    "gemm_bias_2d": dict(m=9, k=40, n=30, bias="2d"),
    "gemm_one_row": dict(m=1, k=50, n=37),
    "matmul_3d_no_bias": dict(m=5, k=70, n=19, matmul3d=True),
}


def forced_algo(name: str) -> str:
    return "conv2d_dw" if name in DW_CASES else ("dense_packed" if name in DENSE_CASES else "conv2d_gemm")


def model_for(name: str) -> onnx.ModelProto:
    if name in DENSE_CASES:
        return dense_model(**DENSE_CASES[name])
    return conv_model(**{**CONV_CASES, **DW_CASES}[name])


def outputs_of(path, outdir, feeds=None, board="host"):
    """Build (gcc on the host; an up-to-date build of check_model's is reused) and run, under
    qemu-aarch64 for an Arm board: (outputs, inputs, generated kernels C)."""
    b = flow.build(path, board, outdir, reuse=True, quiet=True, cc="gcc" if board == "host" else None)
    specs = flow.io_specs(b.summary, "inputs")
    x = feeds if feeds is not None else reference.random_inputs(specs, 0)
    got, _ = select_runner(board, emulate=board != "host").run(
        b.exe, [x[n] for n, _, _ in specs], [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")])
    return got, x, (outdir / "td_kernels.c").read_text()


def neon_matches_onnxruntime_and_ref(path, tmp_path, monkeypatch) -> str:
    """The model built for the Raspberry Pi 4 and run under qemu-aarch64: against onnxruntime,
    and against the reference kernels (TINYDEPLOY_ALGO=ref) in the same emulator on the same
    inputs. Returns the fast build's kernel source."""
    got, x, src = outputs_of(path, tmp_path / "neon", board="rpi4")
    res = reference.compare(got, reference.run_onnxruntime(path.read_bytes(), x), flow.FP32_RTOL)
    assert res["outputs_match"] and res["max_rel_error"] <= 1e-4, res
    monkeypatch.setenv("TINYDEPLOY_ALGO", "ref")
    ref, _, _ = outputs_of(path, tmp_path / "ref", x, board="rpi4")
    res = reference.compare(got, ref, 1e-5)
    assert res["outputs_match"], res
    return src


def assert_close_to_reference(path, tmp_path, monkeypatch, fast_c_marker: str):
    """The forced fast algorithm gives the reference kernel's result (same inputs, same build)."""
    fast, x, src = outputs_of(path, tmp_path / "build-gcc")
    assert fast_c_marker in src, f"expected {fast_c_marker!r} in the generated kernels"
    monkeypatch.setenv("TINYDEPLOY_ALGO", "ref")
    ref, _, ref_src = outputs_of(path, tmp_path / "ref", x)
    assert not re.search(r"conv2d_gemm|conv2d_dw|dense_packed", ref_src)
    res = reference.compare(fast, ref, 1e-5)
    assert res["outputs_match"], res


ALL_CASES = list(CONV_CASES) + list(DW_CASES) + list(DENSE_CASES)
# 1x1 stride-1 convolutions also run as the transposed GEMM (conv2d_gemmt).
GEMMT_CASES = ["1x1_direct_odd", "1x1_small_plane_batch2", "1x1_deep_k1100"]
# Convolutions of every kind also run as implicit GEMM (conv2d_igemm; strided ones through phase
# planes).
IGEMM_CASES = [n for n in CONV_CASES if n not in ("big_k", "1x1_stride2", "1x1_small_plane_batch2")]
# Every case with the first SIMD variant (avx2 on x86-64); the other variants (the portable
# micro-kernel, the fallback of every ISA, and avx512 where the CPU has it) on the cases that hit
# their edges; conv2d_dw is portable C (one variant).
EDGE_CASES = {"1x1_direct_odd", "3x3_pad_relu", "big_k", "smaller_than_tile", "gemm_7x33x21_relu"}
IGEMM_EDGE_CASES = {"3x3_pad_relu", "batch2", "7x7_stride2_pad3", "1x1_stride2_whole_tiles"}
FIRST = "avx2" if "avx2" in HOST_ISAS else "ref"
OTHERS = [isa for isa in HOST_ISAS if isa != FIRST]
HOST_PARAMS = ([(n, "conv2d_dw", "ref") for n in DW_CASES]
               + [(n, forced_algo(n), isa) for n in list(CONV_CASES) + list(DENSE_CASES)
                  for isa in [FIRST] + (OTHERS if n in EDGE_CASES else [])]
               + [(n, "conv2d_igemm", isa) for n in IGEMM_CASES
                  for isa in [FIRST] + (OTHERS if n in IGEMM_EDGE_CASES else [])]
               + [(n, "conv2d_gemmt", isa) for n in GEMMT_CASES
                  for isa in [FIRST] + (OTHERS if n == "1x1_small_plane_batch2" else [])])


@pytest.mark.parametrize("name,algo,isa", HOST_PARAMS)
def test_forced_algorithm_on_host(name, algo, isa, tmp_path, monkeypatch):
    """gcc, clang and ASan/UBSan builds match onnxruntime; gcc matches the reference kernel."""
    use_host(monkeypatch, isa, small_caches=name in ("big_k", "gemm_bias_2d", "matmul_3d_no_bias", "3x3_pad_relu"))
    monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
    path = save(model_for(name), tmp_path)
    check_model(path, tmp_path)
    marker = f"{algo} f32 ({'ref' if algo == 'conv2d_dw' else isa})"
    assert_close_to_reference(path, tmp_path, monkeypatch, marker)


@pytest.mark.parametrize("name,algo", [("1x1_direct_odd", "conv2d_gemmt"), ("1x1_deep_k1100", "conv2d_gemmt"),
                                       ("1x1_direct_odd", "conv2d_gemm"), ("3x3_pad_relu", "conv2d_igemm")])
def test_avx2_three_row_tile(name, algo, tmp_path, monkeypatch):
    """avx2's 3x24 tile (3x3 planes' 9 positions in the transposed GEMM) on the GEMMs' edges."""
    if "avx2" not in HOST_ISAS:
        pytest.skip("needs an x86-64 host with AVX2")
    use_host(monkeypatch, "avx2")
    monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
    monkeypatch.setenv("TINYDEPLOY_TILE", "3x24")
    path = save(model_for(name), tmp_path)
    check_model(path, tmp_path)
    assert "3x24" in (tmp_path / "build-gcc" / "td_kernels.c").read_text()
    assert_close_to_reference(path, tmp_path, monkeypatch, f"{algo} f32 (avx2)")


@pytest.mark.parametrize("isa", HOST_ISAS)
def test_automatic_choice_mixed_model(isa, tmp_path, monkeypatch):
    """No forcing: the cost model picks per layer (gemm, depthwise, ref for tiny layers) and the
    whole chain still matches onnxruntime and the all-reference build."""
    use_host(monkeypatch, isa)
    monkeypatch.delenv("TINYDEPLOY_ALGO", raising=False)
    rng = np.random.default_rng(7)
    def t(name, shape):
        return helper.make_tensor(name, TensorProto.FLOAT, shape, rng.standard_normal(shape).astype(np.float32).ravel())
    inits = [t("w1", [16, 3, 3, 3]), t("b1", [16]), t("w2", [16, 1, 3, 3]), t("w3", [24, 16, 1, 1]), t("b3", [24]),
             t("w4", [2, 24, 1, 1]), t("wf", [10, 2 * 8 * 8])]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["a"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["a"], ["ar"]),
             helper.make_node("Conv", ["ar", "w2"], ["d"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=16),
             helper.make_node("Conv", ["d", "w3", "b3"], ["p"], kernel_shape=[1, 1]),
             helper.make_node("Conv", ["p", "w4"], ["q"], kernel_shape=[1, 1]),
             helper.make_node("Flatten", ["q"], ["f"]),
             helper.make_node("Gemm", ["f", "wf"], ["y"], transB=1)]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    path = save(model, tmp_path)
    check_model(path, tmp_path, variants=("gcc", "gcc-asan-ubsan"))
    src = (tmp_path / "build-gcc" / "td_kernels.c").read_text()
    if isa != "ref":
        assert f"conv2d_gemm f32 ({isa})" in src or f"conv2d_igemm f32 ({isa})" in src
    assert "conv2d_dw f32" in src
    assert "[ref direct]" in src      # the 2-channel 1x1 conv stays reference (the 1-row dense: dense_gemv)
    assert_close_to_reference(path, tmp_path, monkeypatch, "conv2d_")


def test_selection_is_explicit_and_printable():
    """The cost model's choices for typical layers, and tiles/blocking within their budgets."""
    g_params = {"N": 1, "C": 64, "H": 56, "W": 56, "M": 64, "OH": 56, "OW": 56, "KH": 1, "KW": 1, "SH": 1, "SW": 1,
                "DH": 1, "DW": 1, "PT": 0, "PL": 0, "G": 1}
    assert schedule.conv_choice(g_params, "avx2", "auto") in ("conv2d_gemm", "conv2d_igemm")
    assert schedule.conv_choice({**g_params, "C": 16, "M": 16, "KH": 3, "KW": 3, "PT": 1, "PL": 1, "SH": 2, "SW": 2,
                               "OH": 28, "OW": 28}, "avx2", "auto") == "conv2d_igemm"   # few channels: no packing wins
    assert schedule.conv_choice({**g_params, "C": 16, "M": 16, "KH": 3, "KW": 3, "PT": 1, "PL": 1}, "avx2",
                              "auto") == "conv2d_winograd4"   # 3x3 stride 1 on a large plane
    assert schedule.conv_choice({**g_params, "G": 64, "M": 64}, "avx2", "auto") == "conv2d_dw"
    assert schedule.conv_choice({**g_params, "C": 2, "M": 2, "H": 4, "W": 4, "OH": 4, "OW": 4}, "avx2", "auto") == "ref"
    assert schedule.conv_choice(g_params, "avx2", "ref") == "ref"
    from tinydeploy.targets.isa import ISAS
    lanes = {"avx2": 8, "avx512": 16, "neon": 4, "neon-dotprod": 4, "ref": 1}
    for isa in ISAS.values():
        for mr, nr, _ in isa.tiles:
            assert mr >= 1 and nr % lanes[isa.name] == 0
    from tinydeploy.ir.activation import Activation
    assert Activation("relu").vector_steps() == [("relu", "")]
    assert Activation("clip", 0.0, 6.0).vector_steps() == [("lo", "0.0f"), ("hi", "6.0f")]
    assert Activation("clip", 0.0, 6.0).c_expr() == "((v < 0.0f ? 0.0f : v) > 6.0f ? 6.0f : (v < 0.0f ? 0.0f : v))"
    assert Activation("leaky_relu", alpha=0.01).vector_steps() is None      # scalar epilogue
    assert Activation("leaky_relu", alpha=0.01).c_expr() == "(v >= 0.0f ? v : 0.01f * v)"
    assert Activation("clip", 0.0, 6.0).name == "clip lo 0.0f hi 6.0f" and Activation().name == "linear"
    kc, mc, nc = schedule.blocking(targets.Target("t", "cc", [], l1d_bytes=32768, l2_bytes=524288), 6, 16, 1000, 500, 3000)
    assert kc * 16 * 4 <= 16384 and mc % 6 == 0 and nc % 16 == 0 and mc * kc * 4 <= 262144


# ---- NEON under qemu-aarch64 -----------------------------------------------------------------

NEON_CASES = [(n, forced_algo(n)) for n in
              ["1x1_direct_odd", "7x7_stride2_pad3", "grouped3", "big_k", "smaller_than_tile",
               "dw_3x3_stride2_mult2", "gemm_bias_2d"]]
NEON_CASES += [("1x1_small_plane_batch2", "conv2d_gemmt")]
NEON_CASES += [(n, "conv2d_igemm") for n in ["3x3_pad_relu", "3x3_stride2_bn", "asymmetric_same_upper",
                                             "7x7_stride2_pad3", "1x1_stride2_whole_tiles"]]


@pytest.mark.parametrize("name,algo", NEON_CASES)
def test_forced_algorithm_neon_under_qemu(name, algo, tmp_path, monkeypatch):
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
    if name in ("big_k", "gemm_bias_2d"):   # several kc/mc/nc blocks on the board target too
        real = targets.TARGETS["aarch64-cortex-a72"]
        monkeypatch.setitem(targets.TARGETS, "aarch64-cortex-a72",
                            lambda: dataclasses.replace(real(), l1d_bytes=2048, l2_bytes=16384))
    path = save(model_for(name), tmp_path)
    src = neon_matches_onnxruntime_and_ref(path, tmp_path, monkeypatch)
    assert f"{algo} f32 (neon)" in src
