"""8-bit 3x3 stride-1 convolutions as an exact integer Winograd F(2x2, 3x3) (qconv2d_winograd,
template firmware_templates/kernels/qconv2d_winograd.c.j2), where the ISA's 8-bit descriptor asks
for it (targets/isa.py Q8.winograd: Cortex-A72's SMLAL by lane, AVX2's vpmaddwd on pairs of input
channels) and the layer's weights prove it exact. schedule/__init__.py select_kernels asks
`select_q8wino` before schedule/q8.py's select_q8; the planner sizes its blocks (`fit`).

Why it is exact. With G' = 2G (integer entries: [[2,0,0],[1,1,1],[1,-1,1],[0,0,2]]), B^T and A^T of
Lavin and Gray's F(2x2, 3x3):
  U = G' g G'^T         per output and input channel, at build time: |U| <= 9 max|g| (int16)
  V = B^T d B           per 4x4 input tile, d = x - zx (padded taps 0): |V| <= 4 * 255 (int16)
  M = sum over c of U (.) V      int32 (SMLAL by lane: int16 x int16 widened, wrapping adds)
  Y = A^T M A = 4 * S   S = the reference's sum of (x - zx) w over the 3x3 window, no bias
The kernel also adds 4 b (b: the bias, with the zero point's fold undone: the kernel always
subtracts zx) to M11, which enters each of the four outputs once, so Y = 4 (S + b), 4 times the
reference's int32 accumulator. Every step is +, -, x in the ring of int32, so the wrapped Y equals
that modulo 2^32, and it is that value when |S + b| < 2^29: proven here per layer from the weights
(sum |w| over a channel's taps times the largest |x - zx|, plus |b|, below 2^29) or the algorithm
is refused. Then f32(Y) / 4 = f32(S + b) exactly (rounding commutes
with powers of 2: one SCVTF with 2 fraction bits), and the requantisation is the reference's
float32 one (docs/quantization.md), so the outputs equal the reference kernel's bit for bit.

Layout (per image): tile rows are taken RB at a time (a block: its transformed input, 16 x CP x TV
int16, about the size of L1); the block's rows of the input, minus zx, go to zero-padded int16
planes (C x PR x WP), their transform to V [16][CP][TV] (tiles of the block flattened, row after
row, in the vector lanes; [16][TB/8][CP][8] where a tile row is whole vectors), then per 8 output channels and 8 tiles the 16 GEMMs [8][CP] x [CP][8]
(U packed at build time [MP/8][16][CP][8]) into a small int32 buffer, the output transform, bias
and requantisation on it, bytes into two staging rows per tile row, copied to the output. x86
(madd): two input channels side by side in each 32-bit lane from the planes on (each plane row
split into its even and odd columns, so that a tile's 4 columns are plain loads), V [16][CP/2][TV]
words, U [MP/4][16][CP/2][4] words, 4 output channels x 16 tiles per GEMM tile; the requantisation
multiplies f32(4 acc) by R / 4, which gives f32(f32(acc) * R) exactly.
"""
from __future__ import annotations

import re

import numpy as np

from tinydeploy.codegen import kernels as kreg
from tinydeploy.ops import Kernel
from tinydeploy.ops.registry import new_const, scratch_arg
from tinydeploy.schedule.cost import _round_up
from tinydeploy.schedule.q8 import _conv_weights, group_words, q8_isa, requant_scales, wrap32
from tinydeploy.targets.isa import get_isa

G2 = np.array([[2, 0, 0], [1, 1, 1], [1, -1, 1], [0, 0, 2]], np.int64)       # G' = 2 G
BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.int64)
AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.int64)
MR, NR = 8, 8               # GEMM register tile: 8 output channels x 8 tiles (16 int32x4)
X86_MR, X86_NR = 4, 16      # x86 (madd): 4 output channels x 16 tiles (8 ymm of int32)
CSTEP = 4                   # input channels per k step (the packed U of 4 channels: one load)
ACC_BOUND = 2 ** 29         # |S| below it: 4 S fits int32, S = (4 S) >> 2


def _xmax(p: dict) -> int:
    lo, hi = (-128, 127) if p["TX"] == "int8_t" else (0, 255)
    return max(abs(lo - p["ZX"]), abs(hi - p["ZX"]))


