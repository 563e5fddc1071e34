"""8-bit convolutions whose K (input channels x taps) is short, with the output pixels in the vector
lanes (qconv2d_lanes, template firmware_templates/kernels/qconv2d_lanes.c.j2): Cortex-A72's NEON
(the ISA's 8-bit descriptor multiplies by SMLAL by lane, Q8 flavour "mlal"; not where the target's
8-bit ISA is another, e.g. SDOT on jetson-orin). schedule/__init__.py select_kernels asks
`select_q8lanes` after the Winograd and before schedule/q8.py's select_q8.

Where K is short, the GEMMs' costs per output dominate (int16 activation panels packed per block,
int32 tiles reduced and requantised per tile, edges), so this kernel turns the GEMM around: a
block of NPX output pixels of the K rows of B (the input planes themselves for a 1x1 stride-1
unpadded layer, NCHW; else im2col rows built once per image from zero-point-padded planes, one
per stride phase) is loaded once and widened to int16 in registers; then per pair of output
channels their weights (int16, packed at build time) sit in registers and the taps multiply by
lane into int32x4 accumulators that start at the bias (LD2R / LD4R of the bias packed per pair);
the requantisation is the reference's float32 one in the same registers (SCVTF, FMUL by R,
FCVTNS: round to nearest even, as rne; saturating narrows, the zero point, the clamp), and the
bytes are stored in place in the output row. A last block of a row count that NPX does not divide
overlaps the one before (the same values written twice). Two forms:
  grouped  int8 weights all in [-127, 127] (`grouped`), K <= GK_MAX = 64: 16 pixels where K <= 8,
           else 8, in passes of 16 taps (`chunks`; the int32 sums of a pass wait in scratch for
           the next). Per channel its taps in int16 groups (`tap_groups`): MUL / MLA by lane on
           8 pixels a register (8 multiply-adds an instruction), SADDW / SADDW2 into the
           accumulators once a group; taps left alone by SMLAL / SMLAL2. The output channels are
           unrolled (each has its own groups), up to GROUP_MAX taps in all.
  SMLAL    otherwise (weights with a -128, uint8 or int16 w - zw): every tap SMLAL / SMLAL2 by
           lane, a rolled loop over pairs of channels; 16 pixels where K <= 8, 8 where K <= 16,
           4 up to K_MAX = 40 (two taps a register, the pair requantised together).

Exact: the kernel multiplies the raw activations x (int8, or uint8 as 0..255), padded taps holding
the input zero point, and the bias absorbs the rest: b_k = b' - zx_loop * sum(w) over every tap
(int32 arithmetic wraps; the true accumulator fits, quant.fit_int32 proved it, so the wrapped sum
is the reference's, as for the dot product's offsets in q8.py). Products of int16 x int16 widened
into int32 never saturate. A group's products are summed in int16 lanes, which wrap: exact
because the build proves, per group, that the true sum lies in int16 for every activation
(q8.int16_exact: x in [-128, 127], so uint8 activations are moved by -128 (x ^ 0x80) in the grouped
form and the bias takes 128 sum(w)); the wrapped int16 sum is then the true one, and SADDW widens
it exactly.

Where (`preferred`), fitted to exact instruction counts under qemu-aarch64 -cpu cortex-a72 (rpi4)
against what runs otherwise:
  grouped, wherever it fits (every layer measured gains): VWW's layer 1 (3x3 stride 2, 3 channels,
    K 27, 2 passes) 210,002 -> 167,464 (igemm before), layer 3 (K 8) 187,346 -> 110,756, layer 5
    (K 16) 127,013 -> 82,384, layer 7 (K 32) 194,983 -> 135,739, layer 9 (K 32, 144 pixels)
    95,801 -> 67,970, layer 11 (K 64, 4 passes) 155,462 -> 114,697; KWS's layer 1 (K 40, 3
    passes) 139,232 -> 76,904, its pointwise layers (K 64) 140,579 -> 108,933-111,093; IC's 1x1
    stride-2 layers (K 16, 32) 57,416 -> 39,140 and 44,035 -> 31,889 (the im2col GEMM before).
    Not past GROUP_MAX (VWW's 128 x 64 layer 13 measured 77,202 -> 55,052, but with about 70 KB
    of unrolled code).
  SMLAL, the 1x1 direct form where K <= 16 and the im2col form of one-channel layers (VWW's layer 3
    133,802, layer 5 108,958, KWS's layer 1 112,453 on it: all gains), not elsewhere (forced:
    VWW's layer 1 239,451 against 210,002, layer 7 204,380 against 194,983, layer 9 99,431
    against 95,801).
Only in single-thread builds (schedule/__init__.py: it is not spread over threads).
TINYDEPLOY_ALGO=qconv2d_lanes forces it wherever it fits; naming another family keeps that one.
"""
from __future__ import annotations

