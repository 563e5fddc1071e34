"""8-bit kernel selection on CPUs with data caches (the host, Cortex-A): the integer GEMM
convolution, the depthwise convolution and the fully connected layer per ISA, each bit-exact with
the reference kernels it replaces (docs/quantization.md: the same int32 sums, the same float32
requantisation).

Which ISA: the first of the target's (targets/isa.py, best first) that has a variant of the family
(codegen/kernels.py) and whose 8-bit descriptor (ISA.q8) multiplies the layer's weight type. The
descriptor says how it multiplies exactly:
  madd  int16 pairs summed into int32 lanes (x86 vpmaddwd, ymm or zmm): activations widened to
        int16 as x - zx (|x - zx| <= 255) and weights as int16 (int8, uint8, or w - zw): a pair
        sum is at most 2 * 255 * 255, so nothing saturates (unlike vpmaddubsw's 16-bit sums)
  dot   four 8-bit products summed into int32 lanes (x86 vpdpbusd: u8 activations x s8 weights;
        Arm SDOT: s8 x s8): int8 weights only. Activations of the other signedness are moved by
        128 (x ^ 0x80), padded taps hold the input zero point, and the bias absorbs both:
        b_k = b' - (zx_loop + off) * sum(w) over every tap (int32 arithmetic wraps; the true
        accumulator fits, quant.fit_int32 proved it, so the wrapped sum is the reference's)
  mlal  int16 x int16 products widened into int32 lanes (Arm SMLAL by lane), activations as madd.
  maddubs  (a "dot" descriptor, Q8.maddubs) the im2col GEMM and fully connected layer of a madd
        ISA where the layer's int8 weights prove vpmaddubsw's saturating int16 pair sums exact
        (ubs_exact, checked here at build time: 255 * a pair's positive weights <= 32767, 255 *
        its negative magnitudes <= 32768; e.g. 7-bit weights, `quantize --reduce-range`), for
        convolutions possibly in another order of K (ubs_order, _gemm_q8_order: 8-bit weights),
        and K wastes at most an eighth of its k-groups of 4: dot's packing, activations and bias, with
        vpdpbusd done by vpmaddubsw + vpmaddwd(ones) + vpaddd (3 instructions per 32 (ymm) products
        where vpmaddwd's widened int16 pairs take 4).
  smull the im2col GEMM of an mlal ISA where the layer's int8 weights hold no -128 (Q8.pairs,
        checked here at build time) and K fills 7/8 of its k-groups of 16 or more: int8 x int8
        products in int16 (SMULL), two summed (SMLAL2; |pair| <= 2 * 127 * 128 < 2^15), pairs of
        those into int32 (SADALP); activations and bias as for dot (signed). Where K is unsplit
        over 2 k-groups or more the tile is inline assembly, 4 x 4 or 4 x 3 (smull_cols); "quad"
        4 x 3 tiles sum two k-groups' products in int16 before SADALP where the weights prove
        it (smull_quad; 1x1 layers also in another order of K, smull_quad_order). 1x1 layers
        with 16 columns or more take the "wide" 4 x 16 tile where it counts fewer instructions
        (smull_wide): the same SMULL + SMLAL2 + SADALP on steps of 4 k, the weights replicated
        at build time so that an int32 lane is one output column (no reduction across lanes),
        requantised and stored a row of 16 bytes at a time inside the assembly; over panels of 12
        columns with two steps summed in int16 where the weights prove it (smull_wide_quad, K
        possibly reordered: smull_quad_order(wide=True)) and it counts fewer instructions
        (smull_wide_quad_pays: VWW's 6x6 layers).

Kernels (templates firmware_templates/kernels/qconv2d_gemm.c.j2, qconv2d_dw.c.j2,
qdense_packed.c.j2; the ISA pieces in _q8.j2):
  qconv2d_gemm   convolution with any groups except depthwise as a GEMM per image and group,
                 Y[MG][P] = W[MG][K] . B[K][P]: weights packed at build time into MR-channel
                 panels of k-groups ([G][MP/MR][KGN][MR] words, zero rows and k padding), the
                 activations packed at run time into NR-column panels (rows of the input itself
                 for 1x1 stride-1 unpadded layers, im2col rows otherwise; padded taps hold the
                 input zero point), KC k-groups x NC columns at a time (the block stays in L2,
                 a B micro-panel in L1); int32 partial sums of a K split wait in scratch; the
                 last block's tile is requantised in registers and stored as bytes.
  qconv2d_dw     depthwise (group == in == out channels): per channel a zero-padded int16 copy
                 of the plane (x - zx), one plane per stride phase, then every output of the
                 flattened plane at once: tap pairs by vpmaddwd (x86) or taps by SMLAL (neon).
                 NEON with int8 weights: byte planes (activations as for dot, stride-2 phases
                 by LD2), tap pairs by SMULL (no -128 in the weights, as smull above) or runs of
                 up to 4 taps by SDOT over words of 4 plane bytes (neon-dotprod, stride 1;
                 strided layers take the next ISA); stride-1 windows up to 4 wide as wide as the
                 image take the row form (dw_rows): no gap columns, outputs stored in place.
                 SMULL pairs with 16 channels or more, windows up to 9 taps (dw_lanes): the
                 lanes form, 16 channels in the lanes of a vector over [pixel][16] byte planes
                 (transposed in and out by ST4 / LD4), a pixel's taps by one LD1 a window row,
                 each half block its own groups of taps summed in int16, taps outside the image
                 left out (their products with the zero point in the edge class's bias).
  qconv2d_igemm  one-group KxK convolution as an implicit GEMM over zero-point-padded planes of
                 KG interleaved channels (no im2col; taps unrolled): on ISAs whose descriptor
                 prefers it (Cortex-A), or when forced (TINYDEPLOY_ALGO=qconv2d_igemm); see
                 igemm_preferred.
  qconv2d_winograd  3x3 stride-1 one-group layers as an exact integer Winograd F(2x2, 3x3) where
                 the ISA's descriptor asks for it (Q8.winograd) and the weights prove it exact:
                 schedule/q8wino.py (select_kernels asks it before select_q8).
  qconv2d_lanes  one-group layers of short K (up to 64 taps) on Cortex-A72's NEON (mlal) with
                 the output pixels in the vector lanes, the activation rows read in place and
                 the output channels unrolled (taps in int16 groups where int16_exact proves
                 them): schedule/q8lanes.py (asked after the Winograd, before select_q8, for
                 single-thread builds).
  qdense_packed  fully connected: output columns in the vector lanes (weights packed at build
                 time [N/NRD][KGN][NRD][KG], int8 kept int8 and widened as loaded), the input
                 row broadcast a k-group at a time, the requantisation per column in registers.
TINYDEPLOY_ALGO=ref keeps the reference kernels (as for fp32).
"""
from __future__ import annotations

import itertools
import os
import re

import numpy as np

from tinydeploy import ir
from tinydeploy.codegen import kernels as kreg
from tinydeploy.ops import Kernel
from tinydeploy.ops.registry import new_const, scratch_arg
from tinydeploy.schedule.cost import IGEMM_MAX_TAPS, _round_up, ranked_tiles
from tinydeploy.quant.params import qadd_int32, qadd_int32_folded
from tinydeploy.targets.isa import Q8, get_isa

FAMILIES = ("qconv2d_gemm", "qconv2d_igemm", "qconv2d_dw", "qdense_packed")
DW_MAX_TAPS = 64          # depthwise windows up to 8x8 (taps unrolled); larger ones take the GEMM


def q8_isa(family: str, k: Kernel, target) -> str | None:
    """The first of the target's ISAs with a variant of `family` that multiplies this layer's
    weight type, or None."""
    if k.params.get("TX") not in ("int8_t", "uint8_t"):
        return None
    for isa in target.isas:
        q = get_isa(isa).q8
        if q is not None and k.params.get("TW") in q.weights and kreg.has_variant(family, k.dtype, isa):
            return isa
    return None


def act_offset(q: Q8, tx: str, zx_loop: int) -> tuple[int, bool]:
    """(off, flip): the kernel multiplies v = x + off, as int16 (madd, mlal: off = -zx_loop) or as
    bytes of the signedness its dot product wants (flip: x ^ 0x80, off = +-128)."""
    if q.flavour not in ("dot", "smull"):
        return -zx_loop, False
    signed = tx == "int8_t"
    flip = signed != q.signed
    return ((128 if signed else -128) if flip else 0), flip


