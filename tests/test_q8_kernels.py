"""The 8-bit kernels per ISA (schedule/q8.py: qconv2d_gemm, qconv2d_igemm, qconv2d_dw,
qdense_packed), bit for bit against tinydeploy's exact reference (util.check_8bit).

One small chain of layers hits the kernels' edges: odd channel counts and pixel tails, a 3x3
stride-2 convolution with asymmetric padding, 1x1, depthwise, grouped, a 5x5 window, a fully
connected layer with an odd K, activation zero points at both ends of their range, and an output
scale small enough to saturate. It runs under each x86 ISA (AVX2 natively; AVX-512BW, AVX-VNNI and
AVX-512 VNNI natively where the CPU has them, else through the SIMDe shim in tests/simde, which
emulates their intrinsics with the same integer results), and under qemu-aarch64 for NEON
(Cortex-A72) and the dot product (Cortex-A78AE, qemu -cpu cortex-a76). Every ISA runs the
im2col GEMM, depthwise and fully connected kernels; the implicit GEMM (the 3x3 stride-2, 3x3 and
5x5 layers) runs on Cortex-A by itself (im2col there when forced: TINYDEPLOY_ALGO=qconv2d_gemm)
and on one x86 ISA per multiply flavour when forced (TINYDEPLOY_ALGO=qconv2d_igemm).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from test_cortex_m_kernels import ADD_CASES, _add_model
from test_quantized import QDQ, qrange
from tinydeploy import flow, reference, targets
from tinydeploy.runners.local import LocalRunner
from util import check_8bit, mlperf_model, require, save

SIMDE_SHIM = Path(__file__).parent / "simde"
# the CPU features each x86 ISA needs natively, and its gcc flags
X86 = {"avx2": ((), []),
       "avx512": (("avx512f",), ["-mavx512f"]),
       "avx512bw": (("avx512f", "avx512bw"), ["-mavx512f", "-mavx512bw"]),
       "avx-vnni": (("avx_vnni",), ["-mavxvnni"]),
       "avx512-vnni": (("avx512f", "avx512bw", "avx512_vnni"), ["-mavx512f", "-mavx512bw", "-mavx512vnni"])}


def _chain_layers(dtype, seed, weights):
    """(QDQ builder, conv, requant) of the test chains. weights: "random" over the whole int8
    range; "symmetric" in [-127, 127] (as symmetric quantisers make them: Cortex-A72's SMULL-pair
    kernels apply); "with-128" the same with one -128 in every convolution (its SMLAL fallback);
    "small" in [-63, 63] (the 4 x 3 SMULL tile's int16 sums over two k-groups apply); "spread"
    in [-20, 20] but +-127 at k = 0 and 8 (they apply to 1x1 layers in another order of K);
    "spread-wide" the same at k = 0 and 2 (the wide tile's int16 sums, in another order of K)."""
    b = QDQ(seed)

    def wts(shape, ws, zp=0, axis=None):
        if weights == "random":
            return b.weights(shape, np.int8, ws, zp, axis=axis)
        wq = b.rng.integers(*{"small": (-63, 64), "spread": (-20, 21), "spread-wide": (-20, 21)}.get(weights, (-127, 128)),
                            shape).astype(np.int8)
        if weights == "spread" and wq[0].size > 8:    # k = 0 and 8 share a lane: |w| summing to 254
            wq.reshape(shape[0], -1)[:, [0, 8]] = [127, -127]
        if weights == "spread-wide" and wq[0].size > 8:   # the same for the wide tile's lanes: k = 0 and 2
            wq.reshape(shape[0], -1)[:, [0, 2]] = [127, -127]
        if weights == "with-128":
            wq.flat[wq.size // 2] = -128
        return b.dq(b.const(wq), ws, zp, np.int8, axis)

    def conv(x, xs, c, m, k, s=(1, 1), pads=(0, 0, 0, 0), group=1, act=None):
        ws = (b.rng.uniform(0.5, 2.0, m) * 2e-3).astype(np.float32)
        w = wts((m, c // group, *k), ws, np.zeros(m, np.int8), axis=0)
        y = b.node("Conv", [x, w, b.bias(m, (np.float32(xs) * ws).astype(np.float32))], kernel_shape=list(k),
                   strides=list(s), pads=list(pads), group=group)
        return b.node("Relu", [y]) if act == "relu" else y

    def requant(y, scale, zp):
        return b.dq(b.q(y, scale, zp, dtype), scale, zp, dtype), scale
    return b, conv, requant, wts


def chain_model(dtype, seed=0, weights="random"):
    lo, hi = qrange(dtype)
    b, conv, requant, wts = _chain_layers(dtype, seed, weights)

    x, xs = b.dq("x", 0.05, lo, dtype), 0.05                                      # zero point at the bottom
    x, xs = requant(conv(x, xs, 5, 13, (3, 3), (2, 2), (1, 0, 2, 1), act="relu"), 0.04, hi)   # odd, s2, padded
    x, xs = requant(conv(x, xs, 13, 20, (1, 1)), 0.05, lo + 3)                    # pointwise, odd C
    x, xs = requant(conv(x, xs, 20, 20, (3, 3), pads=(1, 1, 1, 1), group=20), 1e-3, 0)   # depthwise, saturates
    x, xs = requant(conv(x, xs, 20, 9, (3, 3), pads=(1, 1, 1, 1)), 0.07, 1)      # 3x3 over whole groups
    x, xs = requant(conv(x, xs, 9, 6, (3, 3), pads=(0, 1, 1, 1), group=3), 0.06, hi - 2)   # grouped
    x, xs = requant(conv(x, xs, 6, 7, (5, 5), pads=(2, 2, 2, 2)), 0.05, 0)        # 5x5, odd M
    f, xs = requant(b.node("Flatten", [x]), xs, 0)
    k = 7 * 5 * 5                                                             # odd K
    ws = np.float32(3e-3)
    y = b.node("Gemm", [f, wts((11, k), ws), b.bias(11, np.float32(xs) * ws)], transB=1)
    yq = b.q(y, 0.1, lo + 1, dtype)
    return b.model([("x", dtype, [1, 5, 11, 10])], [(yq, dtype)])


def wide_model(dtype, weights):
    """KxK layers over 16 and 32 channels (the implicit GEMM's SMULL pairs on Cortex-A72: channel
    groups of 16): 3x3 stride 2 asymmetrically padded, 3x3 padded and 5x5 with an odd M over 20
    columns (one 16-column transpose, then single columns)."""
    lo, hi = qrange(dtype)
    b, conv, requant, _ = _chain_layers(dtype, 3, weights)
    x, xs = b.dq("x", 0.05, lo + 7, dtype), 0.05
    x, xs = requant(conv(x, xs, 32, 16, (3, 3), (2, 2), (1, 0, 2, 1), act="relu"), 0.04, hi)
    x, xs = requant(conv(x, xs, 16, 16, (3, 3), pads=(1, 1, 1, 1)), 0.05, lo + 3)
    y = conv(x, xs, 16, 7, (5, 5), pads=(2, 2, 2, 2))
    return b.model([("x", dtype, [1, 32, 7, 40])], [(b.q(y, 0.1, 0, dtype), dtype)])


def dw_model(dtype, weights, zx="lo"):
    """Depthwise layers only (qconv2d_dw): 7 channels (odd), planes larger (9x40) and smaller
    (1x7) than a vector, 3x3 and 5x5 windows at stride 1 and 2 with symmetric, asymmetric and
    no padding (stride 2: rows long enough for 16- and 8-byte LD2 vectors, and their byte tails),
    activation zero points at both ends of their range and in between."""
    lo, hi = qrange(dtype)
    b, conv, requant, _ = _chain_layers(dtype, 11, weights)
    x, xs = b.dq("x", 0.05, lo if zx == "lo" else hi - 1, dtype), 0.05
    x, xs = requant(conv(x, xs, 7, 7, (3, 3), pads=(1, 1, 1, 1), group=7, act="relu"), 0.02, hi)   # 9x40
    x, xs = requant(conv(x, xs, 7, 7, (5, 5), (2, 2), (2, 1, 2, 1), group=7), 0.03, lo)      # 5x19
    x, xs = requant(conv(x, xs, 7, 7, (5, 5), pads=(2, 2, 2, 2), group=7), 0.02, (lo + hi) // 2)
    x, xs = requant(conv(x, xs, 7, 7, (3, 3), (2, 2), (1, 0, 2, 1), group=7), 0.02, lo + 1)  # 3x9
    x, xs = requant(conv(x, xs, 7, 7, (3, 3), pads=(1, 1, 1, 1), group=7, act="relu"), 0.01, hi - 3)
    x, xs = requant(conv(x, xs, 7, 7, (3, 3), pads=(0, 2, 2, 0), group=7), 0.01, lo + 5)   # rows, PL = 2
    y = conv(x, xs, 7, 7, (3, 3), group=7)                          # unpadded: 1x7, one vector
    return b.model([("x", dtype, [1, 7, 9, 40])], [(b.q(y, 0.05, 0, dtype), dtype)])


def dw_windows_model(dtype, weights):
    """Depthwise windows of every width the row form takes (6 channels, 7x11): 1x1, 2x2 padded on
    the left, 3x1, 1x4 (all four bytes of an SDOT word) and 2x4 padded unevenly."""
    lo, hi = qrange(dtype)
    b, conv, requant, _ = _chain_layers(dtype, 17, weights)
    x, xs = b.dq("x", 0.05, hi - 4, dtype), 0.05
    x, xs = requant(conv(x, xs, 6, 6, (1, 1), group=6), 0.04, lo + 9)
    x, xs = requant(conv(x, xs, 6, 6, (2, 2), pads=(0, 1, 1, 0), group=6, act="relu"), 0.02, lo)
    x, xs = requant(conv(x, xs, 6, 6, (3, 1), pads=(1, 0, 1, 0), group=6), 0.02, 3)
    x, xs = requant(conv(x, xs, 6, 6, (1, 4), pads=(0, 1, 0, 2), group=6), 0.03, hi)
    y = conv(x, xs, 6, 6, (2, 4), pads=(1, 2, 0, 1), group=6)
    return b.model([("x", dtype, [1, 6, 7, 11])], [(b.q(y, 0.05, 0, dtype), dtype)])


def dw_s2_model(dtype, weights):
    """Stride-2 depthwise layers (5 channels): 3x3 padded on every side over 40 columns (20
    outputs a row: a last word vector overlapping the one before, PL = 1), padded below and right
    (10 a row: one vector running into the next row, PL = 0), then 5 a row (too narrow for the
    words: the phases' kernel)."""
    lo, hi = qrange(dtype)
    b, conv, requant, _ = _chain_layers(dtype, 13, weights)
    x, xs = b.dq("x", 0.05, lo + 2, dtype), 0.05
    x, xs = requant(conv(x, xs, 5, 5, (3, 3), (2, 2), (1, 1, 1, 1), group=5, act="relu"), 0.02, hi)   # 6x20
    x, xs = requant(conv(x, xs, 5, 5, (3, 3), (2, 2), (0, 0, 1, 1), group=5), 0.03, lo)          # 3x10
    y = conv(x, xs, 5, 5, (3, 3), (2, 2), (1, 1, 1, 1), group=5)                               # 2x5
    return b.model([("x", dtype, [1, 5, 11, 40])], [(b.q(y, 0.05, 0, dtype), dtype)])


def _kernels(build_dir: Path) -> set[str]:
    src = (build_dir / "td_kernels.c").read_text()
    return {f for f in ("qconv2d_gemm", "qconv2d_igemm", "qconv2d_dw", "qdense_packed") if f + "_" in src}


DTYPES = [pytest.param(np.int8, id="s8"), pytest.param(np.uint8, id="u8")]
AUTO = {"qconv2d_gemm", "qconv2d_dw", "qdense_packed"}
# x86: the implicit GEMM only when forced, once per multiply flavour (madd, dot); Cortex-A takes
# it by itself for the one-group KxK layers (Q8.igemm), and im2col when forced
IGEMM = {"avx2", "avx512-vnni"}


def _cases(places):
    return [pytest.param(w, a, id=f"{w}-{a}") for w in places
            for a in ["auto"] + (["qconv2d_igemm"] if w in IGEMM else [])]


def _aarch64_kernels(algo):
    return AUTO | ({"qconv2d_igemm"} if algo == "auto" else set())


def _x86_host(isa: str, monkeypatch, isas: list[str] | None = None) -> None:
    """The host target with `isa` first in its ISA list (then AVX2): natively where the CPU has
    it, else through SIMDe (skipped without it, or without an AVX2 x86-64 host)."""
    base = targets.host()
    if base.machine != "x86_64" or "avx2" not in base.isas:
        pytest.skip("needs an x86-64 host with AVX2")
    features, native_flags = X86[isa]
    feats = targets.cpu_features()
    if all(feats.get(f) for f in features):
        flags = native_flags
    else:                                        # emulated: SIMDe's intrinsics on AVX2
        if not Path("/usr/include/simde/x86/avx512.h").is_file():
            pytest.skip(f"{isa} is not on this CPU and SIMDe (libsimde-dev) is not installed")
        flags = [f"-I{SIMDE_SHIM}", "-Wno-psabi"]     # SIMDe passes 512-bit structs by value
    cflags = [f for f in base.cflags if not f.startswith(("-mavx", "-mfma"))] + ["-mavx2", "-mfma"] + flags
    monkeypatch.setitem(targets.TARGETS, "host",
                        lambda: dataclasses.replace(targets.host(), cflags=cflags, isas=isas or [isa, "avx2"]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa, algo", _cases([i for i in X86 if i != "avx512"]))
def test_x86_kernels_bit_exact(isa, algo, dtype, tmp_path, monkeypatch):
    _x86_host(isa, monkeypatch)
    monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
    path = save(chain_model(dtype), tmp_path)
    b = flow.build(path, "host", tmp_path / "b", quiet=True, cc="gcc")
    assert _kernels(tmp_path / "b") == AUTO | ({"qconv2d_igemm"} if algo != "auto" else set())
    assert f"({isa})" in (tmp_path / "b" / "td_kernels.c").read_text()
    specs = flow.io_specs(b.summary, "inputs")
    out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
    for seed in (0,):
        x = reference.random_inputs(specs, seed)
        got, _ = LocalRunner().run(b.exe, [x[n] for n, _, _ in specs], out_specs)
        check_8bit(path, x, got, label=f"{isa} {algo} seed {seed}", lsb_scales=b.summary.get("output_lsb"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", ["with-128", "symmetric"])
@pytest.mark.parametrize("board, algo", [pytest.param(b, a, id=f"{b}-{a}") for b in ("rpi4", "jetson-orin")
                                          for a in ("auto", "qconv2d_gemm")])      # neon; neon-dotprod
def test_aarch64_kernels_bit_exact(board, algo, weights, dtype, tmp_path, monkeypatch):
    """A -128 in a layer's weights keeps Cortex-A72's SMLAL GEMM; symmetric weights take its SMULL
    pairs (the im2col GEMM layers: strided and padded, 1x1 direct, grouped, 5x5, odd K and pixel
    tails), the same bits."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
    path = save(chain_model(dtype, weights=weights), tmp_path)
    for seed in (0, 1):
        res = flow.run(path, board, outdir=tmp_path / "b", quiet=True, latency=False, emulate=True, seed=seed)
        assert res["exact_reference"]["identical"] and res["outputs_match"], res
    src = (tmp_path / "b" / "td_kernels.c").read_text()
    assert _kernels(tmp_path / "b") == _aarch64_kernels(algo)
    assert ("vdotq_" in src) == (board == "jetson-orin")
    # Cortex-A78AE: the 4x16 SDOT tiles in assembly (partial tiles copied out in constant sizes),
    # the packing's last 8 columns by one more ST4, one-block im2col rows gathered unrolled
    asm_tiles = src.count('"ld1r {v16.4s}, [%[bk]], #4')
    assert (asm_tiles >= 1 and "} else if (cols == " in src and "the 8 up to nc again" in src
            and "one block of all the columns" in src) == (board == "jetson-orin")
    pairs = board == "rpi4" and weights == "symmetric"
    # SMULL pairs where K fills 7/8 of its k-groups of 16: the im2col layers' K = 45, 180, 150
    # (forced), not the pointwise K = 13 nor the grouped K = 27
    assert src.count("[qconv2d_gemm neon smull ") == ({"auto": 0, "qconv2d_gemm": 3}[algo] if pairs else 0)
    assert ("[qdense_packed neon smull " in src) == pairs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", ["with-128", "symmetric"])
def test_aarch64_igemm_pairs_bit_exact(weights, dtype, tmp_path, monkeypatch):
    """Cortex-A72's implicit GEMM: SMULL pairs over [pixel][16 channels] byte planes where the
    weights hold no -128 (16 x 16 transposes for stride 1, byte gathers for stride 2), else
    SMLAL; the same bits. Forced, so the 3x3 stride-1 layer does not take the Winograd
    (tests/test_q8_winograd.py)."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    monkeypatch.setenv("TINYDEPLOY_ALGO", "qconv2d_igemm")
    path = save(wide_model(dtype, weights), tmp_path)
    for seed in (0, 1):
        res = flow.run(path, "rpi4", outdir=tmp_path / "b", quiet=True, latency=False, emulate=True, seed=seed)
        assert res["exact_reference"]["identical"] and res["outputs_match"], res
    src = (tmp_path / "b" / "td_kernels.c").read_text()
    assert src.count("[qconv2d_igemm neon smull ") == (3 if weights == "symmetric" else 0)
    assert src.count("[qconv2d_igemm neon ") == 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("board, algo", [("jetson-orin", "auto"), ("jetson-orin", "qconv2d_gemm"),
                                         ("rpi4", "qconv2d_gemm")])
def test_aarch64_wide_bit_exact(board, algo, dtype, tmp_path, monkeypatch):
    """wide_model on Cortex-A: the implicit GEMM (SDOT) gathers the 3x3 stride-2 layer's planes 8
    columns at a time (LD2 over 16 bytes of a row, both phases, the last columns one by one);
    forced to im2col, the rows of output rows longer than 8 come from the padded planes by
    memcpy, the stride-2 planes are built 16 columns at a time by LD2 (SDOT, SMULL pairs); the
    same bits."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
    path = save(wide_model(dtype, "symmetric"), tmp_path)
    for seed in (0, 1):
        res = flow.run(path, board, outdir=tmp_path / "b", quiet=True, latency=False, emulate=True, seed=seed)
        assert res["exact_reference"]["identical"] and res["outputs_match"], res
    src = (tmp_path / "b" / "td_kernels.c").read_text()
    if algo == "auto":
        assert src.count("[qconv2d_igemm neon-dotprod ") == 3 and "vld2_u8(" in src
    else:
        assert src.count(" im2col planes] ") == 3 and "vld2q_u8(" in src


@pytest.mark.parametrize("dtype", DTYPES)
def test_aarch64_igemm_stride2_rows_bit_exact(dtype, tmp_path):
    """A 3x3 stride-2 layer padded by one column over 16 channels and 32 columns (IC's layer 6
    in small): the implicit GEMM's planes are gathered by LD2, for the phase whose 32 bytes would
    run past the row from the byte before it (the odd half), and its tiles are the output rows'
    (16 columns: whole tiles), stored in place; SMULL pairs on rpi4, SDOT on jetson-orin; the
    same bits."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    lo, hi = qrange(dtype)
    b, conv, _, _ = _chain_layers(dtype, 11, "symmetric")
    y = conv(b.dq("x", 0.03, lo + 100, dtype), 0.03, 16, 16, (3, 3), (2, 2), (1, 1, 1, 1), act="relu")
    path = save(b.model([("x", dtype, [1, 16, 9, 32])], [(b.q(y, 0.2, lo + 2, dtype), dtype)]), tmp_path)
    for board in ("rpi4", "jetson-orin"):
        res = flow.run(path, board, outdir=tmp_path / board, quiet=True, latency=False, emulate=True)
        assert res["exact_reference"]["identical"] and res["outputs_match"], res
        src = (tmp_path / board / "td_kernels.c").read_text()
        assert ("- 1).val[1]" in src and "[qconv2d_igemm neon smull " in src) if board == "rpi4" else "vld2_u8(" in src
        assert "stored in place" in src


@pytest.mark.parametrize("dtype", DTYPES)
def test_aarch64_small_k_keeps_smlal(dtype, tmp_path, monkeypatch):
    """Cortex-A72's GEMM (forced: qconv2d_lanes takes these layers by default): a 1x1 layer with
    K = 8 (one k-group of 16 SMULL pairs half empty) takes the SMLAL GEMM even with symmetric
    weights, K = 16 the SMULL pairs; the same bits."""
    monkeypatch.setenv("TINYDEPLOY_ALGO", "qconv2d_gemm")
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    lo, hi = qrange(dtype)
    b, conv, requant, _ = _chain_layers(dtype, 7, "symmetric")
    x, xs = requant(conv(b.dq("x", 0.05, lo + 5, dtype), 0.05, 8, 16, (1, 1), act="relu"), 0.04, lo)
    y = conv(x, xs, 16, 10, (1, 1))
    path = save(b.model([("x", dtype, [1, 8, 5, 7])], [(b.q(y, 0.1, hi - 4, dtype), dtype)]), tmp_path)
    res = flow.run(path, "rpi4", outdir=tmp_path / "b", quiet=True, latency=False, emulate=True)
    assert res["exact_reference"]["identical"] and res["outputs_match"], res
    src = (tmp_path / "b" / "td_kernels.c").read_text()
    assert src.count("[qconv2d_gemm neon smull ") == 1 and src.count("[qconv2d_gemm neon ") == 2    # one of each


def _pointwise_chain(tmp_path, dtype, seed, weights, chans, hw, zps):
    """Three 1x1 layers chans[0] -> chans[1] (Relu) -> chans[2] -> chans[3] over hw pixels, the
    input and the two inner outputs at zero points zps, run on rpi4 under qemu-aarch64 with two
    input seeds, bit for bit against the exact reference: (model path, td_kernels.c). On the
    GEMM (TINYDEPLOY_ALGO=qconv2d_gemm): qconv2d_lanes would take the layers of short K."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    hi = qrange(dtype)[1]
    b, conv, requant, _ = _chain_layers(dtype, seed, weights)
    c0, c1, c2, c3 = chans
    x, xs = requant(conv(b.dq("x", 0.05, zps[0], dtype), 0.05, c0, c1, (1, 1), act="relu"), 0.04, zps[1])
    x, xs = requant(conv(x, xs, c1, c2, (1, 1)), 0.05, zps[2])
    y = conv(x, xs, c2, c3, (1, 1))
    path = save(b.model([("x", dtype, [1, c0, *hw])], [(b.q(y, 0.1, hi - 4, dtype), dtype)]), tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINYDEPLOY_ALGO", "qconv2d_gemm")
        for s in (0, 1):
            res = flow.run(path, "rpi4", outdir=tmp_path / "b", quiet=True, latency=False, emulate=True, seed=s)
            assert res["exact_reference"]["identical"] and res["outputs_match"], res
    return path, (tmp_path / "b" / "td_kernels.c").read_text()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", ["symmetric", "small", "spread"])
@pytest.mark.parametrize("hw", [(3, 3), (1, 5), (6, 6)])
def test_aarch64_smull_asm_tile_bit_exact(hw, weights, dtype, tmp_path):
    """Cortex-A72's SMULL-pairs GEMM tile as one inline-assembly statement (an unsplit K): 1x1
    layers with K = 32 (2 k-groups, unrolled) and K = 176 (11 k-groups: the loop), 176 and 6
    output channels (rows past M), over 3x3 pixels (9 columns: 4 x 3 tiles, 3 whole panels),
    1x5 (4 x 3 tiles, a short last panel) and 6x6 (36 columns: 4 x 3 panels packed 16 columns at
    a time, K = 32 a wide tile); weights within [-63, 63] take the int16 sums over
    two k-groups (quad: K = 32 one pair, K = 176 one k-group then a loop of 5 pairs); weights
    with two heavy channels in one lane take it for K = 32 with K reordered (kp_), for K = 176
    in its order (11 k-groups: the heavy k-group 0 is summed alone); the same bits."""
    lo, _ = qrange(dtype)
    _, src = _pointwise_chain(tmp_path, dtype, 11, weights, (32, 176, 6, 9), hw, (lo + 5, lo, lo + 100))
    assert src.count("\"b.ne 1b\\n\\t\"") == 1    # K = 176
    if hw == (6, 6):          # 36 columns: 4 x 3 only with quad and K = 176 (panels of 16 columns packed)
        assert src.count("[qconv2d_gemm neon smull 4x3 quad ") == (weights != "symmetric")
        # K = 32 (4 x 3 quad would cost more): the wide tile, two steps summed in int16 where it may
        assert src.count(" 4x16 wide kc ") + src.count(" 4x12 wide quad kc ") == 1
        assert src.count(" 4x12 wide quad kc ") == (weights != "symmetric")
        return
    assert src.count("[qconv2d_gemm neon smull 4x3 ") == 2
    assert src.count("[qconv2d_gemm neon smull 4x3 quad ") == {"symmetric": 0, "small": 2, "spread": 2}[weights]
    assert ("kp_[" in src) == (weights == "spread")


@pytest.mark.parametrize("case", ["dilated", "zp-max-padded", "grouped-5x2", "no-bias-1d"])
def test_aarch64_im2col_planes_shapes_bit_exact(case, tmp_path, monkeypatch):
    """The im2col GEMM's padded planes forced on tests/test_quantized.py's awkward shapes
    (dilation 2 over padding 2, asymmetric padding with zero points at the ends of their range,
    stride 1 x 2 in groups, a 1 x 3 window over one row), int8 and uint8, on rpi4 (random
    weights: SMLAL) and jetson-orin (SDOT); the same bits."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    from test_quantized import _conv_model
    monkeypatch.setenv("TINYDEPLOY_ALGO", "qconv2d_gemm")
    for dtype in (np.int8, np.uint8):
        path = save(_conv_model(case, dtype), tmp_path)
        for board in ("rpi4", "jetson-orin"):
            res = flow.run(path, board, outdir=tmp_path / board, quiet=True, latency=False, emulate=True)
            assert res["exact_reference"]["identical"] and res["outputs_match"], (case, dtype, board, res)
            assert " im2col planes] " in (tmp_path / board / "td_kernels.c").read_text()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zy", ["clamp", "bottom"])
@pytest.mark.parametrize("hw", [(4, 4), (4, 5), (2, 19), (5, 25)])
def test_aarch64_smull_wide_tile_bit_exact(hw, zy, dtype, tmp_path):
    """Cortex-A72's wide SMULL-pairs tile (4 rows x 16 columns, the columns in the int32 lanes;
    schedule/q8.py smull_wide) on 1x1 layers: K = 32 (8 steps of 4 k, unrolled) under a Relu
    (the clamp), K = 76 (19 steps: one, then a loop of pairs) with its output zero point far
    from the middle; 16 columns (one full panel), 20 (a last panel of 4 columns), 38 (6) and 125
    (13: 8 + 4 + 1 bytes stored a row); 76 and 32 output channels; 6 channels (rows past M) keep
    the 4 x 4 tile. The first layer's output zero point 7 above the bottom of its range (the Relu
    clamps) or at the bottom (no clamp: the unsigned saturation, moved by 128 for int8). int8 and
    uint8 activations (flipped into signed bytes); 125 columns also on two threads (each packs
    and multiplies its own panels); the same bits."""
    lo, hi = qrange(dtype)
    zps = (lo + 9, lo + 7 if zy == "clamp" else lo, hi - 60)
    path, src = _pointwise_chain(tmp_path, dtype, 13, "symmetric", (32, 76, 32, 6), hw, zps)
    assert ("uqxtn v" in src) == (zy == "bottom")
    assert src.count("[qconv2d_gemm neon smull 4x16 wide ") == 2 and src.count("[qconv2d_gemm neon smull 4x4 ") == 1
    assert src.count("\"b.ne 1b\\n\\t\"") == (2 if hw[0] * hw[1] % 16 else 1)    # K = 76: full and last panel
    if hw == (5, 25) and zy == "clamp":       # on 2 threads: panels 0-3 and 4-7 (the last, 13 columns)
        res = flow.run(path, "rpi4", outdir=tmp_path / "t", quiet=True, latency=False, emulate=True, threads=2)
        assert res["exact_reference"]["identical"] and res["outputs_match"], res
        src = (tmp_path / "t" / "td_kernels.c").read_text()
        assert src.count(" wide kc 32 nc 64 direct threads 2]") == 1 and "omp parallel" in src


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", ["symmetric", "small", "spread-wide"])
@pytest.mark.parametrize("hw", [(2, 6), (6, 6)])
def test_aarch64_smull_wide_quad_bit_exact(hw, weights, dtype, tmp_path):
    """The wide tile over 12-column panels summing two steps' products in int16 (quad; schedule/
    q8.py smull_wide_quad) on 1x1 layers of 12 and 36 columns: K = 32 (4 step pairs, unrolled)
    and K = 136 (17 pairs: one, then a loop of two); weights within [-63, 63] in their order, two
    heavy channels in one lane in another order of K (kp_); symmetric weights keep the 4 x 16
    wide tile (36 columns) or the 4 x 4 one (12). 36 columns also on two threads (3 panels: 2 and 1). The same bits."""
    lo, hi = qrange(dtype)
    path, src = _pointwise_chain(tmp_path, dtype, 17, weights, (32, 136, 16, 6), hw, (lo + 3, lo + 11, hi - 40))
    quad = weights != "symmetric"
    assert src.count("[qconv2d_gemm neon smull 4x12 wide quad ") == (2 if quad else 0)
    assert src.count("[qconv2d_gemm neon smull 4x16 wide ") == (0 if quad or hw == (2, 6) else 2)    # 16 columns or more
    assert ("kp_[" in src) == (weights == "spread-wide")
    assert src.count("\"b.ne 1b\\n\\t\"") == (1 if quad else 1 + (hw == (6, 6)))    # K = 136
    if hw == (6, 6) and weights == "small":
        res = flow.run(path, "rpi4", outdir=tmp_path / "t", quiet=True, latency=False, emulate=True, threads=2)
        assert res["exact_reference"]["identical"] and res["outputs_match"], res
        assert "omp parallel" in (tmp_path / "t" / "td_kernels.c").read_text()


def test_smull_wide_choice():
    """The wide tile where its model counts fewer instructions than the 4 x 4 / 4 x 3 tiles: KWS's
    pointwise layers (125 columns, K = 64), VWW's 24x24, 12x12 and 6x6 ones with K = 32, 64; not
    VWW's quad 4 x 3 layers (36 columns, K = 128), nor under 16 columns or K not a multiple of 4;
    the wide quad tile (smull_wide_quad_pays) on 12-column panels, within the 255/256 bound."""
    from tinydeploy.schedule import q8
    assert q8.smull_wide(125, 64, 4, False) and q8.smull_wide(576, 32, 4, False)
    assert q8.smull_wide(144, 64, 4, False) and q8.smull_wide(36, 64, 4, False)
    assert not q8.smull_wide(36, 128, 3, True) and not q8.smull_wide(9, 256, 3, True)
    assert not q8.smull_wide(16, 34, 4, False)
    # two steps summed in int16: VWW's 6x6 layers with K = 128 (not 125 columns, nor K = 36)
    assert q8.smull_wide_quad_pays(36, 128, 3, True) and q8.smull_wide_quad_pays(36, 64, 4, False)
    assert not q8.smull_wide_quad_pays(125, 64, 4, False) and not q8.smull_wide_quad_pays(36, 36, 4, False)
    w = np.zeros((3, 16), np.int64)
    w[2, [1, 3, 5, 7]] = [127, -127, 1, 0]                # lane 1 of steps 0 and 1: 255
    assert q8.smull_wide_quad(w)
    w[2, 7] = -1                                          # 256
    assert not q8.smull_wide_quad(w) and not q8.smull_wide_quad(w[:, :12])
    perm = q8.smull_quad_order(w, wide=True)              # k = 7 moved to the next step pair's lanes
    assert perm is not None and sorted(perm) == list(range(16)) and q8.smull_wide_quad(w[:, perm])


def test_smull_quad_bound():
    """The int16 sums over two k-groups only where every lane's four |w| add up to at most 255
    (128 * 255 = 32640 fits int16, 128 * 256 does not); the k-groups paired from the first, or
    from the second where their number is odd; 4 x 3 tiles where quad pays (schedule/q8.py)."""
    from tinydeploy.schedule import q8
    w = np.zeros((5, 32), np.int64)
    w[3, [2, 10, 18, 26]] = [127, -127, 1, 0]            # lane 2 of k-groups 0 and 1: 255
    assert q8.smull_quad(w, 2)
    w[3, 26] = -1                                         # 256
    assert not q8.smull_quad(w, 2)
    assert q8.smull_quad(w[:, :24], 2)                    # k 24.. padding
    w3 = np.zeros((2, 48), np.int64)
    w3[1, [0, 8, 16, 24]] = 127                           # k-group 0 alone, then the pair (1, 2)
    assert q8.smull_quad(w3, 3) and not q8.smull_quad(w3[:, :32], 2)
    assert not q8.smull_quad(w3[:, :16], 1)
    assert q8.smull_cols(9, 8) == 3 and q8.smull_cols(36, 8) == 4 and q8.smull_cols(36, 8, True) == 3
    assert q8.smull_cols(576, 2, True) == 4 and q8.smull_cols(125, 4) == 4


def test_sdot_gemm_tiles_by_instructions(monkeypatch):
    """The SDOT im2col GEMM's tile by its measured instruction counts (Q8.gemm_instr): 4x16 for
    KWS's pointwise layers (64 x 125, 16 k-groups), 12x8 for VWW's 128-channel 6x6 ones, 8x8 for
    VWW's K = 8 layer 3 (16 x 2304, 2 k-groups); TINYDEPLOY_TILE still forces one that fits."""
    from tinydeploy.schedule import q8
    from tinydeploy.targets.isa import get_isa
    monkeypatch.delenv("TINYDEPLOY_TILE", raising=False)
    sdot = get_isa("neon-dotprod").q8
    assert q8._tile(sdot, 64, 125, 16) == (4, 16)
    assert q8._tile(sdot, 128, 36, 32) == (12, 8)
    assert q8._tile(sdot, 16, 2304, 2) == (8, 8)
    monkeypatch.setenv("TINYDEPLOY_TILE", "8x8")
    assert q8._tile(sdot, 64, 125, 16) == (8, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_aarch64_k_split_bit_exact(dtype, tmp_path, monkeypatch):
    """A K split (partial int32 sums in scratch between k blocks, the bias on the first, the
    requantisation on the last), which happens only where a panel over all of K does not fit half
    of L2: with a 2 KiB L1 and L2 a block holds 16 k-groups, so a 1x1 layer over
    600 channels (38 SMULL k-groups of 16, 600 SMLAL k-groups) runs in 3 blocks on rpi4
    (SMULL pairs) and 38 (SMLAL: weights with a -128) and on jetson-orin (SDOT)."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    from tinydeploy.targets import boards
    real = boards.Board.make_target
    monkeypatch.setattr(boards.Board, "make_target",
                        lambda self: dataclasses.replace(real(self), l1d_bytes=2048, l2_bytes=2048))
    lo, hi = qrange(dtype)
    for weights in ("symmetric", "with-128"):
        b, conv, _, _ = _chain_layers(dtype, 5, weights)
        y = conv(b.dq("x", 0.02, lo + 9, dtype), 0.02, 600, 13, (1, 1), act="relu")
        path = save(b.model([("x", dtype, [1, 600, 3, 7])], [(b.q(y, 0.5, lo, dtype), dtype)]), tmp_path)
        for board in ("rpi4", "jetson-orin"):
            res = flow.run(path, board, outdir=tmp_path / f"{weights}-{board}", quiet=True, latency=False, emulate=True)
            assert res["exact_reference"]["identical"] and res["outputs_match"], res
            src = (tmp_path / f"{weights}-{board}" / "td_kernels.c").read_text()
            assert "if (!last)" in src
            assert ("[qconv2d_gemm neon smull " in src) == (board == "rpi4" and weights == "symmetric")


@pytest.mark.parametrize("threads", [1, 2])
def test_aarch64_im2col_planes_bit_exact(threads, tmp_path, monkeypatch):
    """The im2col GEMM's padded planes with a K split (2 KiB caches: the planes after the partial
    sums in scratch) on a 3x3 stride-2 padded layer over 64 channels and a 1x1 stride-2 one (its
    planes are its im2col rows), and on two threads (each builds its group's planes in its own
    scratch), on rpi4 and jetson-orin; the same bits."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    from tinydeploy.targets import boards
    if threads == 1:
        real = boards.Board.make_target
        monkeypatch.setattr(boards.Board, "make_target",
                            lambda self: dataclasses.replace(real(self), l1d_bytes=2048, l2_bytes=2048))
    monkeypatch.setenv("TINYDEPLOY_ALGO", "qconv2d_gemm")
    b, conv, requant, _ = _chain_layers(np.uint8, 9, "symmetric")
    x, xs = requant(conv(b.dq("x", 0.02, 131, np.uint8), 0.02, 64, 48, (3, 3), (2, 2), (1, 2, 0, 1), act="relu"),
                    0.3, 7)
    y = conv(x, xs, 48, 13, (1, 1), (2, 2))
    path = save(b.model([("x", np.uint8, [1, 64, 9, 23])], [(b.q(y, 0.2, 200, np.uint8), np.uint8)]), tmp_path)
    for board in ("rpi4", "jetson-orin"):
        res = flow.run(path, board, outdir=tmp_path / board, quiet=True, latency=False, emulate=True,
                       threads=threads)
        assert res["exact_reference"]["identical"] and res["outputs_match"], res
        src = (tmp_path / board / "td_kernels.c").read_text()
        assert src.count(" im2col planes") == 2 and "the channel's plane" in src
        assert ("if (!last)" in src) == (threads == 1)
        assert ("omp parallel" in src) == (threads == 2)


def _dw_exact(model, board, tmp_path) -> str:
    """Runs `model` on `board` under qemu-aarch64 with two seeds, bit for bit against the exact
    reference; returns the generated td_kernels.c."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    path = save(model, tmp_path)
    for seed in (0, 1):
        res = flow.run(path, board, outdir=tmp_path / "b", quiet=True, latency=False, emulate=True, seed=seed)
        assert res["exact_reference"]["identical"] and res["outputs_match"], res
    return (tmp_path / "b" / "td_kernels.c").read_text()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", ["with-128", "symmetric"])
@pytest.mark.parametrize("board", ["rpi4", "jetson-orin"])
def test_aarch64_dw_bit_exact(board, weights, dtype, tmp_path, monkeypatch):
    """The NEON depthwise kernels (qconv2d_dw.c.j2) on every edge of dw_model: on Cortex-A72 int8
    weights without -128 take the SMULL pairs over byte planes (but for a plane of one vector), a
    -128 keeps SMLAL over int16 planes; Cortex-A78AE takes SDOT over words of 4 plane bytes
    whatever the weights; both in the row form where it applies. The planes forced (the lanes
    form has its own tests)."""
    monkeypatch.setenv("TINYDEPLOY_DW_FORM", "planes")
    for zx in ("lo", "hi"):
        src = _dw_exact(dw_model(dtype, weights, zx), board, tmp_path)
        assert src.count("[qconv2d_dw ") == 7
        # SMULL pairs without -128: on rpi4 all but the one-vector layer, on jetson-orin the
        # 5x5 strided one (SDOT's stride-2 words take windows up to 4 wide)
        smull = {"rpi4": 6, "jetson-orin": 1}[board] if weights == "symmetric" else 0
        assert src.count("[qconv2d_dw neon smull ") == smull
        # the row form (stride 1, 3 wide, as wide as the image): 9x40 (SDOT only: SMULL pairs
        # keep the gap columns of rows 32 or wider), 3x9 and PL = 2
        rows = 3 if board == "jetson-orin" else (2 if weights == "symmetric" else 0)
        assert src.count(" rows 1 x ") == rows
        # SDOT: the row form's words and every 16-output loop in assembly
        assert src.count("BSL into the ST4 registers") == (3 if board == "jetson-orin" else 0)
        assert ("in assembly: the accumulators v0-v3" in src) == (board == "jetson-orin")
        if board == "rpi4":                       # the phases' LD2: 16 and 8, even and odd lanes
            assert "vld2q_" in src and "vld2_" in src and ").val[1]" in src
        # SMULL groups: a triple of taps summed in int16 where the layer's weights allow it
        assert bool(re.search(r"taps \d+, \d+, \d+:", src)) == (smull > 0)
        assert src.count(" s2 words ") == (1 if board == "jetson-orin" else 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", ["with-128", "symmetric"])
@pytest.mark.parametrize("board", ["rpi4", "jetson-orin"])
def test_aarch64_dw_windows_bit_exact(board, weights, dtype, tmp_path, monkeypatch):
    """The row form's windows 1 to 4 wide (SDOT words with 1 to 4 taps; SMULL pairs' shifted
    copies), on both boards (the planes forced)."""
    monkeypatch.setenv("TINYDEPLOY_DW_FORM", "planes")
    src = _dw_exact(dw_windows_model(dtype, weights), board, tmp_path)
    assert src.count("[qconv2d_dw ") == 5
    assert src.count(" rows 1 x ") == (5 if board == "jetson-orin" or weights == "symmetric" else 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", ["with-128", "symmetric"])
@pytest.mark.parametrize("board", ["rpi4", "jetson-orin"])
def test_aarch64_dw_s2_bit_exact(board, weights, dtype, tmp_path, monkeypatch):
    """Stride 2: Cortex-A78AE's SDOT over words of each row parity where rows hold 6 outputs or
    more, else (and on Cortex-A72) the phase planes (forced)."""
    monkeypatch.setenv("TINYDEPLOY_DW_FORM", "planes")
    src = _dw_exact(dw_s2_model(dtype, weights), board, tmp_path)
    assert src.count(" s2 words ") == (2 if board == "jetson-orin" else 0)
    assert ("in assembly: the accumulators v0-v3" in src) == (board == "jetson-orin")


def _lanes_start(dtype, seed, weights, zx, c):
    """The lanes tests' chains: the input (zero point at the bottom or the top of its range), then
    a 3x3 depthwise layer padded on every side with Relu. Returns the builder's pieces, the layer's
    output and scale, and the middle of the range."""
    lo, hi = qrange(dtype)
    b, conv, requant, _ = _chain_layers(dtype, seed, weights)
    x, xs = b.dq("x", 0.05, lo if zx == "lo" else hi, dtype), 0.05
    x, xs = requant(conv(x, xs, c, c, (3, 3), pads=(1, 1, 1, 1), group=c, act="relu"), 0.02, lo)
    return b, conv, requant, x, xs, lo, (lo + hi) // 2


def dw_lanes_model(dtype, weights, zx="lo", c=19):
    """Depthwise layers for the lanes form (16 channels in the vector lanes): c channels (19: a
    block and a tail of 3; 33: two blocks and one channel; 7: one block of 8 lanes), a 9x13
    plane padded on every side with Relu, stride 2 padded below and right to 4x6 (odd sizes),
    stride 2 padded all round to 2x3 (6 outputs, under half a vector), a 2x2 window padded above
    and left, a 3x1 and a 1x4 window, PL = 2, and a 1x1 window: planes and windows of every size
    down to one pixel. Zero points keep every layer's outputs spread over their range (no layer
    saturates to a constant)."""
    b, conv, requant, x, xs, lo, mid = _lanes_start(dtype, 23, weights, zx, c)              # 9x13
    x, xs = requant(conv(x, xs, c, c, (3, 3), (2, 2), (0, 0, 1, 1), group=c), 0.006, mid + 20)      # 4x6
    x, xs = requant(conv(x, xs, c, c, (3, 3), (2, 2), (1, 1, 1, 1), group=c, act="relu"), 0.002, lo + 1)   # 2x3
    x, xs = requant(conv(x, xs, c, c, (2, 2), pads=(1, 1, 0, 0), group=c), 6e-4, mid - 30)          # 2x3
    x, xs = requant(conv(x, xs, c, c, (3, 1), pads=(1, 0, 1, 0), group=c), 3e-4, mid)
    x, xs = requant(conv(x, xs, c, c, (1, 4), pads=(0, 2, 0, 1), group=c), 1e-4, mid + 3)          # PL = 2
    y = conv(x, xs, c, c, (1, 1), group=c)
    return b.model([("x", dtype, [1, c, 9, 13])], [(b.q(y, 4e-5, mid, dtype), dtype)])


def dw_lanes_small_model(dtype, weights, zx="lo", c=20):
    """The lanes form on planes of 3x3, 2x2 and 1x1 (c channels): 3x3 padded (9 pixels: loads
    that would run past the input come from a copy), stride 2 to 2x2, a 2x2 window to 1x1, a Clip
    whose bounds lie inside the output range on both sides, then a padded 3x3 window over one
    pixel (its only tap inside the image)."""
    b, conv, requant, x, xs, lo, mid = _lanes_start(dtype, 29, weights, zx, c)              # 3x3
    x, xs = requant(conv(x, xs, c, c, (3, 3), (2, 2), (1, 1, 1, 1), group=c), 0.01, mid + 9)       # 2x2
    x, xs = requant(conv(x, xs, c, c, (2, 2), group=c), 0.005, mid - 7)                           # 1x1
    clip = b.node("Clip", [conv(x, xs, c, c, (1, 1), group=c), b.const(np.float32(0.01)), b.const(np.float32(0.3))])
    x, xs = requant(clip, 0.002, lo + 20)              # outputs from above the zero point to under the top
    y = conv(x, xs, c, c, (3, 3), pads=(1, 1, 1, 1), group=c)
    return b.model([("x", dtype, [1, c, 3, 3])], [(b.q(y, 0.002, mid, dtype), dtype)])


def _spread(model, seed=0) -> int:
    """Distinct values of the model's output on random inputs (onnxruntime, the graph's meaning):
    a test chain whose layers saturate to a constant holds its kernels to nothing."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    i = sess.get_inputs()[0]
    dt = np.uint8 if "uint8" in i.type else np.int8
    lo, hi = np.iinfo(dt).min, np.iinfo(dt).max
    x = np.random.default_rng(seed).integers(lo, hi + 1, i.shape).astype(dt)
    return len(np.unique(sess.run(None, {i.name: x})[0]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", ["lanes-19", "lanes-33", "lanes-7", "small", "small-6", "dw", "windows", "s2"])
def test_aarch64_dw_lanes_bit_exact(model, dtype, tmp_path, monkeypatch):
    """Cortex-A72's lanes form of the SMULL-pair depthwise kernel (schedule/q8.py dw_lanes), forced
    on every layer it takes, bit for bit: the shapes of dw_lanes_model and dw_lanes_small_model
    in blocks of 16 channels and, up to 8 channels, of 8, and those of the planes' tests (7, 6 and
    5 channels; their 5x5 windows keep the planes), input zero points at both ends of their
    range."""
    monkeypatch.setenv("TINYDEPLOY_DW_FORM", "lanes")
    make = {"lanes-19": lambda d, z: dw_lanes_model(d, "symmetric", z, 19),
            "lanes-33": lambda d, z: dw_lanes_model(d, "symmetric", z, 33),
            "lanes-7": lambda d, z: dw_lanes_model(d, "symmetric", z, 7),
            "small": lambda d, z: dw_lanes_small_model(d, "symmetric", z),
            "small-6": lambda d, z: dw_lanes_small_model(d, "symmetric", z, 6),
            "dw": lambda d, z: dw_model(d, "symmetric", z),
            "windows": lambda d, z: dw_windows_model(d, "symmetric"),
            "s2": lambda d, z: dw_s2_model(d, "symmetric")}[model]
    layers = {"lanes-19": 7, "lanes-33": 7, "lanes-7": 7, "small": 5, "small-6": 5, "dw": 5, "windows": 5, "s2": 3}[model]
    for zx in (("lo", "hi") if model in ("lanes-19", "lanes-7", "small", "small-6") else ("lo",)):
        if model.startswith(("lanes", "small")):   # (small: of 20 and 6 outputs)
            assert _spread(make(dtype, zx)) >= {"small": 10, "small-6": 4}.get(model, 16)
        src = _dw_exact(make(dtype, zx), "rpi4", tmp_path)
        assert src.count("[qconv2d_dw neon smull lanes ") == layers
        assert src.count(" x 8 channels") == (layers if model in ("lanes-7", "small-6", "dw", "windows", "s2") else 0)
    if model == "lanes-33":                    # two blocks whose taps group differently
        assert "the blocks whose taps group as" in src


@pytest.mark.parametrize("c, hw", [(19, (3, 3)), (6, (9, 13)), (33, (5, 4))])
def test_aarch64_dw_lanes_batch_bit_exact(c, hw, tmp_path, monkeypatch):
    """Two images: the lanes form's blocks run over both (the second image's channels after the
    first's; planes under 16 pixels read the last image's last planes from a copy)."""
    monkeypatch.setenv("TINYDEPLOY_DW_FORM", "lanes")
    for dtype in (np.int8, np.uint8):
        b, conv, requant, x, xs, lo, mid = _lanes_start(dtype, 41, "symmetric", "lo", c)
        y = conv(x, xs, c, c, (3, 3), (2, 2), (1, 1, 1, 1), group=c)
        model = b.model([("x", dtype, [2, c, *hw])], [(b.q(y, 0.006, mid, dtype), dtype)])
        assert _spread(model) >= 16
        assert _dw_exact(model, "rpi4", tmp_path).count("smull lanes") == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_aarch64_dw_lanes_threads_bit_exact(dtype, tmp_path, monkeypatch):
    """--threads 2: the lanes form's blocks of 16 channels (33 channels: 3 blocks, the last of one
    channel) split over OpenMP threads, each with its own scratch, the same bits."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    monkeypatch.setenv("TINYDEPLOY_DW_FORM", "lanes")
    b, conv, requant, x, xs, lo, mid = _lanes_start(dtype, 31, "symmetric", "hi", 33)
    y = conv(x, xs, 33, 33, (3, 3), (2, 2), (0, 0, 1, 1), group=33)
    model = b.model([("x", dtype, [1, 33, 24, 24])], [(b.q(y, 0.006, mid, dtype), dtype)])
    assert _spread(model) >= 16
    path = save(model, tmp_path)
    res = flow.run(path, "rpi4", outdir=tmp_path / "b", quiet=True, latency=False, emulate=True, threads=2)
    assert res["exact_reference"]["identical"] and res["outputs_match"], res
    src = (tmp_path / "b" / "td_kernels.c").read_text()
    assert src.count("omp parallel") == 1 and src.count("smull lanes 3 x 16 channels") == 2   # (the second: too few MACs)


# the NEON Add (qadd_neon.c.j2): same shapes (with and without a tail of < 16 values, exact ties,
# a shift above 32); broadcasting keeps the reference. "int32": the int32-lane form, whose
# constants every input pair was tried with at build time (quant.params.qadd_int32; ties to even
# at exact halves defeat it: "ties"); without it (form int64: as if it had found none), the
# 64-bit SMLAL form, rounding half up ("round") or correcting ties ("ties")
NEON_ADD = {"resnet-like-relu": ("int32", "ties"), "saturating-zp-extremes": ("int32", "round"),
            "u8-relu": ("ties", "ties"), "exact-ties": ("ties", "ties"), "large-shift": ("int32", "round"),
            "broadcast": (None, None)}


@pytest.mark.parametrize("form", ["auto", "int64"])
@pytest.mark.parametrize("case", list(NEON_ADD))
def test_aarch64_qadd_bit_exact(case, form, tmp_path, monkeypatch):
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    if form == "int64":
        from tinydeploy.schedule import q8
        monkeypatch.setattr(q8, "qadd_int32", lambda *a: None)
    want = NEON_ADD[case][form == "int64"]
    path = tmp_path / "m.onnx"
    onnx.save(_add_model(**ADD_CASES[case][0]), str(path))
    for seed in (0, 1):
        res = flow.run(path, "rpi4", outdir=tmp_path / "b", quiet=True, latency=False, emulate=True, seed=seed)
        assert res["exact_reference"]["identical"] and res["outputs_match"], res
    src = (tmp_path / "b" / "td_kernels.c").read_text()
    assert ("(neon)" in src) == (want is not None)
    assert ("vshrn_n_s32(p0" in src) == (want == "int32")
    assert ("vceqq_s64" in src) == (want == "ties")


def test_qadd_int32_constants():
    """quant.params.qadd_int32 on IC's first Add (MLPerf Tiny ResNet-8 int8: s' = 21), and none
    where exact halves must round to even (0.5 a with a = 1, 3, 5: 0, 2, 2)."""
    from tinydeploy.quant.params import qadd_int32
    got = qadd_int32("int8", "int8", "int8", -128, 4, -128, 415133440, 1098017536, 29, -128, 127)
    assert got is not None and got[-1] == 21
    assert qadd_int32("int8", "int8", "int8", 0, 0, 3, 1 << 30, 1 << 29, 31, -128, 127) is None


def test_threads_bit_exact(tmp_path):
    """--threads 2: the 8-bit kernels' blocks split over OpenMP threads, the same bits."""
    res = flow.run(mlperf_model("vww_mobilenetv1_int8.onnx"), outdir=tmp_path / "b", quiet=True, latency=False,
                   threads=2)
    assert res["exact_reference"]["identical"] and res["outputs_match"], res
    src = (tmp_path / "b" / "td_kernels.c").read_text()
    assert "omp parallel" in src and "qconv2d_dw_" in src and "qconv2d_gemm_" in src


# ---- quantised Add (qadd_simd.c.j2: int32 lanes where qadd_int32 finds constants, else double) ----

# form: (scales a, b, y, relu, zero points a, b, y as offsets from the type's low end (negative:
# from its high end), whether select_qadd finds int32 constants)
ADD_FORMS = {"plain": (0.05, 0.07, 0.09, False, (1, -3, 130), True),
             "relu": (0.051, 0.023, 0.037, True, (1, -3, 130), True),
             "ties": (0.5, 0.25, 1.0, False, (1, -3, 130), False),   # quarters and halves: exact .5 ties everywhere
             "scales-1000x": (0.1, 1e-4, 0.08, False, (1, -3, 130), False),
             "saturating": (0.5, 0.5, 0.01, False, (1, -3, 130), True),
             "zp-ends": (0.031, 0.047, 0.043, False, (0, -1, 0), True),        # zero points at both ends
             "zp-ends-relu": (0.2, 0.0013, 0.11, True, (-1, 0, 0), True)}
# 105 elements: 3 blocks of 32 (AVX2 int32) and 9, none of 64 (AVX-512 int32); 13 of 8 and 1 (AVX2
# double), 6 of 16 and 9; 3059: 95 blocks of 32 and 19, 47 of 64 and 51
ADD_SHAPES = {105: [1, 3, 5, 7], 3059: [1, 7, 19, 23]}


def add_model(form, dtype, size=105):
    """A same-shape Add of `size` elements (ADD_SHAPES)."""
    lo, hi = qrange(dtype)
    sa, sb, sy, relu, zps, _ = ADD_FORMS[form]
    za, zb, zy = (lo + z if z >= 0 else hi + 1 + z for z in zps)
    b = QDQ(11)
    y = b.node("Add", [b.dq("a", sa, za, dtype), b.dq("b", sb, zb, dtype)])
    if relu:
        y = b.node("Relu", [y])
    yq = b.q(y, sy, zy, dtype)
    shape = ADD_SHAPES[size]
    return b.model([("a", dtype, shape), ("b", dtype, shape)], [(yq, dtype)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", list(ADD_FORMS))
@pytest.mark.parametrize("isa, lanes", [("avx2", "auto"), ("avx512", "auto"), ("avx2", "double"), ("avx512", "double")])
def test_x86_qadd_bit_exact(isa, lanes, form, dtype, tmp_path, monkeypatch):
    """add_model, the output written over an input (the planner's in-place Add), on each x86
    variant and both sizes: bit for bit. int32 lanes where qadd_int32 finds constants (the forms
    with exact ties or a tiny ratio find none), double lanes where it finds none or is made to
    find none (lanes "double")."""
    from tinydeploy.schedule import q8
    _x86_host(isa, monkeypatch, isas=[isa, "avx2"])
    if lanes == "double":
        monkeypatch.setattr(q8, "qadd_int32", lambda *a: None)
    lo, hi = qrange(dtype)
    for size in ADD_SHAPES:
        path = save(add_model(form, dtype, size), tmp_path)
        bd = flow.build(path, "host", tmp_path / "b", quiet=True, cc="gcc", force=True)
        src = (tmp_path / "b" / "td_kernels.c").read_text()
        assert f"qadd {'s8' if dtype == np.int8 else 'u8'} ({isa})" in src
        int32 = ADD_FORMS[form][-1] and lanes == "auto"
        assert ("_mullo_epi32(" in src) == int32 and ("_pd(" in src) == (not int32)
        specs = flow.io_specs(bd.summary, "inputs")
        out_specs = [(s, d) for _, s, d in flow.io_specs(bd.summary, "outputs")]
        for seed in (0, 1, 2):
            x = reference.random_inputs(specs, seed)
            if seed == 2:       # pairs (a, b) of a grid over the whole range: both ends, exact halves
                grid = np.arange(lo, hi + 1, 17 if size < 1000 else 1)
                aa, bb = np.meshgrid(grid, grid[::-1] if size < 1000 else grid[::7])
                for k, (nm, s, d) in enumerate(specs):
                    x[nm] = np.resize((aa if k == 0 else bb).reshape(-1), int(np.prod(s))).reshape(s).astype(d)
            got, _ = LocalRunner().run(bd.exe, [x[n] for n, _, _ in specs], out_specs)
            check_8bit(path, x, got, label=f"qadd {isa} {lanes} {form} {size} seed {seed}",
                       lsb_scales=bd.summary.get("output_lsb"))


def test_x86_qadd_broadcast_keeps_reference(tmp_path, monkeypatch):
    """A broadcasting Add renders no x86 variant: the reference, bit for bit."""
    _x86_host("avx2", monkeypatch)
    path = tmp_path / "m.onnx"
    onnx.save(_add_model(**ADD_CASES["broadcast"][0]), str(path))
    res = flow.run(path, "host", outdir=tmp_path / "b", quiet=True, latency=False, seed=3)
    assert res["exact_reference"]["identical"] and res["outputs_match"], res
    src = (tmp_path / "b" / "td_kernels.c").read_text()
    assert "qadd s8 (ref)" in src and "_mm256_" not in src


def test_qadd_int32_folded_same_arithmetic():
    """quant.params.qadd_int32_folded gives, for any constants (shifts 1..30, both signs, wrapping
    sums) and every input pair, the same y as qadd_int32's arithmetic (written here once more)."""
    from tinydeploy.quant.params import qadd_int32_folded

    def wrap(v, bits):
        return (v + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))
    rng = np.random.default_rng(5)
    for ta, ty in (("int8", "uint8"), ("uint8", "int8"), ("uint8", "uint8"), ("int8", "int8")):
        a = np.arange(*{"int8": (-128, 128), "uint8": (0, 256)}[ta], dtype=np.int64)[:, None]
        b = np.arange(-128, 128, dtype=np.int64)[None, :] + (128 if ta == "uint8" else 0)
        tlo, thi = qrange(np.dtype(ty))
        for sp in (1, 7, 15, 16, 17, 21, 30):
            for _ in range(3):
                ma2, mb2 = (int(v) for v in rng.integers(-2 ** 31 + 1, 2 ** 31, 2) >> int(rng.integers(0, 12)))
                ka, kb, c16 = (int(v) for v in rng.integers(-2 ** 15, 2 ** 15, 3))
                lo, hi = sorted(int(v) for v in rng.integers(tlo, thi + 1, 2))
                p = wrap((a - ka) * ma2 + (b - kb) * mb2, 32)
                t = wrap(wrap(p >> min(sp, 16), 16) + c16, 16) >> max(sp - 16, 0)
                want = np.clip(np.clip(t, tlo, thi), lo, hi)
                ma3, mb3, k3, sh = qadd_int32_folded((ma2, mb2, ka, kb, c16, sp))
                assert all(-2 ** 31 <= v < 2 ** 31 for v in (ma3, mb3, k3)) and sh == max(sp, 16)
                r = wrap(a * ma3 + b * mb3 + k3, 32) >> sh
                assert r.min() >= -2 ** 15 and r.max() < 2 ** 15
                assert np.array_equal(np.clip(np.clip(r, tlo, thi), lo, hi), want), (ta, ty, sp)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_bit_exact(dtype, tmp_path, monkeypatch):
    """K split into blocks (int32 partial sums between them): on the host only where a panel over
    all of K does not fit half of L2, so here with caches made tiny (1 KiB L1, 2 KiB L2)."""
    _x86_host("avx2", monkeypatch)
    small = targets.TARGETS["host"]
    monkeypatch.setitem(targets.TARGETS, "host", lambda: dataclasses.replace(small(), l1d_bytes=1024, l2_bytes=2048))
    path = save(chain_model(dtype), tmp_path)
    b = flow.build(path, "host", tmp_path / "b", quiet=True, cc="gcc")
    assert "cbuf" in (tmp_path / "b" / "td_kernels.c").read_text()      # the split path was generated
    specs = flow.io_specs(b.summary, "inputs")
    out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
    x = reference.random_inputs(specs, 0)
    got, _ = LocalRunner().run(b.exe, [x[n] for n, _, _ in specs], out_specs)
    check_8bit(path, x, got, label=f"split K {dtype.__name__}", lsb_scales=b.summary.get("output_lsb"))



def test_dw_groups_int16_bound():
    """schedule.q8.dw_groups: a triple of taps only where every channel's products stay in int16
    for every input in [-128, 127] (P = 256: -128 * 256 = -2^15 fits; P = 257, or N = 256 with
    -128 * -256 = 2^15, does not), else pairs and the last tap alone; the triple of least sum."""
    from tinydeploy.schedule.q8 import dw_groups
    for row, fits in (([127, 127, 2], True), ([127, 127, 3], False), ([-127, -127, -1], True),
                      ([-127, -127, -2], False)):
        w = np.array([row, [-127, 64, 64]], np.int64)
        assert dw_groups(w) == ([[0, 1, 2]] if fits else [[0, 1], [2]]), row
    w = np.full((1, 9), 127, np.int64)
    w[0, 4:7] = [1, -2, 3]
    assert dw_groups(w) == [[4, 5, 6], [0, 1], [2, 3], [7, 8]]


def _x86_pointwise(dtype, weights, zps, over: bool = False, crowd: bool = False):
    """Two 1x1 layers 30 -> 24 (Relu) -> 20 over 7 x 5 pixels (K = 30 and 24: a tail of a k-group of
    4, then whole ones), the input and inner zero points at zps; pairs of the second layer's
    weights at vpmaddubsw's bound (+127 and +1, -128 and 0: 255 * 128 = 32640), or with `over`
    one of them one over it (+127 and +2: 255 * 129 > 32767), or with `crowd` 13 of a row's 24
    weights at +127 (every pairing of the 24 puts two of them together)."""
    hi = qrange(dtype)[1]
    b, conv, requant, _ = _chain_layers(dtype, 5, weights)
    x, xs = requant(conv(b.dq("x", 0.05, zps[0], dtype), 0.05, 30, 24, (1, 1), act="relu"), 0.04, zps[1])
    y = conv(x, xs, 24, 20, (1, 1))
    m = b.model([("x", dtype, [1, 30, 7, 5])], [(b.q(y, 0.1, hi - 4, dtype), dtype)])
    w = next(t for t in m.graph.initializer if t.data_type == onnx.TensorProto.INT8 and list(t.dims[:2]) == [20, 24])
    a = onnx.numpy_helper.to_array(w).copy()
    a[7, 10:12, 0, 0] = [127, 2 if over else 1]
    a[3, 20:22, 0, 0] = [-128, 0]
    if crowd:
        a[5, :13, 0, 0] = 127
    w.CopyFrom(onnx.numpy_helper.from_array(a, w.name))
    return m


def _x86_build_exact(path, isa, tmp_path, seeds=(0, 1)) -> str:
    b = flow.build(path, "host", tmp_path / "b", quiet=True, cc="gcc")
    src = (tmp_path / "b" / "td_kernels.c").read_text()
    specs = flow.io_specs(b.summary, "inputs")
    out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
    for seed in seeds:
        x = reference.random_inputs(specs, seed)
        got, _ = LocalRunner().run(b.exe, [x[n] for n, _, _ in specs], out_specs)
        check_8bit(path, x, got, label=f"{isa} seed {seed}", lsb_scales=b.summary.get("output_lsb"))
    return src


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", ["avx2", "avx512bw"])
def test_x86_maddubs_bit_exact(isa, dtype, tmp_path, monkeypatch):
    """x86 without VNNI: layers whose int8 weights keep every vpmaddubsw pair sum within int16
    (here all in [-63, 63]) take the dot flavour by vpmaddubsw + vpmaddwd(ones) + vpaddd, bit for bit
    against the exact reference: the chain's 3x3 stride-2 im2col, 5x5 and grouped layers and its
    fully connected layer (K = 175: a tail), and 1x1 layers with K tails, with zero points at both
    ends of the range."""
    _x86_host(isa, monkeypatch, [isa])
    lo, hi = qrange(dtype)
    mul = "_mm256_maddubs_epi16(" if isa == "avx2" else "_mm512_maddubs_epi16("
    src = _x86_build_exact(save(chain_model(dtype, weights="small"), tmp_path), isa, tmp_path)
    assert mul in src and "qdense_packed " + isa + " maddubs" in src
    assert "qconv2d_gemm " + isa + " maddubs" in src
    for i, zps in enumerate([(lo, hi, lo), (hi, lo, hi)]):
        (tmp_path / str(i)).mkdir()
        src = _x86_build_exact(save(_x86_pointwise(dtype, "small", zps), tmp_path / str(i)), isa, tmp_path / str(i))
        assert src.count("qconv2d_gemm " + isa + " maddubs") == 2, src


@pytest.mark.parametrize("dtype", DTYPES)
def test_x86_maddubs_over_the_bound(dtype, tmp_path, monkeypatch):
    """One pair of weights one over vpmaddubsw's bound (255 * 129 > 32767): that layer takes
    vpmaddubsw with K in another order (q8.ubs_order); a row whose weights no order can pair
    within the bound keeps that layer on the exact vpmaddwd kernels (the other layer takes
    vpmaddubsw in its own order); all bit for bit."""
    _x86_host("avx2", monkeypatch, ["avx2"])
    lo, hi = qrange(dtype)
    for crowd in (False, True):
        d = tmp_path / str(crowd)
        d.mkdir()
        src = _x86_build_exact(save(_x86_pointwise(dtype, "small", (lo, hi, lo), over=True, crowd=crowd), d), "avx2", d)
        assert src.count("qconv2d_gemm avx2 ") == 2, src
        assert src.count("qconv2d_gemm avx2 maddubs") == 1 + (not crowd), src
        assert src.count("K reordered") == (not crowd), src


def _x86_im2col_spread(dtype):
    """Three im2col layers of 64 output channels a group or more, weights "spread" (+127 at k = 0
    beside weights of up to 20: pairs over vpmaddubsw's bound in K's own order): 3x3 stride 2
    asymmetrically padded (K = 45, a tail), 5x5 padded to an odd M (K = 1600), 3x3 in 2 groups
    of 64 (K = 297)."""
    lo, hi = qrange(dtype)
    b, conv, requant, _ = _chain_layers(dtype, 4, "spread")
    x, xs = b.dq("x", 0.05, lo, dtype), 0.05
    x, xs = requant(conv(x, xs, 5, 64, (3, 3), (2, 2), (1, 0, 2, 1), act="relu"), 0.04, hi)
    x, xs = requant(conv(x, xs, 64, 66, (5, 5), pads=(2, 2, 2, 2)), 0.05, lo + 3)
    y = conv(x, xs, 66, 128, (3, 3), pads=(0, 1, 1, 1), group=2)
    return b.model([("x", dtype, [1, 5, 11, 10])], [(b.q(y, 0.1, 0, dtype), dtype)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", ["avx2", "avx512bw"])
def test_x86_maddubs_in_another_order_of_k(isa, dtype, tmp_path, monkeypatch):
    """Weights whose pairs break vpmaddubsw's bound in their own order of K but not in another
    (q8.ubs_order): im2col layers of 64 output channels a group or more take vpmaddubsw reading
    K's columns in that order (3x3 stride 2 padded, 5x5, grouped 3x3; on avx2 the few-pixel
    layers through the transposed tile, the strided one from phase planes), bit for bit against the
    exact reference; the chain's narrower im2col layers keep vpmaddwd (the reordered gather would
    cost more than the tile saves), as does the fully connected layer (not reordered)."""
    _x86_host(isa, monkeypatch, [isa])
    src = _x86_build_exact(save(_x86_im2col_spread(dtype), tmp_path), isa, tmp_path)
    for layer in ("3x3 stride 2x2: 5x11x10", "5x5 stride 1x1: 64x", "grouped 3x3 stride 1x1: 66x"):
        assert re.search(rf"qconv2d_gemm {isa} maddubs \d+x\d+( trans)? K reordered [^]]*\] {layer}", src), layer
    (tmp_path / "chain").mkdir()
    src = _x86_build_exact(save(chain_model(dtype, weights="spread"), tmp_path / "chain"), isa, tmp_path / "chain")
    assert "K reordered" not in src and f"qdense_packed {isa} maddubs" not in src, src


def test_maddubs_order_of_k():
    """q8.ubs_order: an order of K in which ubs_exact holds where one exists (an odd last column
    with K's zero padding), the same order for the same weights, None where every pairing puts
    two weights of one sign over the bound together."""
    from tinydeploy.schedule.q8 import ubs_exact, ubs_order
    rng = np.random.default_rng(0)
    w = rng.integers(-30, 31, (16, 40))
    w[:, 0:2], w[:, 6:8] = 127, -128               # bad pairs in their own order
    w[3, 10:20] = 100
    assert not ubs_exact(w)
    order = ubs_order(w)
    assert order is not None and sorted(order) == list(range(40)) and ubs_exact(w[:, order])
    assert np.array_equal(order, ubs_order(w.copy()))
    assert ubs_order(np.array([[127, 1, 127]])) is not None
    for bad in ([[127, 127, 127]], [[-128, -1, -128, -1]], [[127] * 13 + [0] * 11]):
        assert ubs_order(np.array(bad)) is None, bad


def test_maddubs_pair_bound():
    """q8.ubs_exact: pairs (k = 2j, 2j + 1) of u8 x s8 products within int16: 255 * positive sum
    <= 32767, 255 * negative magnitude <= 32768; the pairs of a k-group of 4 are (0, 1) and (2, 3)."""
    from tinydeploy.schedule.q8 import ubs_exact
    ok = [[127, 1], [-128, 0], [-64, -64], [64, 64], [127, 0, 2, 0], [-128, 127, -128, 127], [1, 2, 3]]
    over = [[127, 2], [-128, -1], [-65, -64], [65, 64], [0, 0, 127, 2], [0, 0, 0, 0, 100, 29]]
    for w in ok:
        assert ubs_exact(np.array([w], np.int8)), w
    for w in over:
        assert not ubs_exact(np.array([w], np.int8)), w
    assert not ubs_exact(np.zeros((0, 4), np.int8))


# ---- 8-bit max pooling (qpool2d_simd.c.j2: avx2, avx512bw, neon) ---------------------------------

# name: (input shape, MaxPool attributes, output: "same" scale and zero point (the clamp only),
# "relu" (the same, clamped at the zero point), "rescaled" (requantised)); widths with and without
# tails of a 16-, 32- and 64-byte vector, below a vector, asymmetric pads, ceil_mode; stride 3 and
# dilation keep the reference
POOL_CASES = {
    "stem": ([1, 3, 23, 37], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), "same"),
    "s2-w70": ([1, 2, 9, 70], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), "same"),
    "2x2-w130": ([1, 2, 11, 130], dict(kernel_shape=[2, 2], strides=[2, 2]), "same"),
    "s1-w33": ([1, 3, 9, 33], dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1]), "same"),
    "2x2-s1-small": ([1, 2, 5, 7], dict(kernel_shape=[2, 2], strides=[1, 1], pads=[0, 1, 1, 0]), "same"),
    "asym-w64": ([1, 2, 17, 64], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[2, 0, 1, 2]), "same"),
    "ceil": ([1, 2, 8, 19], dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1), "same"),
    "s21": ([1, 2, 9, 41], dict(kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1]), "same"),
    "s12-w50": ([1, 2, 6, 50], dict(kernel_shape=[2, 2], strides=[1, 2]), "same"),
    "relu": ([1, 2, 10, 45], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), "relu"),
    "rescaled": ([1, 2, 10, 40], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), "rescaled"),
    "stride3": ([1, 2, 9, 20], dict(kernel_shape=[3, 3], strides=[3, 3]), "same"),
    "dilated": ([1, 2, 9, 20], dict(kernel_shape=[2, 2], strides=[1, 2], dilations=[2, 2]), "same"),
}
POOL_REF = {"stride3", "dilated"}


def pool_model(dtype):
    """Every POOL_CASES pooling in one model, each on an input of its own."""
    lo, hi = qrange(dtype)
    b = QDQ(13)
    inputs, outputs = [], []
    for name, (shape, attrs, out) in POOL_CASES.items():
        nm = name.replace("-", "_")
        zx = lo + 60
        y = b.node("MaxPool", [b.dq(nm, 0.02, zx, dtype)], **attrs)
        if out == "relu":
            y = b.node("Relu", [y])
        yq = b.q(y, 0.013 if out == "rescaled" else 0.02, lo + 9 if out == "rescaled" else zx, dtype)
        inputs.append((nm, dtype, shape))
        outputs.append((yq, dtype))
    return b.model(inputs, outputs)


def _pool_src_check(src: str, dtype, isa: str) -> None:
    t = "s8" if dtype == np.int8 else "u8"
    assert src.count(f"qpool2d {t} ({isa})") == len(POOL_CASES) - len(POOL_REF)
    assert src.count(f"qpool2d {t} (ref)") == len(POOL_REF)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", ["avx2", "avx512bw"])
def test_x86_qpool_bit_exact(isa, dtype, tmp_path, monkeypatch):
    """pool_model on each x86 variant: bit for bit, the inputs random and at both ends of the range
    (the padding's minimum and the clamps)."""
    _x86_host(isa, monkeypatch, isas=[isa, "avx2"])
    path = save(pool_model(dtype), tmp_path)
    bd = flow.build(path, "host", tmp_path / "b", quiet=True, cc="gcc")
    _pool_src_check((tmp_path / "b" / "td_kernels.c").read_text(), dtype, isa)
    specs = flow.io_specs(bd.summary, "inputs")
    out_specs = [(s, d) for _, s, d in flow.io_specs(bd.summary, "outputs")]
    lo, hi = qrange(dtype)
    for seed in (0, 1):
        x = reference.random_inputs(specs, seed)
        if seed == 1:       # mostly the type's ends: windows of the minimum only, maxima at the top
            rng = np.random.default_rng(seed)
            x = {n: rng.choice([lo, lo, lo, lo + 1, hi], size=s).astype(d) for n, s, d in specs}
        got, _ = LocalRunner().run(bd.exe, [x[n] for n, _, _ in specs], out_specs)
        check_8bit(path, x, got, label=f"qpool {isa} seed {seed}", lsb_scales=bd.summary.get("output_lsb"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_aarch64_qpool_bit_exact(dtype, tmp_path):
    """pool_model under qemu-aarch64 (Cortex-A72, NEON): bit for bit."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    path = save(pool_model(dtype), tmp_path)
    for seed in (0, 1):
        res = flow.run(path, "rpi4", outdir=tmp_path / "b", quiet=True, latency=False, emulate=True, seed=seed)
        assert res["exact_reference"]["identical"] and res["outputs_match"], res
    _pool_src_check((tmp_path / "b" / "td_kernels.c").read_text(), dtype, "neon")


@pytest.mark.parametrize("cc, sanitize", [("clang", False), ("gcc", True)])     # (no ASan runtime for clang here)
def test_x86_qadd_qpool_clang_and_sanitizers(cc, sanitize, tmp_path, monkeypatch):
    """The int32-lane Add (its 3059 values: a tail) and every pool_model case, AVX2, with clang at
    -Werror, and with gcc under ASan/UBSan (the row buffers, the last vectors ending at a row's
    end, the tails): bit for bit."""
    from util import SANITIZE
    require(cc)
    _x86_host("avx2", monkeypatch)
    for name, model in (("add", add_model("relu", np.uint8, 3059)), ("pool", pool_model(np.int8))):
        path = save(model, tmp_path, f"{name}.onnx")
        bd = flow.build(path, "host", tmp_path / name, quiet=True, cc=cc, extra_cflags=SANITIZE if sanitize else [])
        src = (tmp_path / name / "td_kernels.c").read_text()
        assert "(avx2)" in src and ("_mm256_mullo_epi32(" in src or name == "pool")
        specs = flow.io_specs(bd.summary, "inputs")
        out_specs = [(s, d) for _, s, d in flow.io_specs(bd.summary, "outputs")]
        x = reference.random_inputs(specs, 4)
        got, _ = LocalRunner().run(bd.exe, [x[n] for n, _, _ in specs], out_specs)
        check_8bit(path, x, got, label=f"{name} {cc} sanitize={sanitize}", lsb_scales=bd.summary.get("output_lsb"))



def _trans_model(dtype, weights, hw, zps):
    """Few pixels (the transposed tile's layers): a 1x1 layer 30 -> 40 (K = 30: a tail of a
    k-group of 4) over hw, a 3x3 stride-2 layer 40 -> 36 padded asymmetrically (im2col), a 1x1
    stride-2 layer 36 -> 19 (odd M) and a 1x1 layer 19 -> 21 (K = 19); zero points at zps."""
    lo, hi = qrange(dtype)
    b, conv, requant, _ = _chain_layers(dtype, 9, weights)
    x, xs = requant(conv(b.dq("x", 0.05, zps[0], dtype), 0.05, 30, 40, (1, 1), act="relu"), 0.04, zps[1])
    x, xs = requant(conv(x, xs, 40, 36, (3, 3), (2, 2), (1, 1, 2, 1)), 0.05, zps[0])
    x, xs = requant(conv(x, xs, 36, 19, (1, 1), (2, 2)), 0.06, zps[1])
    y = conv(x, xs, 19, 21, (1, 1))
    return b.model([("x", dtype, [1, 30, *hw])], [(b.q(y, 0.1, hi - 4, dtype), dtype)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa, weights, force", [
    ("avx2", "small", ""), ("avx2", "small", "16x6"), ("avx2", "random", "16x5"),
    ("avx512bw", "small", "32x6"), ("avx512bw", "random", "16x5")])
def test_x86_trans_tile_bit_exact(isa, weights, force, dtype, tmp_path, monkeypatch):
    """The transposed tile (output channels in the vector lanes, pixels broadcast: q8.trans_tile),
    bit for bit against the exact reference over 7x7 (49 pixels; vpmaddubsw's layers take it by
    themselves on avx2), 1x1, 1x7 and 17x1 inputs, 1x1 (direct) and 3x3 / 1x1 stride-2 (im2col)
    layers, K tails, zero points at both ends; "small" weights run vpmaddubsw (maddubs), "random"
    ones vpmaddwd (madd); forced (TINYDEPLOY_TRANS) elsewhere, avx512bw through SIMDe here."""
    _x86_host(isa, monkeypatch, [isa])
    if force:
        monkeypatch.setenv("TINYDEPLOY_TRANS", force)
    lo, hi = qrange(dtype)
    tag = f"qconv2d_gemm {isa}{' maddubs' if weights == 'small' else ''} {force or '16x5'} trans"
    for i, (hw, zps) in enumerate([((7, 7), (lo, hi)), ((1, 1), (hi, lo)), ((1, 7), (lo + 1, hi)),
                                   ((17, 1), (hi - 1, lo))]):
        (tmp_path / str(i)).mkdir()
        path = save(_trans_model(dtype, weights, hw, zps), tmp_path / str(i))
        src = _x86_build_exact(path, isa, tmp_path / str(i))
        if force or hw == (7, 7):
            assert tag in src, src[:3000]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", ["avx2", "avx512bw"])
def test_x86_strided_planes_bit_exact(isa, dtype, tmp_path, monkeypatch):
    """x86 im2col rows copied from phase planes (q8.gemm_planes: avx2's vpmaddubsw layers of a
    strided window by themselves, forced on avx512bw and for madd): 3x3 stride 2 asymmetrically
    padded over odd sizes (7x7, 1x1, 1x7, 17x1, the chain's 11x10), the planes' even bytes taken 16 at a time
    where 32 lie in the row, bit for bit."""
    _x86_host(isa, monkeypatch, [isa])
    if isa != "avx2":
        monkeypatch.setenv("TINYDEPLOY_GEMM_PLANES", "1")
    lo, hi = qrange(dtype)
    src = _x86_build_exact(save(chain_model(dtype, weights="small"), tmp_path), isa, tmp_path)
    assert "im2col planes] 3x3 stride 2x2" in src
    for i, (hw, zps) in enumerate([((7, 7), (lo, hi)), ((1, 1), (hi, lo)), ((1, 7), (lo + 1, hi)),
                                   ((17, 1), (hi - 1, lo)), ((9, 40), (lo, hi)), ((5, 24), (hi, lo))]):
        for weights in ("small", "random"):
            d = tmp_path / f"{i}{weights}"
            d.mkdir()
            if weights == "random" or isa != "avx2":      # madd: forced
                monkeypatch.setenv("TINYDEPLOY_GEMM_PLANES", "1")
            else:
                monkeypatch.delenv("TINYDEPLOY_GEMM_PLANES", raising=False)
            src = _x86_build_exact(save(_trans_model(dtype, weights, hw, zps), d), isa, d)
            assert "im2col planes] 3x3 stride 2x2" in src, src[:3000]


@pytest.mark.parametrize("dtype", DTYPES)
def test_x86_strided_planes_blocks_bit_exact(dtype, tmp_path, monkeypatch):
    """The phase planes' rows copied block by block (caches made tiny: blocks of a few panels, so
    that blocks start and end inside output rows of 20 and 12 columns: copies of 1 to 20 bytes by
    overlapping fixed-size ones), avx2 vpmaddubsw, bit for bit."""
    _x86_host("avx2", monkeypatch, ["avx2"])
    small = targets.TARGETS["host"]
    monkeypatch.setitem(targets.TARGETS, "host", lambda: dataclasses.replace(small(), l1d_bytes=1024, l2_bytes=4096))
    lo, hi = qrange(dtype)
    for i, (hw, zps) in enumerate([((9, 40), (lo, hi)), ((5, 24), (hi, lo))]):
        d = tmp_path / str(i)
        d.mkdir()
        src = _x86_build_exact(save(_trans_model(dtype, "small", hw, zps), d), "avx2", d)
        assert re.search(r"nc \d+ im2col planes\] 3x3 stride 2x2", src), src[:3000]
