"""The 8-bit pixels-in-lanes convolution of short-K layers (schedule/q8lanes.py,
qconv2d_lanes.c.j2), bit for bit against tinydeploy's exact reference under qemu-aarch64
(Cortex-A72: neon; it has no x86 or portable form), and where it is chosen by itself.

One model per activation type holds many layers side by side (one compiled binary, two seeds and
inputs at both ends of their range): the 1x1 direct form with K of 1, 3, 8, 13 and 16 (16 and 8
pixels a block), 40 and 64 (in passes of 16 taps); the im2col form of one-channel first layers
(KWS's 10x4 stride 2 over 49x10 with its padding, 3x3 padded, 1x3 stride (1, 2) asymmetrically
padded: K = 40, 9 and 3), of a 3-channel 3x3 stride-2 layer (K = 27, passes of 16 and 11) and of
a 2-channel one with a -128 weight (K = 18: the SMLAL form's 4 pixels a block, forced); pixel
counts that no block size divides, 1 and odd output channels, channels whose taps go in int16
groups (at their bound, with every input at an end of its range), activation zero points at both
ends of their range and in between, output zero points at the type's low end, 0 or 128 and
inside, int8 weights over the whole range (-128 included), symmetric or small, uint8 weights with
a zero point (int16 w - zw), a fused Relu and an output scale that saturates."""
from __future__ import annotations

import numpy as np
import pytest

from test_q8_winograd import _zp
from test_quantized import QDQ, qrange
from tinydeploy import flow
from tinydeploy.schedule import q8, q8lanes
from util import require, save

# (C, H, W, M, kernel, strides, pads (top, left, bottom, right), x zero point, weights, act, auto)
# auto: whether the layer takes qconv2d_lanes unforced (q8lanes.preferred)
LAYERS = [
    (8, 6, 7, 16, (1, 1), (1, 1), (0, 0, 0, 0), "lo", "sym", "relu", True),     # K 8: 42 px, 16 a block
    (1, 5, 5, 3, (1, 1), (1, 1), (0, 0, 0, 0), "hi", "int8", None, True),       # K 1
    (3, 1, 17, 1, (1, 1), (1, 1), (0, 0, 0, 0), "mid", "int8", "sat", True),   # K 3, one output channel
    (16, 3, 11, 5, (1, 1), (1, 1), (0, 0, 0, 0), "hi", "sym", "relu", True),   # K 16: 33 px, 8 a block
    (13, 4, 5, 7, (1, 1), (1, 1), (0, 0, 0, 0), "lo", "uint8", None, True),    # K 13, uint8 weights
    (40, 5, 3, 4, (1, 1), (1, 1), (0, 0, 0, 0), "mid", "sym", None, True),     # K 40 direct: 3 passes
    (1, 49, 10, 6, (10, 4), (2, 2), (4, 1, 5, 1), "lo", "sym", "relu", True),  # KWS's first layer
    (1, 7, 9, 5, (3, 3), (1, 1), (1, 1, 1, 1), "hi", "int8", None, True),      # K 9 im2col, 8 a block
    (1, 6, 13, 3, (1, 3), (1, 2), (0, 2, 0, 1), "mid", "sym", "relu", True),   # K 3, stride (1, 2)
    (2, 9, 11, 3, (3, 3), (2, 2), (0, 1, 1, 0), "lo", "int8", None, False),    # K 18, 2 channels
    (8, 4, 5, 3, (1, 1), (1, 1), (0, 0, 0, 0), "mid", "edge", None, True),     # int16 groups at their bound
    (16, 2, 9, 6, (1, 1), (1, 1), (0, 0, 0, 0), "hi", "small", "relu", True),  # many groups, 8 a block
    (3, 9, 10, 5, (3, 3), (2, 2), (0, 1, 1, 1), "hi", "sym", "relu", True),    # K 27: passes of 16 and 11
    (64, 3, 5, 5, (1, 1), (1, 1), (0, 0, 0, 0), "lo", "small", None, True),    # K 64: 4 passes
]
# the "edge" layer's weights: a group of taps whose products reach -32768 (taps 0-2 of channel 0
# with every x at -128), one that stops short of 32768 (channel 1: -127, -127, -2 would reach it),
# taps of both signs and zero taps (channel 2)
EDGE = [[127, 127, 2, 1, 1, 1, 1, 1], [-127, -127, -2, -1, -1, -1, -1, -1], [127, -127, 127, -127, 1, 1, 0, 0]]