def fits(p: dict) -> bool:
    """The layer's geometry: one group, 3x3, stride 1, no dilation."""
    return (p["G"] == 1 and p["KH"] == p["KW"] == 3 and p["SH"] == p["SW"] == 1
            and p["DH"] == p["DW"] == 1)


def kernel_bias(p: dict, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The bias the kernel adds (int64): the kernel multiplies x - zx everywhere, the reference's
    bias b' has zx folded in where no padding is read (zp_in_loop false): that fold undone."""
    zx_loop = p["ZX"] if p["zp_in_loop"] else 0
    return np.asarray(b, np.int64) + (p["ZX"] - zx_loop) * np.asarray(w, np.int64).reshape(p["M"], -1).sum(axis=1)


def exact_for(p: dict, w: np.ndarray, bias: np.ndarray) -> bool:
    """Whether the weights prove the algorithm exact (see the module docstring): |U| fits int16
    and, per output channel, sum |w| * max |x - zx| + |bias| < 2^29 (bias: kernel_bias; the
    kernel adds 4 bias to M11, which enters all four outputs once, so Y = 4 (S + bias))."""
    w = np.asarray(w, np.int64).reshape(p["M"], -1)
    if 9 * int(np.abs(w).max(initial=0)) >= 2 ** 15:
        return False
    bound = np.abs(w).sum(axis=1) * _xmax(p) + np.abs(np.asarray(bias, np.int64))
    return bool((bound < ACC_BOUND).all())


def select_q8wino(g, step: int, k: Kernel, target, force: str) -> Kernel | None:
    """The qconv2d_winograd kernel of a QConv layer where `preferred` says so (on the ISA its
    implicit GEMM would use), else None (schedule/q8.py select_q8 chooses)."""
    if k.family != "qconv2d" or force == "ref":
        return None
    isa = q8_isa("qconv2d_igemm", k, target)
    if isa is None:
        return None
    w = _conv_weights(g, k)
    if not preferred(k.params, w, k.tensor(k.args[2], g).data, isa, k.dtype, force):
        return None
    return select(g, step, k, target, isa, w, requant_scales(k.tensor(k.args[3], g).data,
                                                              k.tensor(k.args[4], g).data))


def preferred(p: dict, w: np.ndarray, bias: np.ndarray, isa: str, dtype: str, force: str) -> bool:
    """Whether a QConv layer takes qconv2d_winograd on `isa` (the ISA its implicit GEMM would use):
    forced (TINYDEPLOY_ALGO=qconv2d_winograd), else where the ISA's descriptor prefers it
    (Q8.winograd, by exact instruction counts) and the input has more than one channel; always
    only where the geometry fits and the weights prove it exact. TINYDEPLOY_ALGO=qconv2d_gemm or
    qconv2d_igemm keeps those kernels."""
    q = get_isa(isa).q8
    if force in ("qconv2d_gemm", "qconv2d_igemm") or q is None or not kreg.has_variant(
            "qconv2d_winograd", dtype, isa):
        return False
    if not (force == "qconv2d_winograd" or (q.winograd and p["C"] > 1)):
        return False
    return fits(p) and exact_for(p, w, kernel_bias(p, w, bias))


def transform_weights(w: np.ndarray, m: int, c: int) -> np.ndarray:
    """U = G' g G'^T for every (output, input) channel: [16][M][C] int64 (xi = 4 i + j)."""
    g = np.asarray(w, np.int64).reshape(m, c, 3, 3)
    u = np.einsum("ik,mckl,jl->ijmc", G2, g, G2)
    return u.reshape(16, m, c)


def geometry(p: dict, budget: int, rb: int | None = None) -> dict:
    """Tile grid and block of the layer: TROWS x TCOLS tiles of 2x2 outputs; RB tile rows a block
    (given, or as many as keep the block's transformed input, 16 x CP x TV int16, within `budget`
    bytes, at least one)."""
    trows, tcols = -(-p["OH"] // 2), -(-p["OW"] // 2)
    x86 = p["X86"]
    cp = _round_up(p["C"], 2 if x86 else CSTEP)
    nr = X86_NR if x86 else NR

    def tv(rb):            # a V row: the block's tiles in whole NR panels, plus a vector's overrun
        return _round_up(max(_round_up(rb * tcols, nr), rb * tcols + 8), 8)
    if rb is None:
        rb = trows
        while rb > 1 and 2 * 16 * cp * tv(rb) > budget:
            rb -= 1
    # PANEL: tile rows of whole vectors (VEC tiles: 8, or 4 where a row has 4 modulo 8), so V can be
    # kept [16][TB/8][CP][8] (a GEMM step's 4 rows of 8 tiles in one load) rather than [16][CP][TV]
    # x86 (madd): channel pairs in the int16 lanes (planes, V [16][CP/2][TV][2]), even and odd plane
    # columns apart (WH pairs a row each; a row's last vector reads on into the next row, for
    # tiles that are not outputs), 4 output channels x 16 tiles a GEMM tile
    return {"TROWS": trows, "TCOLS": tcols, "RB": rb, "CP": cp, "TB": _round_up(rb * tcols, nr), "TV": tv(rb),
            "PR": 2 * rb + 2, "WP": 2 * tcols + 2, "MP": _round_up(p["M"], X86_MR if x86 else MR),
            "PANEL": tcols % 4 == 0 and not x86, "VEC": 4 if tcols % 8 == 4 and not x86 else 8,
            "WH": tcols + 1, "X86": x86}


def scratch_layout(gm: dict, c: int) -> dict:
    """Byte offsets in the scratch: int16 planes (C x PR x WP, then a margin for the last vector's
    overrun), V [16][CP][TV] or [16][TB/8][CP][8] int16, the int32 GEMM buffer [MR][2][16][4], the staging bytes
    [MP][2][2 TB]."""
    if gm["X86"]:                                 # channel pairs, E and O rows
        planes = _round_up(4 * (gm["CP"] * gm["PR"] * gm["WH"] + 16), 64)    # a vector's overrun past the end
    else:
        planes = _round_up(2 * (c * gm["PR"] * gm["WP"] + 32), 64)
    v = _round_up(2 * 16 * gm["CP"] * (gm["TB"] if gm["PANEL"] else gm["TV"]), 64)
    buf = 4 * MR * NR * 16
    stage = _round_up(gm["MP"] * 4 * gm["TB"], 64)
    return {"OFF_V": planes, "OFF_BUF": planes + v, "OFF_S": planes + v + buf, "BYTES": planes + v + buf + stage}


def select(g, step: int, k: Kernel, target, isa: str, w: np.ndarray, r: np.ndarray) -> Kernel:
    """The qconv2d_winograd kernel of one QConv layer (preferred() said so); w: the weights as
    [M][C*9], r: the float32 requantisation ratio per output channel."""
    p = dict(k.params, X86=get_isa(isa).q8.flavour == "madd")
    m, c = p["M"], p["C"]
    # blocks of tile rows: at least those whose V fits L1 (the floor fit() starts from), at most
    # those whose V fits a quarter of L2, as the room under the arena's peak allows (fit)
    lo, hi = int(target.l1d_bytes or 32768), int(target.l2_bytes or 524288) // 4
    gm = geometry(p, lo)
    mp, cp = gm["MP"], gm["CP"]
    u = np.zeros((16, mp, cp), np.int64)
    u[:, :m, :c] = transform_weights(w, m, c)
    if p["X86"]:        # [MP/4][16][CP/2][4] int32 words of (U[2c], U[2c + 1])
        u = group_words(u.reshape(16, mp // X86_MR, X86_MR, cp // 2, 2).transpose(1, 0, 3, 2, 4), "madd")
    else:
        u = u.reshape(16, mp // MR, MR, cp).transpose(1, 0, 3, 2).astype(np.int16)    # [MP/8][16][CP][8]
    bk = np.zeros(mp, np.int64)
    bk[:m] = 4 * kernel_bias(p, w, k.tensor(k.args[2], g).data)      # added to M11: Y = 4 (S + bias)
    rk = np.zeros(mp, np.float32)
    rk[:m] = r / np.float32(4) if p["X86"] else r    # x86: f32(f32(4 acc) * R / 4) = f32(f32(acc) * R)
    consts = {}
    base = k.args[1] + "_wino_" + isa.replace("-", "_")
    wname = new_const(g, consts, base, u.reshape(-1))
    bname = new_const(g, consts, base + "_bias", wrap32(bk))
    rname = new_const(g, consts, base + "_requant_scale", rk)
    rb_max = rb_quarter = geometry(p, hi)["RB"]
    if p["X86"]:        # V within half of L2 (fit chooses among the block sizes: padded_tiles)
        rb_max = geometry(p, 2 * hi)["RB"]
    if p["X86"]:        # at least two GEMM panels of 16 tiles a block (else the last panel is mostly waste)
        rb_min = min(gm["TROWS"], max(gm["RB"], -(-2 * X86_NR // gm["TCOLS"])))
        gm, rb_max = geometry(p, 0, rb_min), max(rb_max, rb_min)
    lay = scratch_layout(gm, c)
    p.update(gm, **lay, algo="qconv2d_winograd", q8_isa=isa, RB_MIN=gm["RB"], RB_MAX=rb_max, RB_Q=rb_quarter)
    args = [k.args[0], wname, bname, rname, k.args[-1], scratch_arg(step)]
    desc = (f"[qconv2d_winograd {isa} F(2x2,3x3) {gm['TROWS']}x{gm['TCOLS']} tiles, {gm['RB']} tile rows a "
            f"block] {k.desc}")
    return Kernel("qconv2d_winograd", k.dtype, p, args, lay["BYTES"], desc, consts=consts, scratch_dtype="int32")


def padded_tiles(p: dict, rb: int) -> int:
    """The GEMM columns the layer's blocks of rb tile rows take on x86: each block's tiles in
    whole panels of X86_NR. Measured on an AVX2 host (ResNet-50 uint8, bench --layers): the 56x56
    layers (28 tiles a row) 1,420 us in blocks of 2 rows (56 tiles in 64 columns) against 1,213 in
    blocks of 4 (112 in 112); the 7x7 layers (4 a row) 2,081 us in blocks of 2 against 1,209 in
    one of 4. Where the counts tie, blocks whose V is over a quarter of L2 ran faster the smaller
    they were: the 28x28 layers (14 a row) 1,050 us in blocks of 1 or 2 rows, 1,190 in 3, 1,111
    in 4; the 14x14 layers (7 a row, 256 channels) 1,165-1,206 in blocks of 2, 1,201-1,300 in 5
    (3: 80 columns, 1,600); under it the larger ones (IC's 32x32 layers of 16 channels, 16 tiles a
    row: 43-45 us in blocks of 10, 50-52 in blocks of 1)."""
    trows, tcols = -(-p["OH"] // 2), -(-p["OW"] // 2)
    full, last = divmod(trows, rb)
    return full * _round_up(rb * tcols, X86_NR) + _round_up(last * tcols, X86_NR)


def fit(k: Kernel, room: int) -> bool:
    """Size the scratch to at most `room` bytes (the planner's fit): the most tile rows a block,
    from RB_MIN (V within L1; fit(k, 0) leaves it there, which sets the peak) up to RB_MAX (V
    within a quarter of L2; x86: half, and of the fitting ones the fewest padded_tiles),
    whose scratch fits. Fewer blocks convert fewer overlapping input
    rows (each block reads 2 rows more than its outputs need). Where the hole under the peak is
    smaller than RB_MIN needs (the activations around it leave it fragmented), the block is cut
    below it to fill the hole (down to one tile row) rather than raise the arena, as
    q8.fit_gemm does. The results do not change."""
    p = k.params
    rb = p["RB_MIN"]
    if room:
        fitting = [r for r in range(1, p["RB_MAX"] + 1)
                   if scratch_layout(geometry(p, 0, r), p["C"])["BYTES"] <= room]
        rb = max(fitting, default=1)
        if p["X86"] and fitting:    # the fewest tiles in padded GEMM panels, then (padded_tiles)
            q = p["RB_Q"]           # the most rows with V within a quarter of L2, else the fewest
            rb = min(fitting, key=lambda r: (padded_tiles(p, r), r > q, -r if r <= q else r))
    gm = geometry(p, 0, rb)
    lay = scratch_layout(gm, p["C"])
    k.params = dict(p, **gm, **lay)
    k.scratch_bytes = lay["BYTES"]
    k.desc = re.sub(r", \d+ tile rows a block", f", {rb} tile rows a block", k.desc, count=1)
    return True
