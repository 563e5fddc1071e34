"""Kernel selection for Cortex-M cores with the DSP extension (Armv7E-M): the weights of int8
convolutions and fully connected layers are packed at build time in the layout SMLAD multiplies.

SMLAD multiplies int16 pairs: one 32-bit word holds two sign-extended weights of the same output
channel, and the kernel multiplies it with the matching pair of activations (widened once per
tile into arena scratch). Widening int8 weights at run time costs a pass over them for every tile
of output pixels (a third of the time of a 64-channel 3x3 layer); packed here, the kernels read
them straight from flash (firmware_templates/kernels/_qconv_pw_dsp.j2, qdense_s8_cortex-m4-dsp).
The price is flash, two bytes per weight instead of one, bounded by EXTRA_FLASH_BYTES.

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

ISA = "cortex-m4-dsp"
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


def tile_pixels(p: dict) -> int:
    """Output pixels per tile: even, at least 2, at most TILE_PIXELS and the layer's (rounded up)."""
    pixels = p["OH"] * p["OW"]
    return min(TILE_PIXELS, max(2, SCRATCH_WORDS // _pairs(p) // 2 * 2), (pixels + 1) // 2 * 2)


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
    words = ((wf[:, 0::2] & 0xFFFF) | (wf[:, 1::2] << 16)).astype(np.uint32).view(np.int32)   # [R][KP]
    return np.ascontiguousarray(np.concatenate([words[b:b + 4].T.reshape(-1) for b in range(0, r, 4)]))


def _conv_rows(g: ir.Graph, k: Kernel) -> np.ndarray:
    """A convolution's weights as [M][K] in its pair order: flat (c, ky, kx), or channel pairs
    (c pair, tap, channel of the pair) with a zero channel when C is odd."""
    p = k.params
    w = g.const(k.args[1]).astype(np.int32)
    if p["form"] == "pixel":       # lowering re-laid them [C][KH][KW][M]
        w = w.reshape(p["C"], p["KH"], p["KW"], p["M"]).transpose(3, 0, 1, 2)
    m, c, kk = p["M"], p["C"], p["KH"] * p["KW"]
    w = w.reshape(m, c, kk)
    if _flat(p):
        return w.reshape(m, c * kk)
    wc = np.zeros((m, c + c % 2, kk), np.int32)
    wc[:, :c, :] = w
    return wc.reshape(m, -1, 2, kk).transpose(0, 1, 3, 2).reshape(m, -1)


def select_dsp(g: ir.Graph, kernels: list[Kernel | None], target) -> list[Kernel | None]:
    """Pack the weights of the int8 convolutions and fully connected layers the DSP kernels
    compute, most MACs per extra flash byte first, while the extra flash stays within
    EXTRA_FLASH_BYTES; give each its arena scratch for the activations widened to pairs."""
    if ISA not in target.isas:
        return kernels
    cands = []
    for step, k in enumerate(kernels):
        if k is None or not _packable(k) or kreg.resolve(k.family, k.dtype, list(target.isas))[1] != ISA:
            continue
        rows = _conv_rows(g, k) if k.family == "qconv2d" else g.const(k.args[1]).astype(np.int32)
        packed = pack_pairs(rows)
        extra = packed.nbytes - g.t(k.args[1]).nbytes
        macs = rows.size * (k.params["OH"] * k.params["OW"] * k.params["N"] if k.family == "qconv2d" else k.params["M"])
        cands.append((-macs / max(extra, 1), step, k, packed, extra))
    spent = 0
    for _, step, k, packed, extra in sorted(cands, key=lambda c: (c[0], c[1])):
        if spent + extra > EXTRA_FLASH_BYTES:
            continue
        spent += extra
        name = g.fresh_name(k.args[1] + "_pairs")
        g.tensors[name] = ir.Tensor(name, packed.shape, np.dtype(np.int32), data=packed)
        if k.family == "qconv2d":
            tile = tile_pixels(k.params)
            pairs = _pairs(k.params)
            k.params = dict(k.params, PACKED=True, FLAT=_flat(k.params), KP=pairs, T_=tile)
        else:
            tile, pairs = 2, (k.params["K"] + 1) // 2
            k.params = dict(k.params, PACKED=True, KP=pairs)
        k.scratch_bytes = 4 * tile * pairs
        scratch = f"#scratch{step}"        # the planner's name for a step's scratch
        g.tensors[scratch] = ir.Tensor(scratch, (k.scratch_bytes // 4,), np.dtype(np.int32))
        k.args = [k.args[0], name] + list(k.args[2:]) + [scratch]
        flat = " (flat)" if k.params.get("FLAT") else ""
        k.desc = f"[{ISA} weights packed in int16 pairs{flat}] {k.desc}"
    return kernels
