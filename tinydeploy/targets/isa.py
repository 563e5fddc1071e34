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
class Q8:
    """How an ISA's 8-bit kernels (qconv2d_gemm, qconv2d_dw, qdense_packed) multiply, exactly.
    flavour "madd": int16 pairs summed into int32 lanes (x86 vpmaddwd: no saturating 16-bit pair
    sums); "dot": four 8-bit products summed into int32 lanes (x86 vpdpbusd u8 x s8, Arm SDOT
    s8 x s8); "mlal": int16 x int16 widened into int32 lanes (Arm SMLAL by lane). `kgroup` reduction
    steps share one 32-bit lane (2, 4, 1), `lanes` int32 lanes per vector register; `weights` are
    the weight types (QConv's TW) it multiplies, `tiles` its GEMM register tiles (MR channels x NR
    pixels, relative cost) and `dense` the output columns of its fully connected kernel; `signed`:
    a dot product that takes signed activations (SDOT; vpdpbusd takes them unsigned); `igemm`:
    KxK one-group convolutions take the implicit GEMM over padded planes rather than im2col
    (schedule/q8.py igemm_fits says which); `pairs`: the descriptor of the im2col GEMM for layers
    whose int8 weights hold no -128 (flavour "smull", Arm SMULL + SMLAL2 + SADALP: two int8
    products summed in int16, exact because no pair is (-128) x (-128); 16 k values per step), or
    on x86 without VNNI the "dot" flavour by vpmaddubsw (`maddubs`: u8 x s8 pairs summed in
    saturating int16, then vpmaddwd by ones and vpaddd: 3 instructions per 32 products where
    vpmaddwd takes 4 with the widening) for layers whose every pair of packed weights proves the
    pair sum within int16 (schedule/q8.py pairs_exact)."""
    flavour: str
    kgroup: int
    lanes: int
    tiles: tuple[tuple[int, int, float], ...]
    dense: int
    weights: tuple[str, ...] = ("int8_t", "uint8_t", "int16_t")
    signed: bool = False
    # the fewest columns the im2col GEMM's block is cut to when the arena has less room under its
    # peak (schedule/q8.py fit_gemm); 0: never cut (the L2-sized block stays)
    fit_cols: int = 0
    igemm: bool = False
    pairs: "Q8 | None" = None
    # 3x3 stride-1 one-group layers take the exact integer Winograd F(2x2, 3x3) (qconv2d_winograd,
    # schedule/q8wino.py) where the weights prove it exact
    winograd: bool = False
    # the im2col GEMM's tiles by instruction count (schedule/q8.py _tile): (MR, NR, instructions
    # per k-group, per tile where the k loop is short (<= 4 k-groups: unrolled whole), per tile
    # otherwise), fitted to exact counts; empty: the tiles' relative costs decide
    gemm_instr: tuple[tuple[int, int, float, float, float], ...] = ()
    # the im2col GEMM gathers its rows from zero-point-padded planes of the input, one per stride
    # phase (copied once per image and group), rather than from the image with bounds per row
    gemm_planes: bool = False
    # its QAdd kernel runs in int32 lanes where constants reproduce the reference on every input
    # pair (quant.params.qadd_int32, searched at build time by schedule/q8.py select_qadd)
    qadd_int32: bool = False
    # "dot" by vpmaddubsw + vpmaddwd(ones) + vpaddd in place of vpdpbusd (the pairs flavour of the
    # madd ISAs: exact only where schedule/q8.py ubs_exact proves it for the layer's weights)
    maddubs: bool = False
    # x86: the transposed tiles of the im2col GEMM (MR output channels in the vector lanes x NR
    # pixels broadcast, relative cost; schedule/q8.py trans_tile), taken where the layer's few
    # pixels would leave the NR-pixel panels of `tiles` partly empty (7x7 = 49 in 64)
    trans: tuple[tuple[int, int, float], ...] = ()
    # gemm_planes for the strided KxK layers only (x86 vpmaddubsw: their im2col rows copied from
    # phase planes rather than gathered byte by byte with the stride)
    gemm_planes_strided: bool = False


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
    q8: Q8 | None = None           # its 8-bit kernels, if it has any


