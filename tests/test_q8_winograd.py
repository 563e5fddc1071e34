"""The 8-bit exact integer Winograd F(2x2, 3x3) (schedule/q8wino.py, qconv2d_winograd.c.j2), bit
for bit against tinydeploy's exact reference under qemu-aarch64 (Cortex-A72: neon) and on the host
(AVX2), where it is selected by itself, and its build-time exactness bound.

One model per activation type holds many layers side by side (one compiled binary): odd output
sizes, H and W of 1 and 2, every padding (none, symmetric, asymmetric, 2 on a side), odd and
single input channels, odd output channels, many channels over several tile blocks, activation
zero points at both ends of their range, int8 weights over the whole range (-128 included), uint8
weights with a zero point (int16 w - zw), a fused Relu and an output range that saturates, and a
layer the bound refuses (it keeps the implicit GEMM); tile rows of 4, 8, 12 and 16 tiles (V in panels of 8
tiles) and of other counts."""
from __future__ import annotations

import re

import numpy as np
import pytest

from test_quantized import QDQ, qrange
from tinydeploy import flow
from test_q8_kernels import _x86_host
from tinydeploy.schedule import q8wino
from util import check_model_lsb, require, save

# (C, H, W, M, pads (top, left, bottom, right), x zero point: "lo" / "hi" / "mid", weights, act)
LAYERS = [
    (5, 7, 9, 13, (1, 1, 1, 1), "lo", "int8", "relu"),      # odd everything, padded
    (5, 7, 9, 6, (0, 0, 0, 0), "hi", "int8", None),         # no padding: 5x7 out
    (3, 1, 1, 4, (1, 1, 1, 1), "mid", "int8", None),        # 1x1 in and out
    (16, 2, 2, 8, (1, 1, 1, 1), "hi", "int8", "relu"),      # 2x2
    (1, 6, 5, 3, (0, 1, 2, 0), "lo", "int8", None),         # one input channel, asymmetric
    (7, 2, 19, 9, (2, 0, 1, 2), "mid", "uint8", None),      # H 2, W 19: uint8 weights with a zero point
    (40, 18, 20, 24, (1, 1, 1, 1), "lo", "int8", None),     # many channels: several tile blocks
    (4, 3, 17, 5, (1, 2, 0, 1), "hi", "int8", "sat"),       # W >= 16 per row, saturating output
    (6, 5, 16, 11, (1, 1, 1, 1), "lo", "int8", "relu"),     # 8 tiles a row: V in panels, C padded to 8
    (21, 13, 32, 8, (1, 0, 1, 2), "hi", "uint8", None),     # 16 tiles a row: panels, over several blocks
    (9, 11, 24, 16, (1, 1, 1, 1), "mid", "int8", "relu"),   # 12 tiles a row: half panels (4 tiles a vector)
]
REFUSED = (1840, 1, 1, 2)       # C, H, W, M with every weight -128 and zx at an end: 1840 * 9 * 128 * 255 >= 2^29


