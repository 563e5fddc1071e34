"""Kernel selection for Cortex-M cores: weights re-laid at build time for the register-blocked
GEMM kernels of the DSP extension (8-bit) and of the FPU (fp32), each with arena scratch for the
tile of activations it gathers.

8-bit (ISA cortex-m4-dsp): SMLAD multiplies int16 pairs. One 32-bit word holds two
sign-extended weights of the same output channel, multiplied with the matching pair of
activations (widened once per tile). Widening int8 weights at run time costs a pass over them for
every tile of output pixels (a third of the time of a 64-channel 3x3 layer); packed here, the
kernels read them straight from flash (firmware_templates/kernels/_qconv_pw_dsp.j2,
qdense_cortex-m4-dsp.c.j2). The price is flash, two bytes per weight instead of one, bounded by
EXTRA_FLASH_BYTES.

fp32 (ISA cortex-m4-fpu): convolutions with one group as a GEMM over pixel tiles, 4 channels x
2 pixels of accumulators in FPU registers (conv2d_f32_cortex-m4-fpu.c.j2); the weights only
change order ([M/4 blocks][K][4 channels]), so flash stays the same.

Layout of the packed weights of one layer, int32 words (pack_pairs):
    [M/4 blocks of 4 output channels (the last block: M % 4 channels)][KP pairs][channels in block]
Fully connected layers pair consecutive inputs (k = 2i, 2i+1).
Channel pairs: pair k = c*KH*KW + tap holds channels (2c, 2c+1) at tap (ky, kx); an odd channel
count pairs the last channel with 0. With 1 or 3 input channels (the first layer of most
networks) that zero would be a third or half of all multiplies, so there the pairs run along the
flattened reduction r = c*KH*KW + tap instead ("flat": pair k holds rows 2k and 2k+1). The
kernel's accumulators are the reference kernel's int32 sums, so the result stays bit-exact with
it (tests/test_cortex_m_kernels.py).
"""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.codegen import kernels as kreg
from tinydeploy.ops import Kernel
from tinydeploy.ops.registry import new_const, scratch_arg

# The target names the ISAs of these kernels by their role (targets/isa.py): "dsp8" for the 8-bit
# SMLAD kernels, "fpu32" for the fp32 FPU ones.
DSP_ROLE, FPU_ROLE = "dsp8", "fpu32"
# Words of arena scratch (planned like any tensor, for the one step) for the kernel's tile of
# activations widened to int16 pairs: up to 64 pixels, and at most 6 KiB unless two pixels need
# more. (On the stack it would have to fit the smallest Cortex-M4 stack, 8 KiB on nano33ble,
# and it pushes the inner loop's spilled loop bound beyond the reach of an SP-relative load.)
SCRATCH_WORDS = 1536
TILE_PIXELS = 64
# Packed weights take two bytes where int8 ones take one: at most this much more flash is spent
# on them, the layers that gain most per byte first. The rest keep their int8 weights: fully
# connected layers then widen them at run time, convolutions take the reference kernel.
EXTRA_FLASH_BYTES = 384 * 1024
FP32_MIN_MACS = 1024      # smaller fp32 convolutions keep the reference (measured: a 2x2 output loses)


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
    return blocks_of_4(((wf[:, 0::2] & 0xFFFF) | (wf[:, 1::2] << 16)).astype(np.uint32).view(np.int32))


def blocks_of_4(rows: np.ndarray) -> np.ndarray:
    """[R][K] -> [R/4 blocks (the last: R % 4 rows)][K][rows of the block], flat: the order the
    kernels' 4-row register blocks read (all rows' values of one reduction step together)."""
    return np.ascontiguousarray(np.concatenate([rows[b:b + 4].T.reshape(-1) for b in range(0, rows.shape[0], 4)]))


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


def _attach(g: ir.Graph, step: int, k: Kernel, packed: np.ndarray, scratch_words: int, desc: str, **params) -> None:
    """Give kernel k its packed weights (its own constant, replacing args[1]), arena scratch (the
    planner's "#scratch<step>", passed last) and parameters."""
    name = new_const(g, k.consts, k.args[1] + "_packed", packed)
    k.scratch_bytes = 4 * scratch_words
    k.scratch_dtype = np.dtype(packed.dtype).name
    k.args = [k.args[0], name] + list(k.args[2:]) + [scratch_arg(step)]
    k.params = dict(k.params, PACKED=True, **params)
    k.desc = f"[{desc}] {k.desc}"


def _uses(k: Kernel, target, isa: str | None) -> bool:
    return isa is not None and kreg.resolve(k.family, k.dtype, list(target.isas))[1] == isa


def _select_8bit(g: ir.Graph, kernels: list[Kernel | None], target) -> None:
    """Pack the weights of the 8-bit convolutions and fully connected layers the DSP kernels
    compute, most MACs per extra flash byte first, while the extra flash stays within
    EXTRA_FLASH_BYTES."""
    isa = target.isa_with_role(DSP_ROLE)
    cands = []
    for step, k in enumerate(kernels):
        if k is None or not _packable(k) or not _uses(k, target, isa):
            continue
        rows = _conv_rows(g, k) if k.family == "qconv2d" else k.tensor(k.args[1], g).data.astype(np.int32)
        packed = pack_pairs(rows)
        extra = packed.nbytes - k.tensor(k.args[1], g).nbytes
        macs = rows.size * (k.params["OH"] * k.params["OW"] * k.params["N"] if k.family == "qconv2d" else k.params["M"])
        cands.append((-macs / max(extra, 1), step, k, packed, extra))
    spent = 0
    for _, step, k, packed, extra in sorted(cands, key=lambda c: (c[0], c[1])):
        if spent + extra > EXTRA_FLASH_BYTES:
            continue
        spent += extra
        if k.family == "qconv2d":
            pairs, flat = _pairs(k.params), _flat(k.params)
            tile = tile_pixels(k.params, pairs)
            _attach(g, step, k, packed, tile * pairs, f"{isa} weights packed in int16 pairs{' (flat)' if flat else ''}",
                    FLAT=flat, KP=pairs, T_=tile)
        else:
            pairs = (k.params["K"] + 1) // 2
            _attach(g, step, k, packed, 2 * pairs, f"{isa} weights packed in int16 pairs", KP=pairs)


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


def select_mcu(g: ir.Graph, kernels: list[Kernel | None], target) -> list[Kernel | None]:
    """Weights packed for the Cortex-M kernels that multiply from registers (see the module text)."""
    _select_8bit(g, kernels, target)
    _select_fp32(g, kernels, target)
    return kernels
