"""Kernel selection for Cortex-M cores: weights re-laid at build time for the register-blocked
GEMM kernels of the DSP extension (8-bit) and of the FPU (fp32), each with arena scratch for the
tile of activations it gathers.

8-bit (ISA cortex-m4-dsp): SMLAD multiplies int16 pairs, two multiply-accumulates per
instruction; the activations are widened to int16 pairs once per tile (convolutions, into arena
scratch) or in registers (fully connected layers). Three layouts of the weights:
  "i16"     int16 pairs, two bytes per weight: read straight into SMLAD (11 instructions per 16
            MACs in the 4 channels x 2 pixels block of a convolution).
  "i8pair"  one byte per weight. A 32-bit word holds output channels n, n+1 at reduction steps
            k, k' as the halfwords h = w[n] + 256 w[n+1] (the high byte is w[n+1] minus w[n]'s
            borrow). SMLAD on the word as it is adds Y[n] + 256 Y[n+1]; SXTB16 gives w[n] exactly
            for a second SMLAD (Y[n]); Y[n+1] = (E - F) / 256. 12 instructions per 16 MACs: the
            SXTB16 is shared by the pixels of the block. Needs |Y[n+1]| < 2^23 for the worst-case
            input (the bias is added afterwards) and h within int16 (no w[n+1] = -128 beside a
            negative w[n]); int8 weights only.
  "i8"      one byte per weight, the same word without the borrow: SXTB16 / UXTB16 and their
            ROR #8 forms widen both channels (15 instructions per 16 MACs); every int8 or uint8
            layer.
int16 weights (a weight zero point was subtracted at build time) take "i16", which costs no
extra flash. `optimize` chooses (tinydeploy build --optimize):
  size      one byte per weight everywhere ("i8pair" where it applies, else "i8");
  balanced  (default) as size, then the layers that save the most instructions per extra byte
            of flash get "i16", while each saves at least BALANCED_RATE instructions per
            inference per byte and the extra stays within BALANCED_SHARE of the weights;
  speed     "i16" everywhere within EXTRA_FLASH_BYTES (the layers that gain most per byte
            first; the rest as size).

fp32 (ISA cortex-m4-fpu): convolutions with one group as a GEMM over pixel tiles, 4 channels x
2 pixels of accumulators in FPU registers (conv2d_f32_cortex-m4-fpu.c.j2); the weights only
change order ([M/4 blocks][K][4 channels]), so flash stays the same.

Layouts of a layer's packed weights, int32 words:
  i16 (pack_pairs):   [M/4 blocks of 4 channels (the last: M % 4)][KP pairs][channels in block]
  i8* (pack_bytes):   [blocks of RP row pairs (the last: fewer)][KP pairs][row pairs in block],
                      an odd channel count padded with a zero channel.
Convolutions pair channels (2c, 2c+1) at each tap (an odd channel count pairs the last with 0),
or, with 1 or 3 input channels (where that zero would be a third or half of all multiplies),
consecutive rows of the flattened reduction r = c*KH*KW + tap ("flat"). Fully connected layers
pair consecutive inputs (k = 2i, 2i+1) for i16 (the input row widened into scratch), and
(4g, 4g+2), (4g+1, 4g+3) for the one-byte layouts, the order in which SXTB16 widens a word of
four inputs in registers. Every kernel's accumulators are the reference kernel's int32 sums
(modulo 2^32), so the results stay bit-exact with it (tests/test_cortex_m_kernels.py).

The requantisation scale r = m * 2^-s of each output channel (exact in float32) is stored as a
float32 array of the kernel's own instead of the multiplier and shift arrays. When all channels
share it: two values (even and odd channels) in that array, so that layers of the same shape
share their code, except under `speed`, which writes them into the code as literals.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinydeploy import ir
from tinydeploy.codegen import kernels as kreg
from tinydeploy.codegen.cfmt import c_float
from tinydeploy.errors import TinydeployError
from tinydeploy.ops import Kernel
from tinydeploy.ops.registry import new_const, scratch_arg

# The target names the ISAs of these kernels by their role (targets/isa.py): "dsp8" for the 8-bit
# SMLAD kernels, "fpu32" for the fp32 FPU ones.
DSP_ROLE, FPU_ROLE = "dsp8", "fpu32"
OPTIMIZE = ("balanced", "speed", "size")
# Words of arena scratch (planned like any tensor, for the one step) for the kernel's tile of
# activations widened to int16 pairs: up to 64 pixels, and at most 6 KiB unless two pixels need
# more. (On the stack it would have to fit the smallest Cortex-M4 stack, 8 KiB on nano33ble,
# and it pushes the inner loop's spilled loop bound beyond the reach of an SP-relative load.)
SCRATCH_WORDS = 1536
TILE_PIXELS = 64
# With the arena planned (fit_scratch), a tile takes whatever room there is under the peak at its
# step, up to this many pixels.
TILE_MAX = 64
TILE_MIN = 16     # below this the per-tile work of a block (scales, bias, pointers) starts to show
# Depthwise planes copied into scratch framed by their padding up to this size (bytes).
DW_PLANE_BYTES = 4096
# --optimize speed: the int16 layout takes two bytes where one-byte ones take one; at most this
# much more flash is spent on it, the layers that gain most per byte first.
EXTRA_FLASH_BYTES = 384 * 1024
# --optimize balanced: int16 weights where they save at least this many instructions per
# inference per extra byte of flash, for at most this share of the one-byte weights.
BALANCED_RATE = 1.0
BALANCED_SHARE = 1 / 8
FP32_MIN_MACS = 1024      # smaller fp32 convolutions keep the reference (measured: a 2x2 output loses)
# Instructions per MAC of the inner loops (unrolled by 4 for convolutions, by 2 for fully
# connected layers), per output of the epilogue beyond the requantisation, counted in the
# assembly of td_runtime.h; the estimates that rank the layouts.
_CONV_MAC = {"i16": 47 / 64, "i8pair": 51 / 64, "i8": 63 / 64}
_CONV_OUT = {"i16": 0.0, "i8pair": 1.0, "i8": 0.0}
_DENSE_MAC = {"i16": 15 / 16, "i8pair": 48 / 48, "i8": 44 / 32}
DENSE_ROW_PAIRS = {"i8pair": 3, "i8": 2}     # row pairs per block of the one-byte dense loops
BOUND_I8PAIR = 1 << 23


def check_optimize(optimize: str) -> str:
    if optimize not in OPTIMIZE:
        raise TinydeployError(f"--optimize must be one of {', '.join(OPTIMIZE)}, not {optimize!r}")
    return optimize


def tile_pixels(p: dict, words_per_pixel: int) -> int:
    """Output pixels per tile of a layer's scratch: even, at least 2, within SCRATCH_WORDS (unless
    two pixels need more), at most TILE_PIXELS and the layer's pixels (rounded up)."""
    pixels = p["OH"] * p["OW"]
    return min(TILE_PIXELS, max(2, SCRATCH_WORDS // words_per_pixel // 2 * 2), (pixels + 1) // 2 * 2)


def _flat(p: dict) -> bool:
    return p["C"] in (1, 3)


def _pairs(p: dict) -> int:
    kk = p["KH"] * p["KW"]
    return (p["C"] * kk + 1) // 2 if _flat(p) else (p["C"] + 1) // 2 * kk


def _packable(k: Kernel) -> bool:
    p = k.params
    # 8-bit activations; weights int8, uint8, or int16 when the build subtracted a weight zero
    # point (|w - zw| <= 255): every value an int16 half of a pair holds
    if p.get("TX") not in ("int8_t", "uint8_t") or p.get("TW") not in ("int8_t", "uint8_t", "int16_t"):
        return False
    if k.family == "qconv2d":
        return p["form"] in ("pixel", "row") and p["G"] == 1
    return k.family == "qdense" and p["K"] >= 2


def pack_pairs(rows: np.ndarray) -> np.ndarray:
    """[R][K] weights, K in pair order (columns 2k and 2k+1 form pair k; an odd K gets a zero
    column) -> int32 words [R/4 blocks (the last: R % 4 rows)][K/2 pairs][rows of the block]."""
    r, k = rows.shape
    wf = np.zeros((r, k + k % 2), np.int32)
    wf[:, :k] = rows
    return blocks_of(((wf[:, 0::2] & 0xFFFF) | (wf[:, 1::2] << 16)).astype(np.uint32).view(np.int32), 4)


def blocks_of(rows: np.ndarray, n: int = 4) -> np.ndarray:
    """[R][K] -> [R/n blocks (the last: R % n rows)][K][rows of the block], flat: the order the
    kernels' register blocks read (all rows' values of one reduction step together)."""
    return np.ascontiguousarray(np.concatenate([rows[b:b + n].T.reshape(-1) for b in range(0, rows.shape[0], n)]))


def blocks_of_4(rows: np.ndarray) -> np.ndarray:
    return blocks_of(rows, 4)


def pack_bytes(rows: np.ndarray, borrow: bool, row_pairs: int) -> np.ndarray:
    """[R][K] int8/uint8 weights, K in pair order -> int32 words, one byte per weight:
    [blocks of `row_pairs` row pairs (the last: fewer)][K/2 pairs][row pairs of the block]; word
    (n, n+1; k, k') holds bytes (w[n][k], w[n+1][k], w[n][k'], w[n+1][k']), R and K padded with
    zeros to even. `borrow` ("i8pair"): each halfword is w[n] + 256 w[n+1] as an int16 (the high
    byte w[n+1] minus w[n]'s borrow; pair_bytes_ok says when that fits)."""
    r, k = rows.shape
    w = np.zeros((r + r % 2, k + k % 2), np.int64)
    w[:r, :k] = rows
    lo, hi = w[0::2], w[1::2]                       # [R/2][K]: channel n, channel n+1
    half = (lo + 256 * hi) if borrow else ((lo & 0xFF) | ((hi & 0xFF) << 8))
    half &= 0xFFFF
    words = (half[:, 0::2] | (half[:, 1::2] << 16)).astype(np.uint32).view(np.int32)   # [R/2][K/2]
    return blocks_of(words, row_pairs)


def pair_bytes_ok(rows: np.ndarray, xmax: int) -> bool:
    """Whether layout "i8pair" holds the rows exactly: every halfword w[n] + 256 w[n+1] within
    int16, and |Y[n+1]| = |sum x w[n+1]| < 2^23 for every input (|x| <= xmax) so that
    256 Y[n+1] = E - F stays within int32."""
    w = rows.astype(np.int64)
    if w.shape[0] % 2:
        w = np.concatenate([w, np.zeros((1, w.shape[1]), np.int64)])
    half = w[0::2] + 256 * w[1::2]
    if half.min(initial=0) < -32768 or half.max(initial=0) > 32767:
        return False
    return int(xmax * np.abs(w[1::2]).sum(axis=1).max(initial=0)) < BOUND_I8PAIR


def _pair_bias(g: ir.Graph, k: Kernel, rows: np.ndarray, xmax: int) -> dict | None:
    """Layout "i8pair" with the bias of channel n+1 inside E: E starts at b[n] + 256 b[n+1] (its
    own bias array: (b[n], b[n] + 256 b[n+1]) per row pair) and channel n+1 requantises E - F =
    256 acc directly with r / 256 (exact: a power of two), which saves the division and the
    addition of the bias. Applies when |acc| < 2^23 with the bias too; else None."""
    b = k.tensor(k.args[2], g).data.astype(np.int64)
    w = np.abs(rows.astype(np.int64))
    odd = np.arange(1, b.size, 2)
    if odd.size and int((np.abs(b[odd]) + xmax * w[odd].sum(axis=1)).max()) >= BOUND_I8PAIR:
        return None
    bp = b.copy()
    bp[odd] = b[odd - 1] + 256 * b[odd]
    bp = ((bp + 2**31) % 2**32 - 2**31).astype(np.int32)
    return {"bias": new_const(g, k.consts, k.args[2] + "_pairs", bp)}


def _conv_rows(g: ir.Graph, k: Kernel) -> np.ndarray:
    """A convolution's weights as [M][K] in its pair order: flat (c, ky, kx), or channel pairs
    (c pair, tap, channel of the pair) with a zero channel when C is odd."""
    p = k.params
    w = k.tensor(k.args[1], g).data.astype(np.int32)
    if p["form"] == "pixel":       # lowering re-laid them [C][KH][KW][M]
        w = w.reshape(p["C"], p["KH"], p["KW"], p["M"]).transpose(3, 0, 1, 2)
    m, c, kk = p["M"], p["C"], p["KH"] * p["KW"]
    w = w.reshape(m, c, kk)
    if _flat(p):
        return w.reshape(m, c * kk)
    wc = np.zeros((m, c + c % 2, kk), np.int32)
    wc[:, :c, :] = w
    return wc.reshape(m, -1, 2, kk).transpose(0, 1, 3, 2).reshape(m, -1)


def _dense_rows_bytes(w: np.ndarray) -> np.ndarray:
    """[N][K] -> [N][K4] with K padded to a multiple of 4 and the columns of each group of 4 in
    the order SXTB16 widens a word of inputs: pairs (4g, 4g+2), (4g+1, 4g+3)."""
    n, k = w.shape
    k4 = (k + 3) // 4 * 4
    wf = np.zeros((n, k4), np.int64)
    wf[:, :k] = w
    perm = np.arange(k4).reshape(-1, 2, 2).transpose(0, 2, 1).reshape(-1)
    return wf[:, perm]


def _xmax(k: Kernel, g: ir.Graph) -> int:
    """The largest |x - zx| the kernel's sums can see."""
    info = np.iinfo(np.dtype(np.int8) if k.params["TX"] == "int8_t" else np.dtype(np.uint8))
    zx = k.params["ZX"] if k.family == "qconv2d" and k.params.get("zp_in_loop") else 0
    return max(abs(int(info.min) - zx), abs(int(info.max) - zx))


@dataclass
class _Layer:
    step: int
    k: Kernel
    rows: np.ndarray         # [M][K] in i16 pair order
    macs: int
    outputs: int
    options: dict            # layout -> (packed words, flash bytes)

    def cost(self, layout: str) -> float:
        if self.k.family == "qconv2d":
            return self.macs * _CONV_MAC[layout] + self.outputs * _CONV_OUT[layout]
        return self.macs * _DENSE_MAC[layout]


def _candidates(g: ir.Graph, step: int, k: Kernel) -> _Layer:
    p = k.params
    if k.family == "qconv2d":
        rows = _conv_rows(g, k)
        macs = rows.size * p["OH"] * p["OW"] * p["N"]
        outputs, rp, brows = p["M"] * p["OH"] * p["OW"] * p["N"], 2, rows
    else:
        rows = k.tensor(k.args[1], g).data.astype(np.int32)
        macs, outputs = rows.size * p["M"], p["N"] * p["M"]
        brows = _dense_rows_bytes(rows)
    options = {}
    wide = pack_pairs(rows if k.family == "qconv2d" else brows)
    options["i16"] = (wide, wide.nbytes)
    if p["TW"] != "int16_t":
        if p["TW"] == "int8_t" and pair_bytes_ok(brows, _xmax(k, g)):
            rp = 2 if k.family == "qconv2d" else DENSE_ROW_PAIRS["i8pair"]
            b = pack_bytes(brows, True, rp)
            options["i8pair"] = (b, b.nbytes)
        rp = 2 if k.family == "qconv2d" else DENSE_ROW_PAIRS["i8"]
        b = pack_bytes(brows, False, rp)
        options["i8"] = (b, b.nbytes)
    return _Layer(step, k, rows, macs, outputs, options)


def choose_layouts(layers: list[_Layer], optimize: str, weights_bytes: int) -> dict[int, str]:
    """Each layer's layout (see the module text): step -> "i16" | "i8pair" | "i8"."""
    choice = {}
    for L in layers:
        small = [lay for lay in ("i8pair", "i8") if lay in L.options]
        choice[L.step] = small[0] if small else "i16"
    if optimize == "size":
        return choice
    budget = EXTRA_FLASH_BYTES if optimize == "speed" else int(weights_bytes * BALANCED_SHARE)
    ups = []
    for L in layers:
        cur = choice[L.step]
        if cur == "i16":
            continue
        extra = L.options["i16"][1] - L.options[cur][1]
        saved = L.cost(cur) - L.cost("i16")
        if saved <= 0:
            continue
        rate = saved / max(extra, 1)
        if optimize == "balanced" and rate < BALANCED_RATE:
            continue
        ups.append((-rate, L.step, extra))
    spent = 0
    for _, step, extra in sorted(ups):
        if spent + extra <= budget:
            spent += extra
            choice[step] = "i16"
    return choice


def _requant_scales(g: ir.Graph, k: Kernel, mi: int, odd_over_256: bool, literal: bool) -> tuple[list[str], dict]:
    """The kernel's requantisation scales r = m * 2^-s (exact float32) in place of its multiplier
    and shift arguments (args[mi], args[mi + 1]): one array of its own, one per channel. When
    every channel has the same: literals in the code (RS; RS_ODD for the odd channels) if
    `literal`, else the two values in a two-element array (RS "rs[0]", RS_ODD "rs[1]", RS_ARG),
    so that layers of the same shape render the same source and share one function (the code
    of a layer is some 600 bytes; AD's eight 128x128 layers differ only in their scales).
    odd_over_256: the odd channels' scales divided by 256 (exact), for "i8pair" with the bias in E."""
    m = k.tensor(k.args[mi], g).data.astype(np.float32)
    s = k.tensor(k.args[mi + 1], g).data.astype(np.int32)
    r = (m * np.ldexp(np.float32(1), -s).astype(np.float32)).astype(np.float32)
    if r.size and np.all(r == r[0]):
        odd = r[0] / np.float32(256) if odd_over_256 else r[0]
        if literal:
            return [], {"RS": c_float(r[0]), "RS_ODD": c_float(odd), "RS_ARG": False}
        pair = np.array([r[0], odd], dtype=np.float32)
        return [new_const(g, k.consts, k.args[mi] + "_rscale", pair)], {"RS": "rs[0]", "RS_ODD": "rs[1]", "RS_ARG": True}
    if odd_over_256:
        r[1::2] = r[1::2] / np.float32(256)
    return [new_const(g, k.consts, k.args[mi] + "_rscale", r)], {"RS": None, "RS_ODD": None, "RS_ARG": True}


def _attach(g: ir.Graph, step: int, k: Kernel, packed: np.ndarray, scratch_words: int, desc: str, **params) -> None:
    """Give kernel k its packed weights (its own constant, replacing args[1]), arena scratch (the
    planner's "#scratch<step>", passed last; none when scratch_words is 0) and parameters."""
    name = new_const(g, k.consts, k.args[1] + "_packed", packed)
    k.scratch_bytes = 4 * scratch_words
    k.scratch_dtype = np.dtype(packed.dtype).name
    k.args = [k.args[0], name] + list(k.args[2:]) + ([scratch_arg(step)] if scratch_words else [])
    k.params = dict(k.params, PACKED=True, STEP=step, **params)
    k.desc = f"[{desc}] {k.desc}"


def _uses(k: Kernel, target, isa: str | None) -> bool:
    return isa is not None and kreg.resolve(k.family, k.dtype, list(target.isas))[1] == isa


_LAYOUT_TEXT = {"i16": "weights packed in int16 pairs", "i8pair": "weights at one byte each, channel pairs",
                "i8": "weights at one byte each"}


def _select_8bit(g: ir.Graph, kernels: list[Kernel | None], target, optimize: str) -> None:
    """Pack the weights of the 8-bit convolutions and fully connected layers the DSP kernels
    compute, in the layout `optimize` chooses for each (see the module text)."""
    isa = target.isa_with_role(DSP_ROLE)
    layers = [_candidates(g, step, k) for step, k in enumerate(kernels)
              if k is not None and _packable(k) and _uses(k, target, isa)]
    one_byte = sum(L.rows.size for L in layers)
    choice = choose_layouts(layers, optimize, one_byte)
    for L in layers:
        k, step, lay = L.k, L.step, choice[L.step]
        packed, flash = L.options[lay]
        extra = flash - min(f for _, f in L.options.values())
        k.params = dict(k.params, WL=lay, U8W=k.params["TW"] == "uint8_t", FLASH_EXTRA=extra)
        pb = _pair_bias(g, k, L.rows, _xmax(k, g)) if lay == "i8pair" else None
        # multiplier and shift -> requantisation scales
        rs_args, rs_params = _requant_scales(g, k, 3, pb is not None, literal=optimize == "speed")
        k.args = k.args[:2] + [pb["bias"] if pb else k.args[2]] + rs_args + k.args[5:]
        rs_params["EB"] = pb is not None
        text = f"{isa} {_LAYOUT_TEXT[lay]}"
        if k.family == "qconv2d":
            pairs, flat = _pairs(k.params), _flat(k.params)
            tile = tile_pixels(k.params, pairs)
            _attach(g, step, k, packed, tile * pairs, text + (" (flat)" if flat else ""),
                    FLAT=flat, KP=pairs, T_=tile, **rs_params)
            _gemm_in_place(k)
        elif lay == "i16":
            kg = (k.params["K"] + 3) // 4
            _attach(g, step, k, packed, 2 * kg, text, KP=2 * kg, KG=kg, XS=True, **rs_params)
        else:
            _attach(g, step, k, packed, 0, text + ", inputs widened in registers",
                    KG=(k.params["K"] + 3) // 4, RP=DENSE_ROW_PAIRS[lay], **rs_params)


def flash_choices(kernels: list[Kernel | None]) -> dict:
    """What the 8-bit weight layouts cost (for `build`): layers per layout and the extra flash
    of the int16 ones."""
    out = {"layers": {}, "extra_bytes": 0}
    for k in kernels:
        if k is not None and "WL" in k.params:
            out["layers"][k.params["WL"]] = out["layers"].get(k.params["WL"], 0) + 1
            out["extra_bytes"] += int(k.params.get("FLASH_EXTRA", 0))
    return out


def _gemm_in_place(k: Kernel) -> None:
    """A DSP GEMM convolution may write its output over its input (Kernel.alias) when its output
    planes lie on its input planes (stride 1, same plane, one image): output channel m on input
    channel m - max(0, M - C), the first M - C planes before the input. The tile's input is
    gathered into scratch before its outputs are written. An output pixel p may
    land on input pixel p once no later tile reads it, DB = PT W + PL pixels behind the gathered
    ones: with DB > 0 the kernel keeps one tile of outputs back in scratch (T >= DB), which costs
    a copy, so the planner only takes it where the arena shrinks."""
    p = k.params
    if p["SH"] == p["SW"] == 1 and p["OH"] == p["H"] and p["OW"] == p["W"] and p["N"] == 1:
        # output plane m on input plane m - (M - C): with more output channels than input ones
        # the output starts (M - C) planes before the input
        k.alias = min(0, p["C"] - p["M"]) * p["H"] * p["W"]
        p["DB"] = p["PT"] * p["W"] + p["PL"]
        k.alias_free = p["DB"] == 0


def _select_dw(g: ir.Graph, step: int, k: Kernel, target, optimize: str) -> None:
    """DSP depthwise convolutions of 3-wide windows (_qconv_dw_dsp.j2): each channel's plane is
    copied into arena scratch framed by its padding (HP x WP bytes) when that is at most
    DW_PLANE_BYTES; the output then may overwrite the input (a plane is read whole before its
    output is written, and output plane c ends where input plane c does or before)."""
    p = k.params
    if not (p.get("form") == "dw" and p["TX"] in ("int8_t", "uint8_t") and p["TW"] in ("int8_t", "int16_t")
            and p["KW"] == 3 and p["DW"] == 1 and p["SW"] <= 2 and _uses(k, target, target.isa_with_role(DSP_ROLE))):
        return
    hp = max(p["H"] + p["PT"], (p["OH"] - 1) * p["SH"] + (p["KH"] - 1) * p["DH"] + 1)
    wp = max(p["W"] + p["PL"], (p["OW"] - 1) * p["SW"] + 3)
    wp += 1 if p["SW"] == 1 and p["OW"] % 2 else 0
    if hp * wp + 4 <= DW_PLANE_BYTES:
        # the bias takes the input zero point's share over the whole window, whose padding the
        # buffer holds as zx: b' = b - zx_loop * sum(w) (exact; the kernel then widens x as it is)
        zs = p["ZX"] if p["zp_in_loop"] else 0
        w = k.tensor(k.args[1], g).data.astype(np.int64).reshape(p["C"], -1)
        b = k.tensor(k.args[2], g).data.astype(np.int64) - zs * w.sum(axis=1)
        if np.abs(b).max(initial=0) >= 2**31:
            return
        bias = new_const(g, k.consts, k.args[2] + "_window", b.astype(np.int32))
        rs_args, rs_params = _requant_scales(g, k, 3, False, literal=optimize == "speed")
        p.update(HP=hp, WP=wp, **rs_params)
        k.scratch_bytes = hp * wp + 4
        k.scratch_dtype = "uint8" if p["TX"] == "uint8_t" else "int8"
        k.args = list(k.args[:2]) + [bias] + rs_args + list(k.args[5:]) + [scratch_arg(step)]
        k.alias = 0


def fit_scratch(k: Kernel, room: int, tile_min: int = 0) -> bool:
    """Size a kernel's scratch to at most `room` bytes where it can (module text): the tile of a
    GEMM kernel, the largest even number of pixels up to TILE_MAX (and the layer's pixels) that
    fits, at least `tile_min` (default TILE_MIN; and the held-back outputs' distance DB when it
    writes over its input); fit_scratch(k, 0) leaves each at its smallest."""
    p = k.params
    if k.family == "qdense" and p.get("WL") == "i16":
        # the widened input row in scratch where it fits, else widened in registers
        xs = room >= 4 * p["KP"]
        k.params = dict(p, XS=xs)
        k.scratch_bytes = 4 * p["KP"] if xs else 0
        k.args = [a for a in k.args if not a.startswith("#scratch")]
        if xs:
            k.args.append(scratch_arg(p["STEP"]))
        return True
    if not p.get("PACKED") or "T_" not in p:
        return False
    per_pixel = 4 * (p["KP"] if k.family == "qconv2d" else p["C"] * p["KH"] * p["KW"])
    stage = p["M"] if k.family == "qconv2d" and p.get("INPLACE") and p.get("DB") else 0
    pixels = (p["OH"] * p["OW"] + 1) // 2 * 2
    low = max(min(tile_min or TILE_MIN, pixels), (p.get("DB", 0) + 1) // 2 * 2 if stage else 2)
    t = max(low, min(TILE_MAX, pixels, room // (per_pixel + stage) // 2 * 2))
    k.params = dict(p, T_=t)
    k.scratch_bytes = t * (per_pixel + stage)
    return True


def _select_fp32(g: ir.Graph, kernels: list[Kernel | None], target) -> None:
    """fp32 convolutions with one group: weights in 4-channel blocks for the FPU GEMM kernel."""
    isa = target.isa_with_role(FPU_ROLE)
    for step, k in enumerate(kernels):
        if k is None or k.family != "conv2d" or k.dtype != "f32" or k.params["G"] != 1 or not _uses(k, target, isa):
            continue
        p = k.params
        kdim = p["C"] * p["KH"] * p["KW"]
        if p["N"] * p["M"] * p["OH"] * p["OW"] * kdim < FP32_MIN_MACS:
            continue        # gathering the columns would cost more than it saves
        w = k.tensor(k.args[1], g).data.astype(np.float32).reshape(p["M"], kdim)
        tile = tile_pixels(p, kdim)
        _attach(g, step, k, blocks_of_4(w), tile * kdim, f"{isa} GEMM, weights in 4-channel blocks", T_=tile)
        if (kdim == p["C"] and p["SH"] == p["SW"] == 1 and p["OH"] == p["H"] and p["OW"] == p["W"]
                and p["N"] == 1):
            # pointwise: a tile's columns are gathered before its outputs are written, so the
            # output may overwrite the input (output plane m on input plane m - max(0, M - C))
            k.alias = min(0, p["C"] - p["M"]) * p["H"] * p["W"] * 4


def in_place_dw_f32(k: Kernel) -> Kernel:
    """The fp32 depthwise kernel on microcontrollers may write its output over its input: each
    channel's plane is copied into its scratch before its outputs are written, and output plane p
    ends where input plane p does or before."""
    if k.family == "conv2d_dw" and k.params.get("N") == 1 and k.params.get("MULT") == 1:
        k.alias = 0
    return k


def select_mcu(g: ir.Graph, kernels: list[Kernel | None], target, optimize: str = "balanced") -> list[Kernel | None]:
    """Weights packed for the Cortex-M kernels that multiply from registers (see the module text)."""
    _select_8bit(g, kernels, target, check_optimize(optimize))
    for step, k in enumerate(kernels):
        if k is not None and k.family == "qconv2d" and not k.params.get("PACKED"):
            _select_dw(g, step, k, target, optimize)
    _select_fp32(g, kernels, target)
    return kernels