def lanes_model(dtype):
    b = QDQ(5)
    inputs, outputs = [], []
    lo, hi = qrange(dtype)
    for i, (c, h, w, m, ks, st, pads, zk, wt, act, _) in enumerate(LAYERS):
        xs = 0.05
        x = b.dq(f"x{i}", xs, _zp(zk, dtype), dtype)
        inputs.append((f"x{i}", dtype, [1, c, h, w]))
        ws = (b.rng.uniform(0.5, 2.0, m) * 2e-3).astype(np.float32)
        shape = (m, c, *ks)
        if wt == "uint8":
            wn = b.dq(b.const(b.rng.integers(0, 256, shape).astype(np.uint8)), ws, np.full(m, 131, np.uint8),
                      np.uint8, 0)
        elif wt in ("edge", "small"):
            wq = np.array(EDGE, np.int8) if wt == "edge" else b.rng.integers(-40, 41, shape).astype(np.int8)
            if wt == "small":
                wq.reshape(m, -1)[:, 3] = -127
            wn = b.dq(b.const(wq.reshape(shape)), ws, np.zeros(m, np.int8), np.int8, 0)
        elif wt == "sym":
            wq = b.rng.integers(-127, 128, shape).astype(np.int8)
            wq.reshape(m, -1)[:, 0] = 127
            wn = b.dq(b.const(wq), ws, np.zeros(m, np.int8), np.int8, 0)
        else:
            wq = b.rng.integers(-128, 128, shape).astype(np.int8)
            wq.flat[0] = -128
            wn = b.dq(b.const(wq), ws, np.zeros(m, np.int8), np.int8, 0)
        y = b.node("Conv", [x, wn, b.bias(m, (np.float32(xs) * ws).astype(np.float32))], kernel_shape=list(ks),
                   strides=list(st), pads=[pads[0], pads[1], pads[2], pads[3]])
        if act == "relu":
            y = b.node("Relu", [y])
        ys = 1e-3 if act == "sat" else 0.06
        # output zero points: the type's low end (int8: -128, uint8: 0), one inside, 0 (int8) or 128
        # (uint8), one inside: each of the kernel's ways of adding it (saturating narrows alone, to
        # the other signedness and EOR 0x80, or SQADD)
        zy = [lo, lo + 4, 0 if dtype == np.int8 else 128, hi - 7][i % 4]
        outputs.append((b.q(y, ys, zy, dtype), dtype))
    return b.model(inputs, outputs)


@pytest.mark.parametrize("dtype", [pytest.param(np.int8, id="s8"), pytest.param(np.uint8, id="u8")])
def test_aarch64_lanes_bit_exact(dtype, tmp_path, monkeypatch):
    """rpi4 (neon): the layers q8lanes.preferred names take the kernel by itself, every layer when
    forced; both held to the exact reference bit for bit and to the oracle, on two seeds and on
    inputs all at the low or the high end of their range."""
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    path = save(lanes_model(dtype), tmp_path)
    # two seeds, then every input at an end of its range (the groups' int16 sums at their bound)
    ends = []
    for end in (0, -1):
        ends.append(tmp_path / f"end{end}.npz")
        np.savez(ends[-1], **{f"x{i}": np.full((1, r[0], r[1], r[2]), qrange(dtype)[end], dtype)
                              for i, r in enumerate(LAYERS)})
    for algo, want in (("auto", sum(r[-1] for r in LAYERS)), ("qconv2d_lanes", len(LAYERS))):
        monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
        for feed in [0, 1] + ends:
            seeded = isinstance(feed, int)
            res = flow.run(path, "rpi4", inputs=None if seeded else feed, seed=feed if seeded else 0,
                           outdir=tmp_path / algo, quiet=True, latency=False, emulate=True)
            assert res["exact_reference"]["identical"] and res["outputs_match"], (algo, feed, res)
        src = (tmp_path / algo / "td_kernels.c").read_text()
        assert src.count("[qconv2d_lanes neon ") == want, algo
        assert src.count(" groups direct] ") >= 3 and '"mla v' in src, algo
        for n in (16, 8, 4) if algo != "auto" else (16, 8):      # 4: the K = 18 layer's -128
            assert f"[qconv2d_lanes neon {n} pixels " in src, (algo, n)
        assert src.count(" in 3 passes groups ") == 2 and " in 2 passes groups " in src and " in 4 passes " in src


def test_int16_groups():
    """The build-time bound of a tap group (127 P + 128 N <= 32767, 128 P + 127 N <= 32768) at its
    edge, and the groups of 3 or more taps it makes (others alone; none with a -128)."""
    assert q8.int16_exact([127, 127, 2]) and not q8.int16_exact([127, 127, 3])
    assert q8.int16_exact([-127, -127, -1]) and not q8.int16_exact([-127, -127, -2])
    g = q8lanes.tap_groups(np.array(EDGE))
    assert g == [[[0, 1, 2], [3, 4, 5, 6, 7]], [[0, 1, 3], [2, 4, 5, 6, 7]], [[0, 1, 4, 5], [2], [3]]]
    assert q8lanes.tap_groups(np.array([[-128, 1, 1, 1]])) is None
    assert q8lanes.chunks(40, True) == [(0, 16), (16, 16), (32, 8)] and q8lanes.chunks(40, False) == [(0, 40)]


def test_lanes_choice():
    """Which layers fit and which are preferred: K up to 40 in one group, at least one block of
    pixels; the direct form up to K = 16, the im2col form of one-channel layers; forcing another
    family keeps it."""
    p = {"C": 8, "KH": 1, "KW": 1, "SH": 1, "SW": 1, "PT": 0, "PL": 0, "H": 48, "W": 48, "OH": 48, "OW": 48,
         "G": 1}
    assert q8lanes.fits(p) and q8lanes.preferred(p, "auto")
    assert not q8lanes.preferred(p, "qconv2d_gemm") and not q8lanes.preferred(dict(p, C=32), "auto")
    assert q8lanes.preferred(dict(p, C=32), "auto", True)        # the grouped form, in passes
    assert q8lanes.preferred(dict(p, C=32), "qconv2d_lanes") and not q8lanes.fits(dict(p, C=41))
    assert q8lanes.fits(dict(p, C=64), True) and not q8lanes.fits(dict(p, C=65), True)      # 4 passes of 16
    assert not q8lanes.fits(dict(p, OH=1, OW=15))        # fewer pixels than a block of 16
    kws = dict(p, C=1, KH=10, KW=4, SH=2, SW=2, PT=4, PL=1, H=49, W=10, OH=25, OW=5)
    assert q8lanes.fits(kws) and q8lanes.preferred(kws, "auto") and q8lanes.npx(40) == 4
    assert not q8lanes.preferred(dict(kws, C=3, KH=3, KW=3), "auto")     # ungrouped (a -128): igemm