import numpy as np

from tinydeploy.ops import Kernel
from tinydeploy.ops.registry import new_const, scratch_arg
from tinydeploy.schedule.cost import _round_up
from tinydeploy.schedule.q8 import _conv_weights, dw_geometry, int16_exact, q8_isa, requant_scales, wrap32
from tinydeploy.targets.isa import get_isa

K_MAX = 40                  # SMLAL form: the taps in registers, K * NPX / 8 int16 vectors (NPX 4: 20)
GK_MAX = 64                 # grouped form: 4 passes of 16 taps
# tap groups: the output channels unrolled, up to M * K taps (about 35 KB of code a layer at most,
# within Cortex-A72's 48 KB instruction cache; VWW's 128 x 64 layer 13 would take twice that)
GROUP_MAX = 4096


def tap_groups(w: np.ndarray, base: int = 0) -> list[list[list[int]]] | None:
    """Per output channel (rows of w, [MP][K] integer weights), its nonzero taps (numbered from
    `base`) in groups for the 8- and 16-pixel blocks: a group of 3 or more taps whose products sum
    within int16 for every signed activation (int16_exact) is multiplied by MUL / MLA by lane on 8
    pixels a register (8 multiply-adds an instruction, wrapping: the true sum is in range, so the
    wrapped one is it) and widened once into the accumulators (SADDW, SADDW2): per 8 pixels g + 2
    instructions for g taps against SMLAL's 2 g; other taps alone (SMLAL). First fit, largest |w|
    first. None where a weight is outside [-127, 127] (uint8, w - zw, or -128)."""
    w = np.asarray(w, np.int64)
    if not w.size or w.min() < -127 or w.max() > 127:
        return None
    out = []
    for row in w:
        bins: list[list[int]] = []
        for t in sorted(np.flatnonzero(row), key=lambda t: (-abs(int(row[t])), t)):
            for b in bins:
                if int16_exact(row[b + [t]]):
                    b.append(int(t))
                    break
            else:
                bins.append([int(t)])
        many = [sorted(b) for b in bins if len(b) >= 3]
        alone = [[t] for b in bins if len(b) < 3 for t in b]
        out.append([[base + t for t in gr] for gr in sorted(many + alone)])
    return out


def chunks(kk: int, grouped: bool) -> list[tuple[int, int]]:
    """(first tap, taps) of the passes over K: one, or where K > 16 on the grouped 8-pixel form
    passes of 16 taps (16 int16 registers; the int32 sums wait in scratch between them)."""
    if not grouped or kk <= 16:
        return [(0, kk)]
    return [(c, min(16, kk - c)) for c in range(0, kk, 16)]


def npx(kk: int, grouped: bool = False) -> int:
    """Output pixels a block: the K rows' int16 vectors of a block fill at most 16 registers
    (20 for K = 40 with 4 pixels); the grouped form takes 8 pixels over passes of 16 taps."""
    return 16 if kk <= 8 else 8 if kk <= 16 or grouped else 4


def direct(p: dict) -> bool:
    """A 1x1 stride-1 unpadded layer: the rows of B are the input planes."""
    return (p["KH"] == p["KW"] == p["SH"] == p["SW"] == 1 and p["PT"] == p["PL"] == 0
            and (p["OH"], p["OW"]) == (p["H"], p["W"]))