def _zp(kind, dtype):
    lo, hi = qrange(dtype)
    return {"lo": lo, "hi": hi, "mid": (lo + hi) // 2 + 3}[kind]


def wino_model(dtype):
    b = QDQ(11)
    inputs, outputs = [], []
    lo, hi = qrange(dtype)
    for i, (c, h, w, m, pads, zk, wt, act) in enumerate(LAYERS + [REFUSED + ((1, 1, 1, 1), "lo", "-128", None)]):
        xs = 0.05
        x = b.dq(f"x{i}", xs, _zp(zk, dtype), dtype)
        inputs.append((f"x{i}", dtype, [1, c, h, w]))
        ws = (b.rng.uniform(0.5, 2.0, m) * 2e-3).astype(np.float32)
        if wt == "uint8":
            wq = b.rng.integers(0, 256, (m, c, 3, 3)).astype(np.uint8)
            wn = b.dq(b.const(wq), ws, np.full(m, 131, np.uint8), np.uint8, 0)
        elif wt == "-128":
            wn = b.dq(b.const(np.full((m, c, 3, 3), -128, np.int8)), ws, np.zeros(m, np.int8), np.int8, 0)
        else:
            wn = b.weights((m, c, 3, 3), np.int8, ws, np.zeros(m, np.int8), axis=0)
        y = b.node("Conv", [x, wn, b.bias(m, (np.float32(xs) * ws).astype(np.float32))], kernel_shape=[3, 3],
                   pads=list(pads))
        if act == "relu":
            y = b.node("Relu", [y])
        ys = 1e-3 if act == "sat" else 0.08
        outputs.append((b.q(y, ys, lo + 5 if i % 2 else hi - 9, dtype), dtype))
    return b.model(inputs, outputs)


@pytest.mark.parametrize("dtype", [pytest.param(np.int8, id="s8"), pytest.param(np.uint8, id="u8")])
def test_aarch64_winograd_bit_exact(dtype, tmp_path, monkeypatch):
    """rpi4 (neon) selects the Winograd for every fitting layer with more than one input channel
    (forced: also the one-channel layer); the refused layer keeps the implicit GEMM. Two seeds,
    each held to the exact reference bit for bit and to the oracle."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    path = save(wino_model(dtype), tmp_path)
    for algo, want in (("auto", len(LAYERS) - 1), ("qconv2d_winograd", len(LAYERS))):
        monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
        for seed in (0, 1):
            res = flow.run(path, "rpi4", outdir=tmp_path / algo, quiet=True, latency=False, emulate=True, seed=seed)
            assert res["exact_reference"]["identical"] and res["outputs_match"], res
        src = (tmp_path / algo / "td_kernels.c").read_text()
        assert src.count("[qconv2d_winograd neon ") == want, algo
        assert src.count("[qconv2d_igemm neon ") == 1, algo          # the refused layer
        assert re.search(r"9x10 tiles, [1-4] tile rows a block", src), algo     # blocks, the last one short
        assert re.search(r"7x16 tiles, [1-3] tile rows a block", src), algo


@pytest.mark.parametrize("dtype", [pytest.param(np.int8, id="s8"), pytest.param(np.uint8, id="u8")])
def test_avx2_winograd_bit_exact(dtype, tmp_path, monkeypatch):
    """The x86 variant (vpmaddwd on channel pairs) on a host planned for AVX2 whatever this CPU
    is (AVX-512 and VNNI hosts keep their GEMMs): gcc, clang and gcc with ASan and UBSan, bit for
    bit against the exact reference, every fitting layer (the one-channel layer too)."""
    _x86_host("avx2", monkeypatch)
    path = save(wino_model(dtype), tmp_path)
    flow.build(path, "host", tmp_path / "probe", quiet=True, cc="gcc")
    src = (tmp_path / "probe" / "td_kernels.c").read_text()
    assert src.count("[qconv2d_winograd avx2 ") == len(LAYERS) - 1 and "(avx2)" in src
    monkeypatch.setenv("TINYDEPLOY_ALGO", "qconv2d_winograd")
    check_model_lsb(path, tmp_path, seeds=(0, 1))


def test_exactness_bound():
    """The build-time proof: sum |w| * max |x - zx| + |bias| < 2^29 per output channel, and |U|
    within int16; a layer one short of the bound is accepted, at it refused."""
    p = {"M": 1, "TX": "uint8_t", "ZX": 0}
    c = 2 ** 29 // (255 * 128 * 9)                      # whole channels of -128 under the bound
    w = np.full((1, c * 9), -128)
    assert q8wino.exact_for(p, w, [0])
    room = 2 ** 29 - 255 * 128 * 9 * c
    assert q8wino.exact_for(p, w, [room - 1]) and not q8wino.exact_for(p, w, [room])
    assert not q8wino.exact_for(p, np.full((1, 9), 3641), [0])        # 9 * 3641 > 32767
    assert q8wino.exact_for(dict(p, TX="int8_t", ZX=127), np.full((1, 9), 255), [0])
