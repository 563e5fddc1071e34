"""Kernel ISAs: what kernel selection needs to know about each family of kernel variants.

An ISA here names a set of kernel variants (declared in codegen/kernels.py, templates in
firmware_templates/kernels/) and the facts the cost model and the planners use to size work for
it. Targets list the ISAs their CPU has, best first (tinydeploy/targets); kernel selection
(tinydeploy/schedule) only ever reads these descriptors, so a new ISA is a descriptor here plus
its templates and their entries in codegen/kernels.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tinydeploy.errors import TinydeployError


@dataclass(frozen=True)
class ISA:
    name: str
    description: str
    # Register tiles (MR rows x NR columns) the fp32 GEMM micro-kernels are generated for, each
    # with a relative cost per multiply-accumulate (loads per FMA, latency cover). The templates
    # take MR/NR as parameters; build-time weight packing depends on them, so the tile is chosen
    # per layer to waste the least padding (e.g. 16 output channels: 4x24 or 8x8 rather than 6x16).
    tiles: tuple[tuple[int, int, float], ...] = ()
    ref_cost: float = 1.5          # a reference direct-conv MAC, in micro-kernel MACs (measured)
    winograd_lanes: int = 8        # Winograd tiles transformed side by side (the vector width)
    role: str = ""                 # microcontroller kernels: "dsp8" (8-bit SMLAD), "fpu32" (fp32 FPU)
    features: tuple[str, ...] = field(default=())   # targets.cpu_features() names it needs
    lanes: int = 1                 # fp32 lanes of one vector register (the depthwise and first-layer kernels)
    registers: int = 0             # vector registers (their register blocking)


# Register budget of the tiles: avx2 MR*NR/8 + NR/8 + 1 <= 16 ymm; avx512 MR*NR/16 + NR/16 + 1 <=
# 32 zmm; neon MR*NR/4 + MR/4 + NR/4 <= 32 q registers. Costs measured roughly on the host
# (AVX-512 / AVX2) with single layers of ResNet-8 and ResNet-50.
ISAS = {isa.name: isa for isa in (
    ISA("ref", "portable C99, the fallback of every ISA", tiles=((4, 8, 1.0),), ref_cost=1.5, winograd_lanes=8),
    ISA("avx2", "x86-64 AVX2 + FMA (ymm)", features=("avx2", "fma"), ref_cost=5.0, winograd_lanes=8,
        lanes=8, registers=16, tiles=((6, 16, 1.0), (4, 24, 1.0), (8, 8, 1.12), (12, 8, 1.08), (4, 16, 1.15))),
    ISA("avx512", "x86-64 AVX-512F (zmm)", features=("avx512f",), ref_cost=8.0, winograd_lanes=16,
        lanes=16, registers=32, tiles=((8, 32, 1.0), (4, 48, 1.02), (12, 32, 1.15), (6, 64, 1.1), (24, 16, 1.05),
                                       (16, 16, 1.1), (8, 16, 1.25))),
    ISA("neon", "Armv8-A Advanced SIMD (128-bit q registers, vfmaq_laneq_f32)", features=("neon",), ref_cost=4.0,
        winograd_lanes=4, lanes=4, registers=32,
        tiles=((8, 12, 1.0), (12, 8, 1.0), (8, 8, 1.08), (4, 16, 1.1))),
    ISA("neon-dotprod", "Armv8.2-A dot product (SDOT/UDOT) on top of NEON", features=("neon", "dotprod"),
        ref_cost=4.0, winograd_lanes=4, lanes=4, registers=32,
        tiles=((8, 12, 1.0), (12, 8, 1.0), (8, 8, 1.08), (4, 16, 1.1))),
    ISA("cortex-m4-dsp", "Armv7E-M DSP extension: SMLAD on int16 pairs (8-bit kernels)", role="dsp8"),
    ISA("cortex-m4-fpu", "Armv7E-M single-precision FPU registers (fp32 kernels)", role="fpu32"),
)}


def get_isa(name: str) -> ISA:
    if name not in ISAS:
        raise TinydeployError(f"unknown kernel ISA {name!r}; known: {', '.join(ISAS)}")
    return ISAS[name]