# Register budget of the tiles: avx2 MR*NR/8 + NR/8 + 1 <= 16 ymm; avx512 MR*NR/16 + NR/16 + 1 <=
# 32 zmm; neon MR*NR/4 + MR/4 + NR/4 <= 32 q registers. Costs measured roughly on the host
# (AVX-512 / AVX2) with single layers of ResNet-8 and ResNet-50. avx2 3x24 is for 3x3 planes
# (9 positions of the transposed GEMM: MobileNet's last layers): 256 -> 256 channels in 14.2 us
# against 6x16's 17.9 us (12 rows, 3 wasted); on 36 positions it is 1.17x slower than 6x16.
# 8-bit tiles, the same budgets: accumulators MR*NR/lanes, NR/lanes B vectors, one broadcast A
# (x86); neon MR*NR/4 + NR/8 (int16 B) or NR/4 (dot B) + MR/8 or MR/4 A registers.
# fit_cols, measured: AVX2 (bench, MLPerf Tiny int8, interleaved): 128 columns cost nothing
# measurable (IC 0.366 ms against 0.367-0.374 uncut), 64 cost 3-4% on IC and KWS; NEON (rpi4,
# exact instructions under QEMU): 128 cost IC +4.8%, VWW +1.9%, so neon keeps its blocks.
# winograd (avx2), measured on an AVX2 host (bench --layers, forced against im2col, one run each,
# repeated): ResNet-50 (uint8) 3x3 stride-1 layers 1.89 -> 1.41 ms (56x56), 1.81 -> 1.26, 1.94 ->
# 1.25, 2.42 -> 1.24 ms (7x7); IC int8 301 -> 261 us (its 16-channel layers equal, 32 and 64
# channels 51 -> 36 and 44 -> 25 us)
# vpmaddubsw (avx2): 6x16 against 4x16, measured on an AVX2 host (bench --layers, ResNet-50 uint8 made
# by quantize --reduce-range, one run each): its 1x1 and 3x3 stride-2 GEMM layers 0.82-0.94 of 4x16's
# time (layer3.1.conv1 773 -> 653 us, layer4.0.conv2 2393 -> 2002 us), the 7x7 first layer (K = 147)
# 1.12 (1639 -> 1842 us); those 40 layers 41.4 -> 35.7 ms
# qadd_int32 (avx2, and avx512 through it: qadd_simd.c.j2's int32 lanes), measured on an AVX2 host (bench
# --layers, ResNet-50 uint8 --reduce-range, interleaved with the double lanes of main): its Adds
# 372 / 186 / 93 / 47 -> 80 / 39 / 20 / 11 us (256x56x56 ... 2048x7x7); IC int8 0.217 -> 0.207 ms
# The transposed tiles (16 channels x 5, 6 or 4 pixels), their relative costs from the same layers
# (bench --layers, forced on every GEMM layer, one run each): on 14x14 (196 pixels) 16x5 1.10,
# 16x6 1.03 and 16x4 1.26 of 6x16's time per padded output; on 7x7 (49 pixels in 64 columns)
# 16x5 takes layer4.x's 1x1 layers 794-810 -> 668-686 us, layer4.0.conv2 (3x3 s2) 2003 -> 1686 us.
# gemm_planes_strided, same host (interleaved, two runs each): the 3x3 stride-2 layers 1519/1528 ->
# 1442/1431 us (layer2.0.conv2), 1474/1477 -> 1412/1402 (layer3.0.conv2), 1489/1510 -> 1437/1419
# (layer4.0.conv2), the 7x7 first layer equal (1697/1706 -> 1722/1680); the 1x1 stride-2 layers
# equal too (1173/1180 -> 1180/1169 us), so they keep the gather
_Q8_UBS_YMM = Q8("dot", 4, 8, ((6, 16, 1.0), (4, 16, 1.16)), dense=32, weights=("int8_t",), fit_cols=128,
                 maddubs=True, trans=((16, 5, 1.10), (16, 6, 1.03), (16, 4, 1.26)), gemm_planes_strided=True)
_Q8_MADD_YMM = Q8("madd", 2, 8, ((4, 16, 1.0),), dense=32, fit_cols=128, winograd=True, pairs=_Q8_UBS_YMM,
                   qadd_int32=True)
_Q8_ZMM_TILES = ((12, 32, 1.0), (8, 32, 1.05), (6, 64, 1.05), (24, 16, 1.1), (16, 16, 1.15), (8, 16, 1.25))
_Q8_UBS_ZMM = Q8("dot", 4, 16, _Q8_ZMM_TILES, dense=64, weights=("int8_t",), maddubs=True)
_Q8_MADD_ZMM = Q8("madd", 2, 16, _Q8_ZMM_TILES, dense=64, pairs=_Q8_UBS_ZMM)
_Q8_DOT_ZMM = Q8("dot", 4, 16, _Q8_MADD_ZMM.tiles, dense=64, weights=("int8_t",))
_Q8_DOT_YMM = Q8("dot", 4, 8, _Q8_MADD_YMM.tiles, dense=32, weights=("int8_t",))
# Cortex-A: the implicit GEMM, by exact instruction counts under qemu-aarch64 (IC int8: rpi4
# 6.31 -> 4.68 M, jetson-orin 3.14 -> 1.61 M per inference; VWW's first layer 427 -> 226 k and
# 243 -> 125 k), where no im2col row is gathered and packed per output channel block.
# SMULL pairs: a 4 x 4 tile of int32x4 partial sums (16 accumulators, 4 + 4 q registers of bytes):
# 3 instructions per 16 MACs where SMLAL by lane takes 4 per 16 (with its loads 59 per 256
# against 21 per 64)
_Q8_SMULL = Q8("smull", 16, 4, ((4, 4, 1.0),), dense=8, weights=("int8_t",), signed=True, gemm_planes=True)
# winograd (neon), exact instructions under qemu-aarch64 -cpu cortex-a72: IC int8's 3x3 stride-1
# layers 715-806 k -> 338-419 k each, IC 4,193,085 -> 2,714,542 per inference. Not on SDOT
# (neon-dotprod): its implicit GEMM takes 248 k for those layers, less than the same Winograd.
_Q8_MLAL = Q8("mlal", 1, 4, ((12, 8, 1.0), (8, 8, 1.08), (4, 16, 1.12)), dense=16, igemm=True, pairs=_Q8_SMULL,
              winograd=True, gemm_planes=True, qadd_int32=True)
