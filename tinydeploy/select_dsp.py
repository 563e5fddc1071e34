"""Kernel selection for Cortex-M cores with the DSP extension (Armv7E-M): int8 convolutions get
their weights packed at build time in the layout the SMLAD kernel multiplies.

The DSP convolution (firmware_templates/kernels/_qconv_pw_dsp.j2) multiplies int16 pairs: one
32-bit word holds the weights of input channels 2c and 2c+1 at the same tap, sign-extended, and
SMLAD multiplies it with the matching pair of activations. Packing those words at run time costs
a pass over the weights for every tile of output pixels (a third of the time of a 64-channel 3x3
layer whose tile is 4 pixels, as the stack allows); packed here, the kernel reads them straight
from flash. The price is flash: two bytes per weight instead of one, for the layers packed.

Layout of the packed weights of one layer, int32 words:
    [M/4 blocks of 4 output channels (the last block: M % 4 channels)][KP pairs][channels in block]
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
# Words of stack the kernel may use for its tile of activations (two pixels at least): 6 KiB,
# so that it fits the smallest stack of a Cortex-M4 board (8 KiB, nano33ble).
SCRATCH_WORDS = 1536


def _flat(p: dict) -> bool:
    return p["C"] in (1, 3)


def _pairs(p: dict) -> int:
    kk = p["KH"] * p["KW"]
    return (p["C"] * kk + 1) // 2 if _flat(p) else (p["C"] + 1) // 2 * kk


def _packable(k: Kernel) -> bool:
    p = k.params
    if k.family != "qconv2d" or p.get("TX") != "int8_t" or p.get("TW") != "int8_t":
        return False
    return p["form"] in ("pixel", "row") and p["G"] == 1 and 2 * _pairs(p) <= SCRATCH_WORDS


def pack_pairs(w: np.ndarray, flat: bool) -> np.ndarray:
    """ONNX weights [M][C][KH][KW] (int8) -> the packed int32 words described above."""
    m, c = w.shape[:2]
    kk = int(np.prod(w.shape[2:]))
    if flat:
        k = c * kk
        wf = np.zeros((m, k + k % 2), np.int32)
        wf[:, :k] = w.reshape(m, k)
        lo, hi = wf[:, 0::2] & 0xFFFF, wf[:, 1::2] << 16    # [M][KP]: rows 2k, 2k + 1
    else:
        wc = np.zeros((m, c + c % 2, kk), np.int32)
        wc[:, :c, :] = w.reshape(m, c, kk)
        lo = wc[:, 0::2, :].reshape(m, -1) & 0xFFFF        # [M][KP]: channel 2c at each tap
        hi = wc[:, 1::2, :].reshape(m, -1) << 16
    words = (lo | hi).astype(np.uint32).view(np.int32)    # [M][KP]
    blocks = [words[b:b + 4].T for b in range(0, m, 4)]    # [KP][channels of the block]
    return np.ascontiguousarray(np.concatenate([blk.reshape(-1) for blk in blocks]))


def _onnx_weights(g: ir.Graph, k: Kernel) -> np.ndarray:
    p = k.params
    w = g.const(k.args[1])
    if p["form"] == "pixel":       # lowering re-laid them [C][KH][KW][M]
        return np.ascontiguousarray(w.reshape(p["C"], p["KH"], p["KW"], p["M"]).transpose(3, 0, 1, 2))
    return w.reshape(p["M"], p["C"], p["KH"], p["KW"])


def select_dsp(g: ir.Graph, kernels: list[Kernel | None], target) -> list[Kernel | None]:
    """Pack the weights of every int8 convolution the DSP kernel computes as a GEMM."""
    if ISA not in target.isas or kreg.resolve("qconv2d", "s8", list(target.isas))[1] != ISA:
        return kernels
    for k in kernels:
        if k is None or not _packable(k):
            continue
        packed = pack_pairs(_onnx_weights(g, k), _flat(k.params))
        name = g.fresh_name(k.args[1] + "_pairs")
        g.tensors[name] = ir.Tensor(name, packed.shape, np.dtype(np.int32), data=packed)
        k.args = [k.args[0], name] + list(k.args[2:])
        k.params = dict(k.params, PACKED=True, FLAT=_flat(k.params), KP=_pairs(k.params), SCRATCH_WORDS=SCRATCH_WORDS)
        k.desc = f"[{ISA} weights packed in int16 pairs{' (flat)' if _flat(k.params) else ''}] {k.desc}"
    return kernels