def fits(p: dict, grouped_form: bool = False) -> bool:
    """One group, K <= K_MAX (the grouped form, in passes: GK_MAX), at least one block of pixels."""
    kk = p["C"] * p["KH"] * p["KW"]
    return p["G"] == 1 and kk <= (GK_MAX if grouped_form else K_MAX) and p["OH"] * p["OW"] >= npx(kk, grouped_form)


def grouped(p: dict, w: np.ndarray) -> bool:
    """Whether the layer takes the grouped 8- and 16-pixel form: int8 weights all in [-127, 127]
    (tap_groups), the output channels unrolled within GROUP_MAX taps, a block of 8 pixels."""
    return (p["TW"] == "int8_t" and w.size > 0 and int(np.abs(w).max()) <= 127
            and _round_up(p["M"], 2) * w.shape[1] <= GROUP_MAX and p["OH"] * p["OW"] >= npx(w.shape[1], True))


def preferred(p: dict, force: str, grouped_form: bool = False) -> bool:
    """Whether a layer that fits takes qconv2d_lanes (module docstring: where, and why)."""
    if force == "qconv2d_lanes":
        return True
    if force != "auto":
        return False
    kk = p["C"] * p["KH"] * p["KW"]
    return grouped_form or (direct(p) and kk <= 16) or (p["C"] == 1 and not direct(p))


def select_q8lanes(g, step: int, k: Kernel, target, force: str) -> Kernel | None:
    """The qconv2d_lanes kernel of a QConv layer where `preferred` says so on an ISA with a
    variant whose descriptor multiplies by lane (mlal), else None (select_q8 chooses)."""
    if k.family != "qconv2d" or force == "ref":
        return None
    # the target's 8-bit ISA (its first whose descriptor multiplies the weights) must be the one
    # with the variant: a target with the dot product (jetson-orin) keeps its SDOT kernels
    isa = q8_isa("qconv2d_lanes", k, target)
    if isa is None or isa != q8_isa("qconv2d_gemm", k, target) or get_isa(isa).q8.flavour != "mlal":
        return None
    p = dict(k.params)
    if p["G"] != 1:
        return None
    w = _conv_weights(g, k)                                    # [M][K]
    form = grouped(p, w)
    if not fits(p, form) or not preferred(p, force, form):
        return None
    return select(g, step, k, isa, w)


