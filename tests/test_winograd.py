"""Winograd convolution (conv2d_winograd2 / conv2d_winograd4, tinydeploy/schedule.py): every
micro-kernel variant against onnxruntime and against the reference kernel, over shapes that hit
the edges (partial output tiles, padding 0 / 1 / asymmetric, channel counts that are not
multiples of the tile, a 1x1 output plane, no bias, fused Relu / Clip, batch 2, groups, several
blocks of tiles and of channels), on the host with gcc, clang and ASan/UBSan and with NEON under
qemu-aarch64; the cost model chooses it by default where it wins and never where it does not
apply."""
from __future__ import annotations

import dataclasses

import pytest

from test_fast_kernels import FIRST, HOST_ISAS, OTHERS, assert_close_to_reference, conv_model, outputs_of, use_host
from tinydeploy import flow, reference, targets
from tinydeploy import schedule
from tinydeploy.schedule import winograd
from util import check_model, mlperf_model, require, save

CASES = {
    "odd_planes_relu": dict(c=5, h=11, w=13, m=17, act="relu"),
    "pad0_no_bias_relu6": dict(c=17, h=9, w=7, m=3, pads=(0, 0, 0, 0), bias=False, act="relu6"),
    "asymmetric_pads": dict(c=3, h=10, w=8, m=5, pads=(0, 1, 2, 0)),
    "1x1_output_batch2": dict(n=2, c=4, h=3, w=3, m=6, pads=(0, 0, 0, 0)),
    "grouped_bn_relu": dict(c=12, h=8, w=9, m=18, group=3, bn=True, act="relu"),
    "blocks_of_tiles_and_channels": dict(c=40, h=23, w=25, m=20, act="relu"),
}
EDGE_CASES = ("odd_planes_relu", "blocks_of_tiles_and_channels")
SANITIZED = ("odd_planes_relu", "1x1_output_batch2")
PARAMS = [(name, wm, isa) for name in CASES for wm in (2, 4)
          for isa in [FIRST] + (OTHERS if name in EDGE_CASES else [])]


@pytest.mark.parametrize("name,wm,isa", PARAMS)
def test_forced_winograd_on_host(name, wm, isa, tmp_path, monkeypatch):
    """gcc, clang and ASan/UBSan builds match onnxruntime; gcc matches the reference kernel."""
    # small caches: several blocks of tiles (and of channels where C/G > 32) in the small layers
    use_host(monkeypatch, isa, small_caches=name == "blocks_of_tiles_and_channels")
    monkeypatch.setenv("TINYDEPLOY_ALGO", f"conv2d_winograd{wm}")
    path = save(conv_model(**CASES[name]), tmp_path)
    # clang and ASan/UBSan on the first ISA (the F(4x4) kernel takes ~10 s to build with UBSan)
    full = isa == FIRST and (wm == 2 or name in SANITIZED)
    check_model(path, tmp_path, variants=("gcc", "clang", "gcc-asan-ubsan") if full else ("gcc",))
    src = (tmp_path / "build-gcc" / "td_kernels.c").read_text()
    assert f"F({wm}x{wm},3x3)" in src
    assert_close_to_reference(path, tmp_path, monkeypatch, f"conv2d_winograd f32 ({isa})")


def test_blocking_splits_tiles_and_channels():
    """The small-cache target of the edge case really runs several blocks of tiles and of K."""
    t = dataclasses.replace(targets.host(), l1d_bytes=2048, l2_bytes=16384)
    p = {"N": 1, "C": 40, "H": 23, "W": 25, "M": 20, "OH": 23, "OW": 25, "G": 1}
    for wm in (2, 4):
        mr, nr = winograd._winograd_tile("avx2", 20, -(-23 // wm) * -(-25 // wm))
        q = winograd._winograd_plan(p, wm, mr, nr, t.l2_bytes)
        assert q["BLOCKS"] > 1 and q["NB"] % nr == 0, q
        assert schedule.blocking(t, mr, nr, 40, 20, q["NB"])[0] < 40


@pytest.mark.parametrize("name,wm", [("odd_planes_relu", 2), ("odd_planes_relu", 4), ("asymmetric_pads", 4),
                                     ("grouped_bn_relu", 2)])
def test_forced_winograd_neon_under_qemu(name, wm, tmp_path, monkeypatch):
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    monkeypatch.setenv("TINYDEPLOY_ALGO", f"conv2d_winograd{wm}")
    path = save(conv_model(**CASES[name]), tmp_path)
    got, x, src = outputs_of(path, tmp_path / "neon", board="rpi4")
    assert "conv2d_winograd f32 (neon)" in src and f"F({wm}x{wm},3x3)" in src
    res = reference.compare(got, reference.run_onnxruntime(path.read_bytes(), x), flow.FP32_RTOL)
    assert res["outputs_match"], res


def test_applies_only_to_3x3_stride1_dense_convolutions():
    base = {"N": 1, "C": 64, "H": 28, "W": 28, "M": 64, "OH": 28, "OW": 28, "KH": 3, "KW": 3, "SH": 1, "SW": 1,
            "DH": 1, "DW": 1, "PT": 1, "PL": 1, "G": 1}
    for isa in ("avx2", "avx512", "neon", "ref"):
        assert schedule.conv_choice(base, isa, "auto").startswith("conv2d_winograd")
    for other in ({"SH": 2, "SW": 2, "OH": 14, "OW": 14}, {"DH": 2, "DW": 2}, {"KH": 5, "KW": 5},
                  {"KH": 1, "KW": 1, "PT": 0, "PL": 0}):
        p = {**base, **other}
        assert not any(a.startswith("conv2d_winograd") for a in schedule.conv_costs(p, "avx2"))
        assert schedule.conv_choice(p, "avx2", "conv2d_winograd4") == "conv2d_gemm"   # forced: falls back
    depthwise = {**base, "G": 64}
    assert schedule.conv_choice(depthwise, "avx2", "auto") == "conv2d_dw"
    assert schedule.conv_choice(depthwise, "avx2", "conv2d_winograd2") == "conv2d_gemm"


def test_default_selection_uses_winograd_on_resnet8(tmp_path, monkeypatch):
    """No forcing, no tuning database: the cost model picks Winograd for some 3x3 layers of the
    MLPerf Tiny ResNet-8, and the model still matches onnxruntime."""
    monkeypatch.delenv("TINYDEPLOY_ALGO", raising=False)
    monkeypatch.delenv("TINYDEPLOY_TILE", raising=False)
    monkeypatch.setenv("TINYDEPLOY_TUNING", "off")
    res = check_model(mlperf_model("ic_resnet8_fp32.onnx"), tmp_path, variants=("gcc",))
    assert res["max_rel_error"] <= flow.FP32_RTOL
    src = (tmp_path / "build-gcc" / "td_kernels.c").read_text()
    assert "conv2d_winograd f32" in src
    assert "conv2d_winograd f32 (ref)" not in src or HOST_ISAS == ["ref"]