# SDOT's im2col GEMM tiles, fitted to the exact counts of every MLPerf Tiny int8 GEMM layer on
# jetson-orin under each tile (qemu-aarch64): 4x16 takes 5-8% fewer instructions than 8x8 on the
# long-K layers with many columns (KWS's pointwise 63.7 k -> 60.5 k, VWW layers 7-11), 12x8 on
# the few-column ones (VWW 13-27), 8x8 on VWW's K = 8 layer 3 (92.6 k against 100 k)
_Q8_SDOT = Q8("dot", 4, 4, ((12, 8, 1.0), (8, 8, 1.08), (4, 16, 1.12)), dense=16, weights=("int8_t",), signed=True,
              igemm=True, gemm_instr=((8, 8, 20.6, 125.0, 169.0), (4, 16, 21.1, 131.0, 142.0),
                                      (12, 8, 30.5, 137.0, 190.0)), gemm_planes=True)
ISAS = {isa.name: isa for isa in (
    ISA("ref", "portable C99, the fallback of every ISA", tiles=((4, 8, 1.0),), ref_cost=1.5, winograd_lanes=8),
    ISA("avx2", "x86-64 AVX2 + FMA (ymm)", features=("avx2", "fma"), ref_cost=5.0, winograd_lanes=8,
        lanes=8, registers=16, tiles=((6, 16, 1.0), (4, 24, 1.0), (8, 8, 1.12), (12, 8, 1.08), (4, 16, 1.15),
                                      (3, 24, 1.15)),
        q8=_Q8_MADD_YMM),
    ISA("avx-vnni", "x86-64 AVX-VNNI (vpdpbusd on ymm: u8 x s8 quads into int32; 8-bit kernels)",
        features=("avx2", "fma", "avx_vnni"), q8=_Q8_DOT_YMM),
    ISA("avx512", "x86-64 AVX-512F (zmm)", features=("avx512f",), ref_cost=8.0, winograd_lanes=16,
        lanes=16, registers=32,
        tiles=((8, 32, 1.0), (4, 48, 1.02), (12, 32, 1.15), (6, 64, 1.1), (24, 16, 1.05), (16, 16, 1.1),
               (8, 16, 1.25))),
    ISA("avx512bw", "x86-64 AVX-512BW (zmm with 8- and 16-bit lanes: vpmaddwd; 8-bit kernels)",
        features=("avx512f", "avx512bw"), q8=_Q8_MADD_ZMM),
    ISA("avx512-vnni", "x86-64 AVX-512 VNNI (vpdpbusd on zmm: u8 x s8 quads into int32; 8-bit kernels)",
        features=("avx512f", "avx512bw", "avx512_vnni"), q8=_Q8_DOT_ZMM),
    ISA("neon", "Armv8-A Advanced SIMD (128-bit q registers, vfmaq_laneq_f32; 8-bit: SMLAL by lane)",
        features=("neon",), ref_cost=4.0, winograd_lanes=4, lanes=4, registers=32,
        tiles=((8, 12, 1.0), (12, 8, 1.0), (8, 8, 1.08), (4, 16, 1.1)),
        q8=_Q8_MLAL),
    ISA("neon-dotprod", "Armv8.2-A dot product (SDOT/UDOT) on top of NEON", features=("neon", "dotprod"),
        ref_cost=4.0, winograd_lanes=4, lanes=4, registers=32,
        tiles=((8, 12, 1.0), (12, 8, 1.0), (8, 8, 1.08), (4, 16, 1.1)), q8=_Q8_SDOT),
    ISA("cortex-m4-dsp", "Armv7E-M DSP extension: SMLAD on int16 pairs (8-bit kernels)", role="dsp8"),
    ISA("cortex-m4-fpu", "Armv7E-M single-precision FPU registers (fp32 kernels)", role="fpu32"),
)}


def get_isa(name: str) -> ISA:
    if name not in ISAS:
        raise TinydeployError(f"unknown kernel ISA {name!r}; known: {', '.join(ISAS)}")
    return ISAS[name]