def wrap32(v: np.ndarray) -> np.ndarray:
    """int64 -> int32 modulo 2^32 (the kernels' int32 adds wrap the same way)."""
    return ((np.asarray(v, np.int64) + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.int32)


def requant_scales(m: np.ndarray, s: np.ndarray) -> np.ndarray:
    """R = f32(m) * 2^-s, the float32 ratio every requantisation multiplies by (exact.requant_f32)."""
    return (np.asarray(m, np.int64).astype(np.float32)
            * np.ldexp(np.float32(1.0), -np.asarray(s, np.int64)).astype(np.float32)).astype(np.float32)


def group_words(a: np.ndarray, flavour: str) -> np.ndarray:
    """[..., KG] integer values -> what the kernels load: int32 words of KG int16 (madd) or KG
    bytes (dot), the first in the low bits; int16 as they are for mlal (KG = 1)."""
    a = np.asarray(a, np.int64)
    if flavour == "mlal":
        return a[..., 0].astype(np.int16)
    bits = 16 if flavour == "madd" else 8
    mask = (1 << bits) - 1
    word = np.zeros(a.shape[:-1], np.int64)
    for i in range(a.shape[-1]):
        word |= (a[..., i] & mask) << (bits * i)
    return word.astype(np.uint32).view(np.int32)


def _conv_weights(g: ir.Graph, k: Kernel) -> np.ndarray:
    """The reference kernel's weights as [M][C/G * KH * KW] (undoing its pixel-form re-layout)."""
    p = k.params
    w = k.tensor(k.args[1], g).data.astype(np.int64)
    if p["form"] == "pixel":
        w = w.reshape(p["C"], p["KH"], p["KW"], p["M"]).transpose(3, 0, 1, 2)
    return w.reshape(p["M"], -1)


def _channel_bias(g, k, q, w_rows, zx_loop, tx) -> np.ndarray:
    """bias_k per output channel (int64, unwrapped): b' - (zx_loop + off) * sum(w)."""
    off, _ = act_offset(q, tx, zx_loop)
    return k.tensor(k.args[2], g).data.astype(np.int64) - (zx_loop + off) * w_rows.sum(axis=1)


def _channel_consts(g, k, consts, q, isa, w_rows, zx_loop, tx, rows_per_group, padded_rows):
    """bias_k (int32) and R (float32) per output channel, padded per group to `padded_rows`."""
    b = k.tensor(k.args[2], g).data.astype(np.int64)
    bias = _channel_bias(g, k, q, w_rows, zx_loop, tx)
    r = requant_scales(k.tensor(k.args[3], g).data, k.tensor(k.args[4], g).data)
    groups = len(b) // rows_per_group
    bk = np.zeros((groups, padded_rows), np.int64)
    rk = np.zeros((groups, padded_rows), np.float32)
    bk[:, :rows_per_group] = bias.reshape(groups, rows_per_group)
    rk[:, :rows_per_group] = r.reshape(groups, rows_per_group)
    base = k.args[-1]
    return (new_const(g, consts, base + "_bias_" + isa.replace("-", "_"), wrap32(bk.reshape(-1))),
            new_const(g, consts, base + "_requant_scale", rk.reshape(-1)))


def tile_fits(q: Q8, mr: int, nr: int) -> bool:
    """Whether the ISA's kernels can be generated for an MR x NR tile (lanes, register loads)."""
    step = 8 if q.lanes == 4 else q.lanes          # neon: int16 B registers of 8 columns
    return mr >= 1 and nr >= step and nr % step == 0 and (q.lanes != 4 or mr % 4 == 0)


def _tile(q: Q8, rows: int, cols: int, kgn: int = 0) -> tuple[int, int]:
    """The ISA's 8-bit tile of least estimated cost, or TINYDEPLOY_TILE=MRxNR where it fits. With
    `kgn` (the im2col GEMM's k-groups) on an ISA with measured tile costs (Q8.gemm_instr): the
    fewest instructions, every tile (edges included) costing a whole one."""
    forced = os.environ.get("TINYDEPLOY_TILE", "")
    if forced:
        mr, nr = (int(v) for v in forced.lower().split("x"))
        if tile_fits(q, mr, nr):
            return mr, nr
    if kgn and q.gemm_instr:
        def instr(t):
            mr, nr, per_k, short, long_ = t
            return -(-rows // mr) * -(-cols // nr) * (kgn * per_k + (short if kgn <= 4 else long_))
        return min(q.gemm_instr, key=instr)[:2]
    return ranked_tiles("", rows, cols, tiles=q.tiles)[0]


def trans_tile(q: Q8, rows: int, cols: int, kgn: int, gb: int, l2: int, tile: tuple[int, int]) -> tuple[int, int] | None:
    """The transposed tile (x86: MR output channels in the vector lanes, NR pixels broadcast;
    Q8.trans) for a rows x cols GEMM with kgn k-groups, where its padded output (each tile a whole
    one, times its relative cost) is less than the chosen `tile`'s and K stays in one block; else
    None (a twentieth of margin: its epilogue stores bytes one at a time, transposed).
    TINYDEPLOY_TRANS=MRxNR forces one that fits the ISA's registers (tests), =0 none."""
    forced = os.environ.get("TINYDEPLOY_TRANS", "")
    if q.lanes not in (8, 16) or q.flavour not in ("dot", "madd") or forced == "0":
        return None
    if forced:
        mr, nr = (int(v) for v in forced.lower().split("x"))
        regs = 16 if q.lanes == 8 else 32
        ok = mr % q.lanes == 0 and nr >= 1 and (mr // q.lanes) * (nr + 1) + 2 <= regs
        return (mr, nr) if ok and kgn * nr * gb <= l2 // 2 else None
    if not q.trans or os.environ.get("TINYDEPLOY_TILE"):
        return None
    eff = {(m, n): e for m, n, e in q.tiles}.get(tile, 1.0)
    cur = _round_up(rows, tile[0]) * _round_up(cols, tile[1]) * eff
    mr, nr, e = min(q.trans, key=lambda t: _round_up(rows, t[0]) * _round_up(cols, t[1]) * t[2])
    if _round_up(rows, mr) * _round_up(cols, nr) * e < 0.95 * cur and kgn * nr * gb <= l2 // 2:
        return mr, nr
    return None


def ubs_exact(w: np.ndarray, kgroup: int = 4) -> bool:
    """Whether vpmaddubsw sums every pair of this layer's products exactly: u8 activations
    (0..255) times the int8 weights of a pair (k = 2 j, 2 j + 1 of the packed k-groups of 4;
    zero weights past K) add up in saturating int16, which cannot saturate where
    255 * (sum of the pair's positive weights) <= 32767 and 255 * (sum of its negative weights'
    magnitudes) <= 32768, for every output channel and pair. w: [M][K] int8 weights (in the
    packed order of K)."""
    if not w.size:
        return False
    a = np.zeros((w.shape[0], _round_up(w.shape[1], kgroup)), np.int64)
    a[:, :w.shape[1]] = w
    a = a.reshape(len(a), -1, 2)
    pos, neg = np.clip(a, 0, None).sum(axis=2), np.clip(-a, 0, None).sum(axis=2)
    return 255 * int(pos.max()) <= 32767 and 255 * int(neg.max()) <= 32768


def pairs_exact(pq: Q8, w: np.ndarray) -> bool:
    """Whether the pairs flavour `pq` multiplies these int8 weights ([M][K]) exactly: SMULL pairs
    where no weight is -128 (no (-128) x (-128) product), vpmaddubsw where ubs_exact proves its
    saturating int16 pair sums cannot saturate."""
    if pq.maddubs:
        return ubs_exact(w, pq.kgroup)
    return bool(w.size) and int(w.min()) > -128


def ubs_order(w: np.ndarray) -> np.ndarray | None:
    """An order of K under which ubs_exact holds (k-position i holds column order[i]), or None:
    a pairing of the columns in which no pair is "bad" for any row, where bad means both weights
    of one sign and 255 times their magnitudes' sum over int16's range (sum >= 129; two weights of
    at most 64 never are, so only rows where one of them is 65 or more need a look). Found
    greedily, deterministic for the same weights: the column with the fewest free partners left
    first, paired with the free partner that itself has the fewest; an odd last column pairs with
    K's zero padding (always exact). Why: ResNet-50 as `tinydeploy quantize` makes it (8-bit
    per-channel weights) fails ubs_exact in every layer in the natural order (0.01-0.2% of its
    pairs), yet every convolution finds such an order (its fully connected layer, a quarter of
    its pairs bad, does not). w: [M][K] int8 weights."""
    a = np.asarray(w, np.int64)
    kk = a.shape[1]
    if kk < 2:
        return np.arange(kk) if ubs_exact(a) else None
    bad = np.zeros((kk, kk), bool)
    for mag in (np.clip(a, 0, None), np.clip(-a, 0, None)):       # one sign at a time
        for r in np.flatnonzero((mag >= 65).any(axis=1)):
            big = np.flatnonzero(mag[r] >= 65)
            bad[big] |= mag[r][None, :] >= 129 - mag[r, big][:, None]
    bad |= bad.T
    np.fill_diagonal(bad, True)
    free = np.ones(kk, bool)
    deg = (~bad).sum(axis=1)                 # compatible free partners of each column
    order = []
    while free.any():
        cand = np.flatnonzero(free)
        c = int(cand[np.argmin(deg[cand])])
        free[c] = False
        deg -= ~bad[c]
        part = np.flatnonzero(free & ~bad[c])
        if not len(part):
            if free.any():
                return None
            order.append(c)                  # the last, odd column: with K's padding
            break
        d = int(part[np.argmin(deg[part])])
        free[d] = False
        deg -= ~bad[d]
        order += [c, d]
    perm = np.array(order, np.int64)
    return perm if ubs_exact(a[:, perm]) else None


def _pairs(q: Q8, k: Kernel, w: np.ndarray) -> Q8 | None:
    """The ISA's `pairs` flavour (SMULL pairs, vpmaddubsw) where this layer's weights allow it
    (pairs_exact, checked here at build time), else None."""
    if q.pairs is not None and k.params["TW"] in q.pairs.weights and pairs_exact(q.pairs, w):
        return q.pairs
    return None


def _gemm_q8(q: Q8, k: Kernel, w: np.ndarray) -> Q8:
    """The descriptor the im2col GEMM of this layer uses: the ISA's, or its `pairs` flavour where
    the weights allow it (_pairs) and its k-groups spend at most an eighth of their bytes on
    padding. Measured on rpi4 (exact instructions): VWW's layer 3 (K = 8, one k-group of 16 half
    empty) 259 k with SMULL pairs against 187 k with SMLAL, KWS's first layer (K = 40 in 48)
    153 k against 139 k; whole k-groups (K = 16, 32, 64) 127 k, 204 k and 174 k against 142 k,
    251 k and 223 k."""
    pq = _pairs(q, k, w)
    if pq is not None and 8 * (_round_up(w.shape[-1], pq.kgroup) - w.shape[-1]) <= _round_up(w.shape[-1], pq.kgroup):
        return pq
    return q


def _gemm_q8_order(q: Q8, k: Kernel, w: np.ndarray, direct: bool) -> tuple[Q8, np.ndarray | None]:
    """_gemm_q8, and where that keeps the ISA's own descriptor although it has the vpmaddubsw
    flavour: that flavour with K in an order under which the weights prove its pair sums exact
    (ubs_order), with the order (packed k-position i reads column order[i] of the layer's K).
    Where the rows are gathered (im2col) only for 64 output channels a group or more: reading
    K's columns through the order costs the gather time, which the faster tile must pay back.
    Measured on an AVX2 host (bench --layers, us): IC's layer 6 (32 channels, K = 144) 29.6
    reordered against 22.7 in its own order (same flavour) and 27.1 on vpmaddwd; VWW's layer 1
    (8 channels) 28.3 against 25.7 on vpmaddwd; ResNet-50's (64 to 512 channels) 1,822 against
    2,084 (conv1), 1,716 against 1,882 (layer2.0.conv2), 2,076 against 2,597 (layer4.0.conv2)."""
    pq = q.pairs
    p = k.params
    if (_gemm_q8(q, k, w) is q and pq is not None and pq.maddubs and p["TW"] in pq.weights
            and (direct or p["M"] // p["G"] >= 64)
            and 8 * (_round_up(w.shape[-1], pq.kgroup) - w.shape[-1]) <= _round_up(w.shape[-1], pq.kgroup)):
        order = ubs_order(w)
        if order is not None:
            return pq, order
    return _gemm_q8(q, k, w), None


def smull_cols(cols: int, kgn: int, quad: bool = False) -> int:
    """The SMULL-pairs tile's columns (4 rows; an unsplit K: the inline-assembly tile): 3 where its
    panels take fewer instructions than 4's by the exact counts' model, per tile kgn k-groups of 52
    instructions (4 x 4), 38 (4 x 3) or 32 (4 x 3 quad), plus about 64 for the sums'
    reduction, the requantisation and the loops: VWW's 3x3 layers (9 columns: 3 panels of 3
    against 3 of 4, a quarter of them padding), its 6x6 layers with quad (K = 128); not where K
    is short (VWW's layer 7, K = 32 on 576 columns, quad: 198.6 k against 195.0 k)."""
    c4 = -(-cols // 4) * (kgn * 52 + 64)
    c3 = -(-cols // 3) * (kgn * (32 if quad else 38) + 64)
    return 3 if 100 * c3 < 97 * c4 else 4


def smull_quad(w: np.ndarray, kgn: int) -> bool:
    """Whether the 4 x 3 SMULL tile may sum two k-groups' products in int16 before SADALP: the four
    int8 products an int16 lane gathers (k = j, 8 + j of a k-group of 16 and of the next; the pairs
    (0, 1), (2, 3) .. of the KGN k-groups, or (1, 2), (3, 4) .. where KGN is odd) are at most 128
    times the sum of their |w| (activations as signed bytes: |v| <= 128), which must stay within
    int16: |w| summing to at most 255 in every row's lanes. w: [M][K] int8 weights."""
    if kgn < 2 or not w.size:
        return False
    a = np.zeros((w.shape[0], kgn * 16), np.int64)
    a[:, :w.shape[1]] = np.abs(w)
    lanes = a.reshape(len(a), kgn, 2, 8).sum(axis=2)
    s0 = kgn % 2
    pairs = lanes[:, s0:].reshape(len(a), -1, 2, 8).sum(axis=2)
    return 128 * int(pairs.max()) <= 32767


def smull_wide_quad(w: np.ndarray) -> bool:
    """Whether the wide tile may sum two steps' products in int16 before SADALP (K a multiple of
    8): an int16 lane of row r then gathers k = 8 p + j + 2 t (t = 0..3, j = 0, 1), which must
    hold |w| summing to at most 255, as for smull_quad. w: [M][K] int8 weights."""
    if not w.size or w.shape[1] % 8:
        return False
    lanes = np.abs(np.asarray(w, np.int64)).reshape(len(w), -1, 4, 2).sum(axis=2)
    return 128 * int(lanes.max()) <= 32767


def smull_quad_order(w: np.ndarray, tries: int = 4000, wide: bool = False) -> np.ndarray | None:
    """An order of K (K a multiple of 32, a 1x1 layer: B's rows are the input channels, read in
    this order) under which smull_quad holds (wide: K a multiple of 8, smull_wide_quad), or None: the channels dealt into the K/4 lane
    quads (4 positions an int16 lane sums) largest |w| first, then swaps between quads that
    lower the excess over 255 (summed over rows and quads), from a fixed seed (the same order for
    the same weights). VWW's 128-channel layers 15, 17 and its 32-channel layer 7 find one, KWS's
    do not (their quads of the largest |w| exceed 255 in some row whatever the order)."""
    a = np.abs(np.asarray(w, np.int64))
    m, k = a.shape
    nq = k // 4
    order = np.argsort(-a.sum(axis=0), kind="stable")
    g = np.zeros((nq, 4), np.int64)
    for i, c in enumerate(order):            # snake: the largest spread over the quads
        r, j = divmod(i, nq)
        g[j if r % 2 == 0 else nq - 1 - j, r] = c
    s = a[:, g].sum(axis=2)                  # [M][quads]
    over = int(np.maximum(s - 255, 0).sum())
    rng = np.random.default_rng(0)
    for _ in range(tries):
        if over == 0:
            break
        bad = np.argwhere(s > 255)
        q1 = int(bad[rng.integers(len(bad))][1])
        q2, i1, i2 = int(rng.integers(nq)), int(rng.integers(4)), int(rng.integers(4))
        if q2 == q1:
            continue
        d = a[:, g[q2, i2]] - a[:, g[q1, i1]]
        n1, n2 = s[:, q1] + d, s[:, q2] - d
        new = over - int(np.maximum(s[:, q1] - 255, 0).sum() + np.maximum(s[:, q2] - 255, 0).sum()) + int(
            np.maximum(n1 - 255, 0).sum() + np.maximum(n2 - 255, 0).sum())
        if new <= over:
            g[q1, i1], g[q2, i2] = g[q2, i2], g[q1, i1]
            s[:, q1], s[:, q2], over = n1, n2, new
    if over:
        return None
    perm = np.zeros(k, np.int64)             # quad (pair i, lane j) -> k-positions 32 i + j + 8 t
    for qd in range(nq):                     # (wide: step pair i, lane j -> 8 i + j + 2 t)
        i, j = divmod(qd, 2 if wide else 8)
        perm[(8 if wide else 32) * i + j + (2 if wide else 8) * np.arange(4)] = g[qd]
    if wide:
        return perm if smull_wide_quad(a[:, perm]) else None
    return perm if smull_quad(a[:, perm], k // 16) else None


def smull_wide(cols: int, kk: int, nr: int, quad: bool) -> bool:
    """Whether a 1x1 layer (one group, whole 4-row panels, K a multiple of 4, 16 columns or more)
    takes the wide SMULL tile (4 rows x 16 columns, columns in the int32 lanes: _q8.j2
    gemm_tile_wide_asm) rather than the 4 x nr tile (quad or not), by the exact counts' model per
    4-row panel: the wide tile 50 instructions per step of 4 k over a full panel of 16 columns
    plus about 100 (requantisation and stores), 2 + 12 per column group of the last panel's
    steps plus 30 a group; the 4 x nr tile as smull_cols."""
    if cols < 16 or kk % 4:
        return False
    ks, kgn = kk // 4, -(-kk // 16)
    full, rem = divmod(cols, 16)
    nbt = -(-rem // 4)
    wide = full * (ks * 50 + 100) + (ks * (2 + 12 * nbt) + 30 * nbt if rem else 0)
    per = kgn * (52 if nr == 4 else 32 if quad else 38) + 64
    return wide < -(-cols // nr) * per


def smull_wide_quad_pays(cols: int, kk: int, nr: int, quad: bool) -> bool:
    """Whether the wide tile over 12-column panels with two steps summed in int16 (smull_wide_quad:
    64 instructions per 8 k of a panel plus about 90) counts fewer instructions than the 4 x nr
    tile (smull_cols' model) and the wide tile without it (smull_wide's): VWW's 128-channel 6x6
    layers, its 24x24 layer 7 (exact instructions on rpi4: 148,228 -> 136,558). Panels of 12 whole
    columns, packed by an unrolled loop (up to 640 columns, 40 vectors of 16)."""
    if cols % 12 or cols > 640 or kk % 8:
        return False
    wq = cols // 12 * (kk // 8 * 64 + 90)
    full, rem = divmod(cols, 16)
    nbt = -(-rem // 4)
    wide = full * (kk // 4 * 50 + 100) + (kk // 4 * (2 + 12 * nbt) + 30 * nbt if rem else 0)
    return wq < min(wide, -(-cols // nr) * (-(-kk // 16) * (52 if nr == 4 else 32 if quad else 38) + 64))


def _tag(q: Q8) -> str:
    """What a kernel's description adds for a layer on the ISA's pairs flavour (SMULL, vpmaddubsw)."""
    return " smull" if q.flavour == "smull" else " maddubs" if q.maddubs else ""


def _group_bytes(q: Q8) -> int:
    """Bytes one column of a packed activation panel takes per k-group."""
    return 2 * q.kgroup if q.flavour in ("madd", "mlal") else q.kgroup


def gemm_scratch_words(p: dict) -> int:
    """int32 words of scratch one thread of qconv2d_gemm uses: the packed B block, the im2col row
    buffers, the int32 partial sums of a split K, the padded planes of a group (Q8.gemm_planes;
    each thread its own; 16 bytes after the rows and after the planes for the 8-byte copies of
    short output rows)."""
    b = -(-p["NC"] // p["NR"]) * p["NR"] * p["KCG"] * p["GB"]
    pl = bool(p.get("PLANES"))
    prows = pl and p["KH"] * p["KW"] == 1       # a 1x1 window: the planes' rows are the im2col rows
    rows = 0 if p["DIRECT"] or prows else p["KG"] * _round_up(p["NC"], 64) + (16 if pl else 0)
    acc = 4 * p["MP"] * _round_up(p["NC"], p["NR"]) if p["KB"] > 1 else 0
    planes = _round_up(p["CG"] * p["PPLS"] + 16, 64) if pl else 0
    return (_round_up(b, 64) + rows + acc + planes) // 4


def fit_gemm(k: Kernel, room: int) -> bool:
    """Size qconv2d_gemm's scratch to at most `room` bytes (the planner's fit): its columns per
    block (NC, whole NR panels) cut down from the L2-sized block to what fits, at least the ISA's
    Q8.fit_cols (or the layer's columns); fit_gemm(k, 0) leaves it at that floor, which sets the
    peak. Where the hole under the peak is smaller than the floor needs (the activations around
    it leave it fragmented), the block is cut below the floor to fill it (down to one NR panel)
    rather than raise the arena. The kernel packs and multiplies block by block, so the results do
    not change, only how many columns wait in scratch. Threaded layers, and ISAs without a measured floor, keep their blocks (False)."""
    p = k.params
    floor = get_isa(p["q8_isa"]).q8.fit_cols if k.family == "qconv2d_gemm" else 0
    if not floor or p.get("THREADS", 1) > 1 or p.get("WIDE"):
        return False
    full = p["NC_MAX"]
    nr = p["NR"]

    def words(nc: int) -> int:
        return gemm_scratch_words(dict(p, NC=nc))
    low = min(full, _round_up(floor, nr))
    if room and 4 * words(low) > room:
        low = nr        # a hole under the peak smaller than the floor (fragmentation): fill it
    lo, hi = low // nr, full // nr            # in NR panels; the scratch grows with NC
    if 4 * words(full) <= room or hi <= lo:
        nc = full
    else:
        while lo < hi:                        # the most panels whose scratch fits (else low)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if 4 * words(mid * nr) <= room else (lo, mid - 1)
        nc = lo * nr
    k.params = dict(p, NC=nc)
    k.scratch_bytes = 4 * words(nc)
    k.desc = re.sub(r" nc \d+", f" nc {nc}", k.desc, count=1)
    return True


def gemm_planes(q: Q8, p: dict) -> bool:
    """Whether the im2col GEMM copies its rows from phase planes (Q8.gemm_planes; on x86 with
    vpmaddubsw the strided layers of a window wider than 1x1, Q8.gemm_planes_strided); TINYDEPLOY_GEMM_PLANES=1 forces it, =0 not (tests)."""
    forced = os.environ.get("TINYDEPLOY_GEMM_PLANES", "")
    if forced:
        return forced == "1"
    strided = (p["SH"] > 1 or p["SW"] > 1) and p["KH"] * p["KW"] > 1
    return q.gemm_planes or (q.gemm_planes_strided and strided)


def select_qconv_gemm(g: ir.Graph, step: int, k: Kernel, target, isa: str) -> Kernel:
    p = dict(k.params)
    w = _conv_weights(g, k)                                   # [M][K]
    direct = p["KH"] == p["KW"] == p["SH"] == p["SW"] == 1 and p["PT"] == p["PL"] == 0 and (
        p["OH"], p["OW"]) == (p["H"], p["W"])
    q, kperm = _gemm_q8_order(get_isa(isa).q8, k, w, direct)
    if kperm is not None:
        w = w[:, kperm]               # packed k-position i holds column kperm[i] of K
    G = p["G"]
    mg, cg = p["M"] // G, p["C"] // G
    kk = cg * p["KH"] * p["KW"]
    kg = q.kgroup
    kgn = -(-kk // kg)
    cols = p["OH"] * p["OW"]
    mr, nr = _tile(q, mg, cols, kgn)
    gb = _group_bytes(q)
    l1, l2 = int(target.l1d_bytes or 32768), int(target.l2_bytes or 524288)
    quad = False
    if q.flavour == "smull" and (mr, nr) == (4, 4) and kgn >= 2 and kgn * 4 * gb <= l2 // 2 and not os.environ.get(
            "TINYDEPLOY_TILE"):
        quad = smull_quad(w, kgn)
        if not quad and direct and G == 1 and kk % 32 == 0:
            kperm = smull_quad_order(w)
            quad = kperm is not None
        nr = smull_cols(cols, kgn, quad)
        quad = quad and nr == 3
        if not quad:
            kperm = None
        elif kperm is not None:
            w = w[:, kperm]           # packed k-position i holds input channel kperm[i]
    elig = (q.flavour == "smull" and direct and G == 1 and mg % 4 == 0 and kgn >= 2 and mr == 4
            and not os.environ.get("TINYDEPLOY_TILE"))
    wquad, wperm = False, None
    if elig and smull_wide_quad_pays(cols, kk, nr, quad):
        w0 = _conv_weights(g, k)
        wquad = smull_wide_quad(w0)
        if not wquad:
            wperm = smull_quad_order(w0, wide=True)
            wquad = wperm is not None
    wide = elig and (wquad or smull_wide(cols, kk, nr, quad))
    if wide:                  # the wide tile: K in its order, B packed once, 16 columns a panel
        quad, kperm, nr, w = False, None, 16, _conv_weights(g, k)
    if wquad:                 # ... or 12, two steps summed in int16 (K in another order where needed)
        quad, kperm, nr = True, wperm, 12
        if kperm is not None:
            w = w[:, kperm]
    trans = None if wide or q.flavour == "smull" else trans_tile(q, mg, cols, kgn, gb, l2, (mr, nr))
    if trans:                 # output channels in the vector lanes, pixels broadcast
        mr, nr = trans
    mp = _round_up(mg, mr)
    # All of K in one block where a panel of NR columns over all of K fits in half of L2: measured
    # on an AVX2 host, the ResNet-50 (uint8) layers split in K (int32 partial sums kept between the
    # blocks) ran at half the speed of the same layers unsplit. Else blocks of half of L1.
    if kgn * nr * gb <= l2 // 2:
        kcg = kgn
    else:
        kcg = min(kgn, max(16, (l1 // 2) // (nr * gb)))
    blocks = -(-kgn // kcg)
    kcg = -(-kgn // blocks)
    nc = min(_round_up(cols, nr), max(nr, (l2 // 2) // (kcg * gb) // nr * nr))
    zx_loop = p["ZX"] if p["zp_in_loop"] else 0
    off, flip = act_offset(q, p["TX"], zx_loop)
    wp = np.zeros((G, mp, kgn * kg), np.int64)
    wp[:, :mg, :kk] = w.reshape(G, mg, kk)
    wp = wp.reshape(G, mp // mr, mr, kgn, kg).transpose(0, 1, 3, 2, 4)    # [G][MP/MR][KGN][MR][KG]
    consts = {}
    wdat = wp.astype(np.int8) if q.flavour == "smull" else group_words(wp, q.flavour)
    if wide:                  # [MP/4][K/4][4 rows][16]: w[k0], w[k1] four times, then w[k2], w[k3]
        kcg, blocks, nc = kgn, 1, _round_up(cols, nr)
        w4 = np.zeros((mp, kk // 4, 2, 4, 2), np.int64)
        w4[:mg] = w.reshape(mg, kk // 4, 2, 1, 2)
        wdat = w4.reshape(mp // 4, 4, kk // 4, 16).transpose(0, 2, 1, 3).astype(np.int8)
    wname = new_const(g, consts, k.args[1] + "_" + isa.replace("-", "_"), wdat.reshape(-1))
    bname, rname = _channel_consts(g, k, consts, q, isa, w, zx_loop, p["TX"], mg, mp)
    p.update(algo="qconv2d_gemm", q8_isa=isa, FLAVOUR=q.flavour, KG=kg, KGN=kgn, KCG=kcg, KB=blocks, MR=mr,
             NR=nr, NC=nc, NC_MAX=nc, MG=mg, CG=cg, K=kk, MP=mp, P=cols, GB=gb, DIRECT=direct, XOFF=off, FLIP=flip,
             ZXL=zx_loop, PADB=p["ZX"] % 256, PLANES=not direct and gemm_planes(q, p), QUAD=quad,
             KPERM=[int(v) for v in kperm] if kperm is not None else [], WIDE=wide, KS=kk // 4,
             TRANS=bool(trans))
    if p["PLANES"]:           # the padded planes of a group's channels, one per stride phase
        hp, wp, phases, offs = dw_geometry(p)
        p.update(PHP=hp, PWP=wp, PPH=phases, POFFS=offs, PPLS=len(phases) * hp * wp)
    scratch = 4 * gemm_scratch_words(p)
    args = [k.args[0], wname, bname, rname, k.args[-1], scratch_arg(step)]
    how = "direct" if direct else "im2col planes" if p["PLANES"] else "im2col"
    desc = f"[qconv2d_gemm {isa}{_tag(q)} {mr}x{nr}{' trans' if trans else ''}{' wide' if wide else ''}{' quad' if quad else ''}{' K reordered' if kperm is not None else ''} kc {kcg * kg} nc {nc} {how}] {k.desc}"
    return Kernel("qconv2d_gemm", k.dtype, p, args, scratch, desc, consts=consts, scratch_dtype="int32")


def igemm_fits(p: dict) -> bool:
    """The implicit GEMM takes one group and a KH x KW > 1 window (taps unrolled)."""
    return p["G"] == 1 and 1 < p["KH"] * p["KW"] <= IGEMM_MAX_TAPS


def igemm_preferred(q: Q8, p: dict, force: str) -> bool:
    """Whether a layer igemm_fits takes the implicit GEMM: where forced (TINYDEPLOY_ALGO=
    qconv2d_igemm), else where the ISA's descriptor prefers it (Q8.igemm: Cortex-A, by exact
    instruction counts) and the input has more than one channel (KWS's first layer, 1 channel
    10x4 stride 2: the im2col GEMM took 189 k instructions on rpi4 against 207 k, 82 k on
    jetson-orin against 162 k). x86 keeps im2col: measured on an AVX2 host it ran every 3x3 / 7x7
    layer of ResNet-50 (uint8) and the MLPerf Tiny int8 models as fast or faster (ResNet-50 151 ms
    against 273 ms, IC 371 us against 414 us). TINYDEPLOY_ALGO=qconv2d_gemm keeps im2col."""
    if not igemm_fits(p) or force == "qconv2d_gemm":
        return False
    return force == "qconv2d_igemm" or (q.igemm and p["C"] > 1)


def select_qconv_igemm(g: ir.Graph, step: int, k: Kernel, target, isa: str) -> Kernel:
    p = dict(k.params)
    w = _conv_weights(g, k)                                             # [M][C * taps]
    q = get_isa(isa).q8
    pq = _pairs(q, k, w)
    if pq is not None and pq.flavour == "smull" and -(-p["C"] // pq.kgroup) * pq.kgroup * 4 <= 5 * p["C"]:
        q = pq                  # SMULL pairs where the channel groups of 16 waste <= 1/4
    kg = q.kgroup
    hp, wp, phases, offs = dw_geometry(p)
    taps = p["KH"] * p["KW"]
    cgn = -(-p["C"] // kg)
    pls = _round_up(len(phases) * hp * wp, 16)
    flat = p["OH"] * wp
    mr, nr = _tile(q, p["M"], flat)
    flatp = _round_up(flat, nr)
    planes = _round_up((cgn - 1) * pls + max(pls, max(offs) + flatp), 16)
    zx_loop = p["ZX"] if p["zp_in_loop"] else 0
    off, flip = act_offset(q, p["TX"], zx_loop)
    mp = _round_up(p["M"], mr)
    wc = np.zeros((mp, cgn * kg, taps), np.int64)
    wc[:p["M"], :p["C"]] = w.reshape(p["M"], p["C"], taps)
    # k-group (channel group, tap): [MP/MR][CGN * taps][MR][KG]
    wc = wc.reshape(mp // mr, mr, cgn, kg, taps).transpose(0, 2, 4, 1, 3).reshape(mp // mr, cgn * taps, mr, kg)
    consts = {}
    wdat = wc.astype(np.int8) if q.flavour == "smull" else group_words(wc, q.flavour)
    wname = new_const(g, consts, k.args[1] + "_" + isa.replace("-", "_"), wdat.reshape(-1))
    bname, rname = _channel_consts(g, k, consts, q, isa, w, zx_loop, p["TX"], p["M"], mp)
    padv = 0
    if q.flavour == "dot":                  # four bytes of the zero point (as the kernel reads x)
        padv = int(np.array([((p["ZX"] % 256) ^ (0x80 if flip else 0)) * 0x01010101], np.uint32).view(np.int32)[0])
    unit = {"mlal": 2, "smull": 16}.get(q.flavour, 4)          # bytes per plane element
    # Cortex-A: where whole tiles make up an output row, the tiles are the output rows' (none of
    # the flattened planes' WP - OW columns per row that are not outputs), stored in place
    rows = get_isa(isa).q8.igemm and p["OW"] % nr == 0
    p.update(algo="qconv2d_igemm", q8_isa=isa, FLAVOUR=q.flavour, KG=kg, KGN=cgn * taps, CGN=cgn, PLS=pls, HP=hp,
             WP=wp, PHASES=phases, OFFS=offs, FLAT=flat, FLATP=flatp, PLANES=planes, MR=mr, NR=nr, MP=mp,
             XOFF=off, FLIP=flip, ZXL=zx_loop, PADV=padv, PADB=(p["ZX"] % 256) ^ (0x80 if flip else 0), ROWS=rows)
    scratch = unit * planes + (0 if rows else _round_up(p["M"] * flatp, 64))
    args = [k.args[0], wname, bname, rname, k.args[-1], scratch_arg(step)]
    desc = f"[qconv2d_igemm {isa}{_tag(q)} {mr}x{nr} {cgn} x {len(phases)} x {hp}x{wp} planes] {k.desc}"
    return Kernel("qconv2d_igemm", k.dtype, p, args, _round_up(scratch, 4), desc, consts=consts,
                  scratch_dtype="int32")


def dw_geometry(p: dict) -> tuple[int, int, list[dict], list[int]]:
    """(HP, WP, phases, tap offsets) of the depthwise kernel's padded planes: one plane per stride
    phase (py, px) a tap uses; tap (ky, kx) reads phase ((ky*DH) % SH, (kx*DW) % SW) at row
    (ky*DH) // SH, column (kx*DW) // SW of the flattened output index oy*WP + ox. Each phase
    lists the plane columns [lo, hi) that come from the image."""
    sh, sw, dh, dw = p["SH"], p["SW"], p["DH"], p["DW"]
    hp = p["OH"] + (p["KH"] - 1) * dh // sh
    wp = p["OW"] + (p["KW"] - 1) * dw // sw
    taps = [(ky * dh, kx * dw) for ky in range(p["KH"]) for kx in range(p["KW"])]
    phases = sorted({(ty % sh, tx % sw) for ty, tx in taps})
    offs = [phases.index((ty % sh, tx % sw)) * hp * wp + (ty // sh) * wp + tx // sw for ty, tx in taps]
    ph = []
    for py, px in phases:
        lo = min(max(0, -(-(p["PL"] - px) // sw)), wp)
        hi = max(min(wp, -(-(p["W"] + p["PL"] - px) // sw)), lo)
        ph.append({"py": py, "px": px, "lo": lo, "hi": hi})
    return hp, wp, ph, offs


def dw_runs(offs: list[int]) -> list[tuple[int, list[int]]]:
    """The depthwise taps (by their plane offsets) in runs for SDOT: sorted by offset, each run
    the taps whose offsets lie in [o, o + 4) of its first one, o; a run's word at output j holds
    the plane bytes j + o .. j + o + 3 (a 3x3 stride-1 window: one run per kernel row; small
    planes' runs may span rows)."""
    runs: list[tuple[int, list[int]]] = []
    for t in sorted(range(len(offs)), key=lambda t: offs[t]):
        if runs and offs[t] < runs[-1][0] + 4:
            runs[-1][1].append(t)
        else:
            runs.append((offs[t], [t]))
    return runs


def dw_rows(p: dict, flavour: str) -> bool:
    """Whether a depthwise layer takes the NEON byte kernels' row form: stride 1, windows at most
    4 wide, undilated, as wide as the image (PL + PR = KW - 1), so an output's flat index oy*OW + ox
    is its input's and no plane has gap columns: per window column kx a copy of the plane shifted
    by kx - PL with the input zero point where that leaves the row (masks built here), and the
    outputs stored straight into the output plane."""
    # SMULL pairs: the shifted copies cost more than the gap columns of rows 32 or wider (rpi4,
    # exact instructions: VWW's 48-wide layer 95.6 K flat, 100.8 K rows; 24 wide: 107.0 K, 104.3 K);
    # SDOT builds its words either way (48 wide: 74.4 K flat, 73.1 K rows)
    return (flavour in ("smull", "dot") and p["SH"] == p["SW"] == p["DH"] == p["DW"] == 1 and p["KW"] <= 4
            and p["OW"] == p["W"] and (flavour == "dot" or p["W"] < 32))


def _row_masks(p: dict, nword: int) -> np.ndarray:
    """[KW][nword] bytes: 0xff where position i of the row form's shifted plane kx (image row
    i // W - PT, column i % W) reads inside its row (column + kx - PL in [0, W)), else 0."""
    col = np.arange(nword) % p["W"]
    return np.stack([np.where((col + kx - p["PL"] >= 0) & (col + kx - p["PL"] < p["W"]), 255, 0)
                     for kx in range(p["KW"])]).astype(np.uint8)


def _ld2_chunks(p: dict, ph: dict) -> tuple[list[tuple[int, int, int]], int]:
    """Stride 2 (NEON): the phase row's columns [lo, hi) (input column 2 jj + px - PL) as LD2
    vectors (jj, n, k): n = 16 or 8 outputs from the row's bytes 2 jj - k .. 2 jj - k + 2n - 1, lane
    set k (0: even, 1: odd), every byte read inside the row; the last vector may overlap the one
    before (the same values written twice). Returns them and the column the bytes left to copy
    one by one start at."""
    c0, w = ph["px"] - p["PL"], p["W"]

    def fits(jj: int, n: int) -> int | None:
        for k in (0, 1):
            if jj >= ph["lo"] and 2 * jj + c0 - k >= 0 and 2 * jj + c0 - k + 2 * n - 1 <= w - 1:
                return k
        return None
    chunks, done = [], ph["lo"]
    while done < ph["hi"]:
        for n in (16, 8):
            jj = done if done + n <= ph["hi"] else ph["hi"] - n
            k = fits(jj, n)
            if k is not None:
                chunks.append((jj, n, k))
                done = jj + n
                break
        else:
            break
    return chunks, done


def dw_s2(p: dict) -> dict | None:
    """The geometry of the SDOT depthwise kernel's stride-2 form (stride 2, undilated, windows up to
    4 wide), or None. The image is copied into a plane Q framed by the input zero point (QW bytes a
    row, the image at column 16 of row PT); a word plane per row parity: plane P row i holds, at
    output column ox, the bytes of Q row 2 i + P at columns 2 ox - PL + 0..3 (two LD2 loads, one
    ST4, 16 words at a time: `CH` the first output columns of those vectors, the last overlapping
    or, for rows under 16, running into the next row, built after it). Output (oy, ox) and kernel
    row ky read word (oy + ky // 2) * OW + ox of plane ky % 2, so outputs have no gap columns."""
    # rows under 6 outputs: the 16-word vectors of every row cost more than SMULL pairs on the
    # phases (jetson-orin, VWW's 3-wide stride-2 layer: 32.9 K against 23.5 K; 6 wide: 31.1 K, 34.6 K)
    if not (p["SH"] == p["SW"] == 2 and p["DH"] == p["DW"] == 1 and p["KW"] <= 4 and p["OW"] >= 6):
        return None
    ow, oh = p["OW"], p["OH"]
    nr = oh + (p["KH"] - 1) // 2                                    # rows of a word plane
    rq = max(p["H"] + p["PT"], 2 * nr)                              # rows of Q
    qw = _round_up(max(16 + p["W"] + 16, 16 + 2 * max(ow, 16) + 4 + 16), 16)
    span = _round_up(oh * ow, 16)
    nwp = _round_up(max(nr * ow + 16, span + (p["KH"] - 1) // 2 * ow), 16)
    ch = list(range(0, ow - 15, 16)) + ([max(ow - 16, 0)] if ow % 16 or ow < 16 else [])
    return {"NR": nr, "RQ": rq, "QW": qw, "QLEN": rq * qw + 64, "NWP": nwp, "CH": ch}


def int16_exact(w) -> bool:
    """Whether sum(w_i x_i) over int8 weights (the last axis of w; every row of a [C][T] w) lies in
    int16 for every x_i in [-128, 127], so that int16 lanes may sum the products (wrapping on the
    way: the true sum is in range, so the wrapped one is it): at most 127 P + 128 N and at least
    -(128 P + 127 N), P and N the sums of the positive weights and of the negatives' magnitudes.
    The one home of this bound (the depthwise tap groups here, qconv2d_lanes' groups in q8lanes)."""
    w = np.asarray(w, np.int64)
    pos, neg = np.maximum(w, 0).sum(-1), np.maximum(-w, 0).sum(-1)
    return bool(np.all(127 * pos + 128 * neg <= 32767) and np.all(128 * pos + 127 * neg <= 32768))


def dw_groups(w: np.ndarray) -> list[list[int]]:
    """The SMULL-pair depthwise kernel's taps in groups whose int8 products it sums in int16: pairs
    (no weight is -128: |w x + w' x'| <= 2 * 127 * 128 < 2^15), and for an odd count the triple
    whose sum stays in int16 for every channel and every input (int16_exact; the least largest
    sum of |w|), else the last tap alone."""
    taps = w.shape[1]
    pairs = [list(range(t, min(t + 2, taps))) for t in range(0, taps, 2)]
    if taps % 2 == 0 or taps < 3:
        return pairs
    best = None
    for tri in itertools.combinations(range(taps), 3):
        if int16_exact(w[:, tri]):
            size = int(np.abs(w[:, tri]).sum(1).max())
            if best is None or size < best[0]:
                best = (size, list(tri))
    if best is None:
        return pairs
    rest = [t for t in range(taps) if t not in best[1]]
    return [best[1]] + [rest[i:i + 2] for i in range(0, len(rest), 2)]


def _int16_safe(w: np.ndarray) -> np.ndarray:
    """[2^T] bool: whether the taps of each subset (bit t: tap t) may sum their int8 products in
    int16 for every channel of w ([C][T] int8 weights, no -128) and every input byte (signed):
    int16_exact."""
    taps = w.shape[1]
    ok = np.zeros(1 << taps, bool)
    for m in range(1, 1 << taps):
        ok[m] = int16_exact(w[:, [t for t in range(taps) if m >> t & 1]])
    return ok


def dw_partition(w: np.ndarray) -> list[list[int]]:
    """The fewest groups of taps whose int8 products may be summed in int16 (_int16_safe) for every
    channel of w ([C][T], T <= 9): an exact search over the subsets (the least group count; among
    equals the first in the order of the subsets' bit masks, so the same weights give the same
    groups)."""
    taps = w.shape[1]
    ok = _int16_safe(w)
    full = (1 << taps) - 1
    best: dict[int, tuple[int, int]] = {0: (0, 0)}          # mask -> (groups, first group's mask)
    for m in range(1, full + 1):
        low = m & -m
        rest = m ^ low
        sub, choice = rest, None
        while True:                                          # every subset of rest, with low
            grp = sub | low
            if ok[grp]:
                cand = best[m ^ grp][0] + 1
                if choice is None or cand < choice[0]:
                    choice = (cand, grp)
            if sub == 0:
                break
            sub = (sub - 1) & rest
        best[m] = choice
    groups, m = [], full
    while m:
        grp = best[m][1]
        groups.append([t for t in range(taps) if grp >> t & 1])
        m ^= grp
    return groups


LANES_MAX_TAPS = 9      # the lanes form keeps a weight register per tap


def dw_lanes(p: dict, w: np.ndarray) -> dict | None:
    """The SMULL-pair depthwise kernel's lanes form (NEON, int8 weights without -128, windows of up
    to LANES_MAX_TAPS taps, up to 4 wide, undilated), or None: 16 channels in the lanes of a
    vector, each tap of an output pixel one SMULL / SMULL2 pair (SMLAL for the group's further taps) over the 16 channels'
    input bytes at the tap's pixel. A block of 16 channels is transposed from its planes into
    a channel-interleaved plane ([pixel][16] bytes, the image rows W pixels wide, PT rows of the
    input zero point above and the rows the windows read below), then every output pixel is
    computed in turn (taps left or right of the row take a register of the zero point), and the
    [pixel][16] outputs are transposed back into the 16 output planes. Each half of a block (its
    8 low channels, SMULL, and 8 high ones, SMULL2) has its own groups of taps summed in int16
    (dw_partition over its channels, or groups already used with as few; the last block's lanes
    past C have weight 0, a half without channels is not computed). Returns the plan: blocks,
    their groups (BGROUPS: distinct (low, high) partitions, BKIND: which each block takes), the
    column segments of the output rows (ox0, ox1, valid kx) and a row's steps (_lanes_row), the
    buffer's geometry."""
    taps = p["KH"] * p["KW"]
    if (taps > LANES_MAX_TAPS or p["KW"] > 4 or p["DH"] != 1 or p["DW"] != 1 or p["C"] != p["M"] or not w.size
            or int(w.min()) <= -128):
        return None
    c = p["C"]
    lw = 8 if c <= 8 else 16                  # lanes a block: 8 (one half) for up to 8 channels
    nb = -(-c // lw)
    kinds: list[tuple[list[list[int]], list[list[int]]]] = []
    bkind, used = [], []
    for b in range(nb):
        halves = []
        for h in (0, 1):                      # the block's 8 low and 8 high channels
            wh = w[lw * b + 8 * h:lw * b + 8 * h + 8] if 8 * h < lw else w[:0]
            if not len(wh):                   # no channel (the tail): nothing computed
                halves.append([])
                continue
            best, ok = dw_partition(wh), _int16_safe(wh)
            halves.append(next((gs for gs in used if len(gs) == len(best)
                                and all(ok[sum(1 << t for t in grp)] for grp in gs)), best))
            if halves[-1] is best:
                used.append(best)
        kind = (halves[0], halves[1])
        if kind not in kinds:
            kinds.append(kind)
        bkind.append(kinds.index(kind))
    segs: list[list] = []
    for ox in range(p["OW"]):
        valid = [kx for kx in range(p["KW"]) if 0 <= ox * p["SW"] + kx * p["DW"] - p["PL"] < p["W"]]
        if segs and segs[-1][2] == valid and segs[-1][1] == ox:
            segs[-1][1] = ox + 1
        else:
            segs.append([ox, ox + 1, valid])
    rsegs: list[list] = []                   # output rows alike: (oy0, oy1, window rows inside the image)
    for oy in range(p["OH"]):
        valid = [ky for ky in range(p["KH"]) if 0 <= oy * p["SH"] + ky - p["PT"] < p["H"]]
        if rsegs and rsegs[-1][2] == valid and rsegs[-1][1] == oy:
            rsegs[-1][1] = oy + 1
        else:
            rsegs.append([oy, oy + 1, valid])
    classes: list[list[int]] = []            # the taps outside the image of the edge pixels
    for rs in rsegs:
        cls = []
        for _, _, vkx in segs:
            out = [ky * p["KW"] + kx for ky in range(p["KH"]) for kx in range(p["KW"])
                   if ky not in rs[2] or kx not in vkx]
            if out and out not in classes:
                classes.append(out)
            cls.append(classes.index(out) if out else -1)
        rs.append(cls)
    hw, ohw = p["H"] * p["W"], p["OH"] * p["OW"]
    row, k0 = _lanes_row(p, segs, lw)
    return {"NB": nb, "LW": lw, "CT": c - lw * (nb - 1), "BKIND": bkind, "BGROUPS": kinds, "SEGS": segs,
            "RSEGS": rsegs, "CLASSES": classes, "HW": hw, "OHW": ohw,
            "NPIX": hw + 4,                  # (+ the stores of a last quad of pixels)
            "OBPIX": max(ohw, 16), "ROW": row, "K0": k0}


def _lanes_row(p: dict, segs: list, lw: int) -> tuple[list[dict], int]:
    """The lanes form's steps for one output row and where its row pointers start (K0: the first
    pixel's first tap inside the row): pixels ({"op": "px", "valid": window columns inside the
    row, "post": how the pointers step to the next pixel's first tap: "s" (16 SW bytes), the
    LD1's size, "" (not at all), "add": bytes added apart}), segments of more than 4 alike
    pixels as loops of two ({"op": "loop", "n": iterations, "body": two pixels}), pointer
    adjustments after a loop ({"op": "adj", "d": bytes})."""
    step = lw * p["SW"]

    def px(valid, delta):
        item = {"op": "px", "valid": valid, "post": "", "add": 0, "seg": i}
        if delta is None or delta == 0:
            pass
        elif delta == step and valid:
            item["post"] = "s"
        elif valid and delta == lw * len(valid):
            item["post"] = delta
        else:
            item["add"] = delta
        return item
    first = [v[0] if v else 0 for _, _, v in segs]
    row = []
    for i, (ox0, ox1, valid) in enumerate(segs):
        end = lw * (p["SW"] + first[i + 1] - first[i]) if i + 1 < len(segs) else None
        n = ox1 - ox0
        if n <= 4:
            row += [px(valid, step if j < n - 1 else end) for j in range(n)]
            continue
        row.append({"op": "loop", "n": n // 2, "body": [px(valid, step), px(valid, step)]})
        if n % 2:
            row.append(px(valid, end))
        elif end is not None and end != step:
            row.append({"op": "adj", "d": end - step})
    return row, first[0]


def _lanes_cheaper(p: dict, lanes: dict, groups: int) -> bool:
    """Whether the lanes form is estimated to take fewer instructions than the planes (rpi4's
    exact counts: per 16 outputs 3 T + 4 G + 24 on planes, plus about 150 a channel; in lanes,
    per pixel and block KH + 2 T + 2 (G_low + G_high) + 21 (edge pixels fewer), per block and 16
    pixels about 36 for each transpose, 100 a block; blocks of 8 channels KH + T + 2 G + 12 and
    20. KWS's 3x3 layers, 64 channels on 25x5: planes 45.5 K, lanes 29.8 K; VWW's 8 channels on
    48x48: planes 89.6 K, 16 lanes 101.2 K (half of them idle), 8 lanes 79.1 K)."""
    taps = p["KH"] * p["KW"]
    hp, wp, _, _ = dw_geometry(p)
    planes = p["C"] * (-(-p["OH"] * wp // 16) * (3 * taps + 4 * groups + 24) + 150)
    g = max(len(lo) + len(hi) for lo, hi in lanes["BGROUPS"])
    half = lanes["LW"] == 8                  # one half: SMULL only, 2 accumulators, half the transposes
    per_block = (lanes["OHW"] * (p["KH"] + (1 if half else 2) * taps + 2 * g + (12 if half else 21))
                 + (20 if half else 36) * (-(-lanes["HW"] // 16) + -(-lanes["OHW"] // 16)) + 100)
    return lanes["NB"] * per_block < planes


def _select_dw_lanes(g: ir.Graph, step: int, k: Kernel, isa: str, q: Q8, w: np.ndarray, ln: dict) -> Kernel:
    """The lanes form of the SMULL-pair depthwise kernel (dw_lanes): weights [NB][T][16] int8,
    bias and requantisation scale per channel, 16 to a block; scratch: the [pixel][16] outputs,
    256 bytes for the transposes, a copy of the last block's planes where a plane is shorter
    than a vector (its 16-byte loads would run past the input), the interleaved plane."""
    p = dict(k.params)
    taps, nb, lw = p["KH"] * p["KW"], ln["NB"], ln["LW"]
    zx_loop = p["ZX"] if p["zp_in_loop"] else 0
    wt = np.zeros((nb * lw, taps), np.int64)
    wt[:p["C"]] = w
    consts = {}
    wdat = wt.reshape(nb, lw, taps).transpose(0, 2, 1).astype(np.int8)
    wname = new_const(g, consts, k.args[1] + "_" + isa.replace("-", "_"), wdat.reshape(-1))
    _, rname = _channel_consts(g, k, consts, q, isa, w, zx_loop, p["TX"], p["C"], nb * lw)
    # bias per block: the interior pixels', then each edge class's, whose taps outside the image
    # are not computed: their products with the input zero point (as the kernel holds it) added
    bias = np.zeros(nb * lw, np.int64)
    bias[:p["C"]] = _channel_bias(g, k, q, w, zx_loop, p["TX"])
    zxv = p["ZX"] + act_offset(q, p["TX"], zx_loop)[0]
    tab = [bias] + [bias + zxv * wt[:, cl].sum(axis=1) for cl in ln["CLASSES"]]
    bdat = np.stack(tab).reshape(len(tab), nb, lw).transpose(1, 0, 2)            # [NB][1 + classes][LW]
    bname = new_const(g, consts, k.args[-1] + "_bias_" + isa.replace("-", "_"), wrap32(bdat.reshape(-1)))
    tb = ln["OBPIX"] * lw
    guard = _round_up(lw * ln["HW"] + 16, 16) if ln["HW"] < 16 else 0
    ln.update(TB=tb, GD=tb + 256, BUF=tb + 256 + guard)
    p.update(algo="qconv2d_dw", q8_isa=isa, FLAVOUR=q.flavour, DWL=ln, TAPS=taps, ZXL=zx_loop)
    scratch = ln["BUF"] + lw * ln["NPIX"]
    args = [k.args[0], wname, bname, rname, k.args[-1], scratch_arg(step)]
    kinds = len(ln["BGROUPS"])
    desc = (f"[qconv2d_dw {isa}{_tag(q)} lanes {nb} x {lw} channels, {kinds} tap grouping{'s' if kinds > 1 else ''}] "
            f"{k.desc}")
    return Kernel("qconv2d_dw", k.dtype, p, args, _round_up(scratch, 64), desc, consts=consts, scratch_dtype="int32")


def select_qconv_dw(g: ir.Graph, step: int, k: Kernel, target, isa: str) -> Kernel:
    p = dict(k.params)
    q = get_isa(isa).q8
    s2 = dw_s2(p) if q.flavour == "dot" else None
    if q.flavour == "dot" and p["SW"] > 1 and s2 is None:
        # strided: SDOT's words of every phase plane cost more than SMLAL / SMULL pairs on the
        # phases (jetson-orin, exact instructions: VWW's stride-2 layers 94.4 K against 75.7 K);
        # the next of the target's ISAs with an SMLAL depthwise kernel, if it has one
        later = [i for i in target.isas[target.isas.index(isa) + 1:] if get_isa(i).q8 is not None
                 and get_isa(i).q8.flavour == "mlal" and kreg.has_variant("qconv2d_dw", k.dtype, i)]
        if later:
            return select_qconv_dw(g, step, k, target, later[0])
    hp, wp, phases, offs = dw_geometry(p)
    taps = p["KH"] * p["KW"]
    # outputs per iteration: two vectors of int32 (x86), four (neon)
    lanes = 4 * q.lanes if q.flavour in ("mlal", "dot") else 2 * q.lanes
    zx_loop = p["ZX"] if p["zp_in_loop"] else 0
    w = _conv_weights(g, k)                                   # [C][taps]
    form = os.environ.get("TINYDEPLOY_DW_FORM", "")           # lanes | planes (tests, experiments)
    pq = _pairs(q, k, w) if q.flavour == "mlal" and form != "planes" else None
    ln = dw_lanes(p, w) if pq is not None else None
    if ln is not None and (form == "lanes" or ((p["C"] >= 16 or ln["LW"] == 8) and _lanes_cheaper(p, ln, len(dw_groups(w))))):
        return _select_dw_lanes(g, step, k, isa, pq, w, ln)
    if q.flavour == "mlal" and _round_up(p["OH"] * wp, lanes) > lanes:
        q = _pairs(q, k, w) or q    # int8 weights without -128: SMULL pairs on byte planes (but for one vector a channel)
    rows = dw_rows(p, q.flavour)
    if rows:                                  # no gap columns: the row form's planes are W wide
        hp, wp = p["OH"] + p["KH"] - 1, p["W"]
        offs = [ky * wp + kx for ky in range(p["KH"]) for kx in range(p["KW"])]
    flat = p["OH"] * wp
    span = _round_up(flat, lanes)
    planes = len(phases) * hp * wp
    plane_len = _round_up(max(planes, max(offs) + span), 16)
    runs, nword = [], 0
    if rows:                                  # plane positions of the shifted copies (or words)
        nword = _round_up((p["KH"] - 1) * wp + span, 16)
        plane_len = _round_up(16 + nword + 16, 16)
        if q.flavour == "smull":              # tap (ky, kx) reads shifted copy kx (kx = PL: the plane) at row ky
            offs = [(16 if kx == p["PL"] else plane_len + kx * nword) + ky * wp
                    for ky in range(p["KH"]) for kx in range(p["KW"])]
    if s2 is not None:                        # SDOT, stride 2: a run a kernel row, words of its row parity
        hp, wp, span = s2["NR"], p["OW"], _round_up(p["OH"] * p["OW"], lanes)
        flat, nword = p["OH"] * p["OW"], 2 * s2["NWP"]
        offs = [(ky % 2) * s2["NWP"] + (ky // 2) * wp + kx for ky in range(p["KH"]) for kx in range(p["KW"])]
        runs = [((ky % 2) * s2["NWP"] + (ky // 2) * wp, list(range(ky * p["KW"], (ky + 1) * p["KW"])))
                for ky in range(p["KH"])]
        plane_len = s2["QLEN"]
    elif q.flavour == "dot" and rows:         # SDOT: one run a kernel row, its word byte kx from copy kx
        runs = [(ky * wp, list(range(ky * p["KW"], (ky + 1) * p["KW"]))) for ky in range(p["KH"])]
    elif q.flavour == "dot":                  # SDOT: taps in runs of offsets [o, o + 4) (dw_runs)
        runs = dw_runs(offs)
        nword = _round_up(max(o for o, _ in runs) + span, 16)
        plane_len = _round_up(max(planes, nword + 16), 16)       # the words' bytes, read 16 at a time
    for ph in phases:                 # the plane rows [rlo, rhi) that come from the image
        ph["rlo"] = min(max(0, -(-(p["PT"] - ph["py"]) // p["SH"])), hp)
        ph["rhi"] = max(min(hp, -(-(p["H"] + p["PT"] - ph["py"]) // p["SH"])), ph["rlo"])
        ph["ld2"], ph["tail"] = _ld2_chunks(p, ph) if p["SW"] == 2 else ([], ph["lo"])
    consts = {}
    wtaps = taps
    masks = _row_masks(p, nword) if rows else np.zeros((0,), np.uint8)
    if q.flavour == "smull":                  # int8 taps, one row per channel (then the row form's masks)
        wtaps = _round_up(taps, 16)
        wt = np.zeros((p["C"], wtaps), np.int64)
        wt[:, :taps] = w
        wdat = np.concatenate([wt.astype(np.int8).reshape(-1), masks.reshape(-1).view(np.int8)])
    elif q.flavour == "dot":                  # one int32 word of 4 int8 tap weights per run
        wt = np.zeros((p["C"], len(runs), 4), np.int64)
        for r, (o, ts) in enumerate(runs):
            for t in ts:
                wt[:, r, offs[t] - o] = w[:, t]
        wdat = np.concatenate([group_words(wt, "dot").reshape(-1), masks.reshape(-1).view(np.int32)])
    elif q.flavour == "madd":                   # tap pairs as int16 words, the last paired with 0
        npair = -(-taps // 2)
        wt = np.zeros((p["C"], npair * 2), np.int64)
        wt[:, :taps] = w
        wdat = group_words(wt.reshape(p["C"], npair, 2), "madd")
    else:                                     # int16 taps, 8 per q register
        wt = np.zeros((p["C"], _round_up(taps, 8)), np.int64)
        wt[:, :taps] = w
        wdat = wt.astype(np.int16)
    wname = new_const(g, consts, k.args[1] + "_" + isa.replace("-", "_"), wdat.reshape(-1))
    bname, rname = _channel_consts(g, k, consts, q, isa, w, zx_loop, p["TX"], p["C"], p["C"])
    p.update(algo="qconv2d_dw", q8_isa=isa, FLAVOUR=q.flavour, HP=hp, WP=wp, PHASES=phases, OFFS=offs,
             TAPS=taps, LANES=lanes, FLAT=flat, SPAN=span, SPAN64=_round_up(span, 64), PLANE=plane_len, ZXL=zx_loop,
             WTAPS=wtaps, RUNS=[o for o, _ in runs], NWORD=nword, ROWS=rows, S2=s2,
             GROUPS=dw_groups(w) if q.flavour == "smull" else [])
    # int16 planes, then the output bytes of the flattened plane (neon: then the byte planes;
    # smull, dot: the output bytes, the byte planes, then the shifted copies or the words)
    if q.flavour == "smull":
        scratch = _round_up(span, 64) + plane_len + (p["KW"] * nword if rows else 0)
    elif q.flavour == "dot":
        scratch = _round_up(span, 64) + plane_len + 4 * nword
    else:
        scratch = 2 * plane_len + _round_up(span, 64) + (plane_len if q.flavour == "mlal" else 0)
    args = [k.args[0], wname, bname, rname, k.args[-1], scratch_arg(step)]
    rtag = " rows" if rows else (" s2 words" if s2 is not None else "")
    desc = f"[qconv2d_dw {isa}{_tag(q)}{rtag} {len(phases)} x {hp}x{wp} planes] {k.desc}"
    return Kernel("qconv2d_dw", k.dtype, p, args, _round_up(scratch, 4), desc, consts=consts, scratch_dtype="int32")


def select_qdense(g: ir.Graph, step: int, k: Kernel, target, isa: str) -> Kernel:
    p = dict(k.params)
    w = k.tensor(k.args[1], g).data.astype(np.int64)            # [N][K]
    q = _gemm_q8(get_isa(isa).q8, k, w)
    m, kk, n = p["M"], p["K"], p["N"]
    kg = q.kgroup
    kgn = -(-kk // kg)
    if q.flavour == "dot" and q.lanes == 4:
        kgn = _round_up(kgn, 4)               # Arm: the input's k-groups are read 4 to a register
    if q.flavour == "mlal":
        kgn = _round_up(kgn, 8)               # 8 int16 inputs to a register
    # whole vectors of columns (mlal: int16 weight registers of 8 columns)
    nrd = min(q.dense, _round_up(n, 8 if q.flavour == "mlal" else q.lanes))
    npad = _round_up(n, nrd)
    wk = np.zeros((npad, kgn * kg), np.int64)
    wk[:n, :kk] = w
    wk = wk.reshape(npad // nrd, nrd, kgn, kg).transpose(0, 2, 1, 3)         # [N/NRD][KGN][NRD][KG]
    consts = {}
    if q.flavour in ("dot", "smull"):
        wdat = wk.astype(np.int8)
    else:                                      # kept in the weight type, widened as loaded
        wdat = wk.astype(np.dtype({"int8_t": np.int8, "uint8_t": np.uint8, "int16_t": np.int16}[p["TW"]]))
    wname = new_const(g, consts, k.args[1] + "_" + isa.replace("-", "_"), wdat.reshape(-1))
    bname, rname = _channel_consts(g, k, consts, q, isa, w, 0, p["TX"], n, npad)
    off, flip = act_offset(q, p["TX"], 0)
    p.update(algo="qdense_packed", q8_isa=isa, FLAVOUR=q.flavour, KG=kg, KGN=kgn, NRD=nrd, NP=npad,
             XOFF=off, FLIP=flip)
    scratch = kgn * _group_bytes(q)
    args = [k.args[0], wname, bname, rname, k.args[-1], scratch_arg(step)]
    desc = f"[qdense_packed {isa}{_tag(q)} {nrd} columns] {k.desc}"
    return Kernel("qdense_packed", k.dtype, p, args, _round_up(scratch, 64), desc, consts=consts,
                  scratch_dtype="int32")


def select_qadd(k: Kernel, target) -> Kernel:
    """A same-shape QAdd on an ISA whose QAdd runs in int32 lanes (Q8.qadd_int32: NEON, x86) gets the
    constants that reproduce the reference on every input pair (params["I32"]; None: none exist,
    the kernel keeps its 64-bit form). Searched here, where the ISA is known, because the search
    tries all 2^16 input pairs."""
    p = k.params
    isas = list(target.isas)
    isa = next((i for i in isas if kreg.has_variant("qadd", k.dtype, i)), None)
    # the chosen ISA's 8-bit descriptor, or where it has none (avx512: its 8-bit kernels are
    # avx512bw's) that of the ISA after it in the target's list, which it builds on (avx2)
    q = next((get_isa(i).q8 for i in isas[isas.index(isa):] if get_isa(i).q8 is not None), None) if isa else None
    if q is None or not q.qadd_int32 or len(p["dims"]) != 1 or p["sa"] != [1] or p["sb"] != [1]:
        return k
    types = (p[t][:-2] for t in ("TA", "TB", "TY"))          # "int8_t" -> "int8"
    i32 = qadd_int32(*types, p["ZA"], p["ZB"], p["ZY"], p["MA"], p["MB"], p["S"], p["LO"], p["HI"])
    # I32X: the same constants as one int32 expression (x86, qadd_simd.c.j2)
    k.params = dict(p, I32=i32, I32X=qadd_int32_folded(i32) if i32 is not None else None)
    return k


def select_q8(g: ir.Graph, step: int, k: Kernel, target, force: str) -> Kernel:
    """The 8-bit kernel of one QConv / QDense layer (the reference when no ISA variant applies or
    TINYDEPLOY_ALGO=ref)."""
    p = k.params
    fam = None
    if k.family == "qconv2d":
        depthwise = p["G"] == p["C"] == p["M"] > 1 and p["KH"] * p["KW"] <= DW_MAX_TAPS
        fam = "qconv2d_dw" if depthwise else "qconv2d_gemm"
        if fam == "qconv2d_gemm":
            isa = q8_isa("qconv2d_igemm", k, target) if force != "ref" else None
            if isa is not None and igemm_preferred(get_isa(isa).q8, p, force):
                fam = "qconv2d_igemm"
    elif k.family == "qdense":
        fam = "qdense_packed"
    isa = q8_isa(fam, k, target) if fam and force != "ref" else None
    if isa is None:
        k.params = dict(p, algo="ref")
        k.desc = f"[ref direct] {k.desc}"
        return k
    select = {"qconv2d_gemm": select_qconv_gemm, "qconv2d_igemm": select_qconv_igemm, "qconv2d_dw": select_qconv_dw,
              "qdense_packed": select_qdense}[fam]
    return select(g, step, k, target, isa)