def im2col_rows(p: dict, offs: list[int], pls: int, wpl: int) -> tuple[list[dict], list[int]]:
    """The im2col form's rows: tap (c, ky, kx) reads its channel's plane of stride phase
    ((ky DH) % SH, (kx DW) % SW) at row (ky DH) // SH and column (kx DW) // SW of an output
    (offs: dw_geometry's offsets), so taps of one channel, phase and column share a row of the
    planes' bytes per output row from row 0 on: tap k's im2col row is that one from output row
    (ky DH) // SH on. Returns the shared rows (src: the planes' offset, rows: output rows
    copied, off and len: its place among the rows, whole vectors and 16 bytes for 8-byte copies)
    and each tap's row offset."""
    taps, ow = p["KH"] * p["KW"], p["OW"]
    keys: dict[int, int] = {}
    need: list[int] = []
    tap_row = []
    for k in range(p["C"] * taps):
        c, t = divmod(k, taps)
        ry = (t // p["KW"]) * p["DH"] // p["SH"]
        src = c * pls + offs[t] - ry * wpl
        e = keys.setdefault(src, len(keys))
        if e == len(need):
            need.append(0)
        need[e] = max(need[e], p["OH"] + ry)
        tap_row.append((e, ry))
    ext, off = [], 0
    for src, e in keys.items():
        length = _round_up(need[e] * ow, 16) + 16
        ext.append({"src": src, "rows": need[e], "off": off, "len": length})
        off += length
    return ext, [ext[e]["off"] + ry * ow for e, ry in tap_row]


def select(g, step: int, k: Kernel, isa: str, w: np.ndarray) -> Kernel:
    """The qconv2d_lanes kernel of a layer select_q8lanes chose; w its weights [M][K]."""
    p = dict(k.params)
    m, kk = p["M"], w.shape[1]
    mp = _round_up(m, 2)                # two output channels a step: a last odd one with a zero one
    wpad = np.zeros((mp, kk), np.int64)
    wpad[:m] = w
    form = grouped(p, w)
    n_px = npx(kk, form)
    chs = chunks(kk, form)
    groups = [tap_groups(wpad[:, c0:c0 + kc], c0) for c0, kc in chs] if form else []
    if groups and len(chs) == 1 and not any(len(gr) >= 3 for row in groups[0] for gr in row):
        groups = []                     # no group anywhere: the SMLAL loop over the channels
    zx_loop = p["ZX"] if p["zp_in_loop"] else 0
    # groups' int16 sums need signed activations: uint8 ones move by -128 (x ^ 0x80), the bias
    # takes 128 sum(w)
    xflip = bool(groups) and p["TX"] == "uint8_t"
    bias = np.zeros(mp, np.int64)
    bias[:m] = k.tensor(k.args[2], g).data.astype(np.int64) - (zx_loop - (128 if xflip else 0)) * w.sum(axis=1)
    r = np.zeros(mp, np.float32)
    r[:m] = requant_scales(k.tensor(k.args[3], g).data, k.tensor(k.args[4], g).data)
    consts = {}
    base = k.args[1] + "_lanes_" + isa.replace("-", "_")
    # int16 weights per pass over K: [pass][MP][its taps rounded up to 8]
    wk = np.concatenate([np.pad(wpad[:, c0:c0 + kc], ((0, 0), (0, _round_up(kc, 8) - kc))).reshape(-1)
                         for c0, kc in chs])
    wname = new_const(g, consts, base, wk.astype(np.int16))
    # per pair of output channels, the words the kernel's step loads: the bias (b_m, b_m+1)
    # repeated for each of a channel's int32x4 accumulators (its LD2R / LD4R sets them all), then
    # the two float32 scales R (their bits); with passes, the scales apart (the last pass's)
    bias = np.tile(wrap32(bias).reshape(-1, 1, 2), (1, n_px // 4, 1)).reshape(mp // 2, -1)
    rname = None
    if len(chs) == 1:
        words = np.concatenate([bias, r.view(np.int32).reshape(-1, 2)], axis=1)
        bname = new_const(g, consts, base + "_bias_scale", words.reshape(-1))
    else:
        bname = new_const(g, consts, base + "_bias", bias.reshape(-1))
        rname = new_const(g, consts, base + "_requant_scale", r)
    cols = p["OH"] * p["OW"]
    dr = direct(p)
    off = 0
    rowoff = [c * cols for c in range(kk)]
    if not dr:                  # padded planes (one per stride phase), then the im2col rows
        hp, wpl, phases, offs = dw_geometry(p)
        pls = len(phases) * hp * wpl
        ext, rowoff = im2col_rows(p, offs, pls, wpl)
        p.update(PHP=hp, PWP=wpl, PPH=phases, PPLS=pls, EXT=ext, OFF_ROWS=_round_up(p["C"] * pls + 16, 64))
        off = p["OFF_ROWS"] + _round_up(ext[-1]["off"] + ext[-1]["len"], 64)
    scratch = off + (mp * n_px * 4 if len(chs) > 1 else 0)  # the int32 sums between passes
    p.update(algo="qconv2d_lanes", q8_isa=isa, K=kk, KP=_round_up(kk, 8), NPX=n_px, P=cols, DIRECT=dr,
             PADB=p["ZX"] % 256, GROUPS=groups, XFLIP=xflip, CHUNKS=chs, OFF_ACC=off, ROWOFF=rowoff)
    args = [k.args[0], wname, bname] + ([rname] if rname else []) + [k.args[-1]] + (
        [scratch_arg(step)] if scratch else [])
    how = "direct" if dr else "im2col planes"
    passes = f" in {len(chs)} passes" if len(chs) > 1 else ""
    desc = f"[qconv2d_lanes {isa} {n_px} pixels K {kk}{passes}{' groups' if groups else ''} {how}] {k.desc}"
    return Kernel("qconv2d_lanes", k.dtype, p, args, _round_up(scratch, 4), desc, consts=consts,
                  scratch_dtype="int32")
