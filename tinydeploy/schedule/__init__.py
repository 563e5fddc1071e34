"""Kernel selection: between lowering and memory planning, pick the algorithm of each fp32
convolution and fully connected layer for the target.

Lowering emits generic kernels (`conv2d`, `dense`: the portable direct reference, which stays
the fallback and the oracle). Here a small cost model (conv_costs, in micro-kernel MACs) may
replace one by:
  conv2d_gemm   the convolution as a GEMM  Y[M/G][OH*OW] = W[M/G][C/G*KH*KW] . X_col, BLIS-style:
                weights packed at build time into MR-row panels ([panel][K][MR], zero-padded rows),
                activations packed at run time into NR-column panels of a kc x nc block (a 1x1
                stride-1 unpadded conv copies the activation rows as they are: no im2col; other
                convs gather the block's im2col rows through a row buffer); loops jc > pc > ic >
                jr > ir around a register micro-kernel MR x NR per ISA; kc/mc/nc from the
                target's L1/L2 sizes; bias + activation fused into the last K block's stores.
  conv2d_igemm  convolution as an implicit GEMM: the input copied once into zero-padded planes
                (one set per stride phase a tap uses), the micro-kernel reads every (channel,
                tap) row of B straight from them at a build-time offset (no im2col, no
                activation packing; costs the WP - OW extra columns per row). Wins when few
                output channels share each packed B element (ResNet-8, most 3x3 layers).
  conv2d_gemmt  1x1 stride-1 convolution on a small plane as the transposed GEMM (positions in
                the broadcast dimension, output channels in the vector dimension: a 6x6 plane
                pads nothing), input packed at run time, weights at build time.
  conv2d_winograd2 / conv2d_winograd4
                3x3 stride-1 convolution (not depthwise) as Winograd F(2x2,3x3) / F(4x4,3x3):
                filters transformed at build time (U = G g G^T in float64, stored float32 as
                MR-row panels), per block of output tiles the input transform B^T d B (into
                NR-column panels), the 16 / 36 independent GEMMs U[xi] . V[xi] by the register
                micro-kernel, then the output transform A^T M A with bias and activation; the
                block keeps V and M in L2. 2.25x / 4x fewer GEMM MACs for larger weights (U is
                16/9 and 4x the filters: costly when a layer's U exceeds L2) and transforms
                that do not pay on thin layers or tiny planes.
  conv2d_dw     depthwise (group == in channels): direct, per channel through a zero-padded
                copy of the plane (no bounds tests), stride 1 as one flat vectorised loop,
                stride 2 the same over 4 phase planes (even/odd rows x columns).
  dense_packed  fully connected with more than a few rows: the same GEMM with the weights
                packed into NR-column panels at build time and the input rows packed at run time.
  ref           tiny layers (< MIN_MACS) and matrix-vector products keep the reference kernel.
Micro-kernel variants (templates <family>_f32.c.j2 taking the ISA, tiles in targets/isa.py): portable C (`ref`,
the fallback of every ISA), `avx2` (FMA, ymm), `avx512` (zmm, where the host has it), `neon`
(vfmaq_laneq_f32). The choice is explicit: params["algo"] and a "[algo isa tile ...]" prefix of
Kernel.desc (printed in the generated code's comments; `describe()` lists them).
TINYDEPLOY_ALGO=ref keeps every reference kernel; =<algo name> forces that algorithm wherever it
applies; TINYDEPLOY_TILE=MRxNR forces a tile (tests and experiments). Without them, a layer
shape measured by `tinydeploy tune` (the target's tuning database, tinydeploy/schedule/tuning) gets the
measured algorithm, tile and blocking instead of the cost model's ("tuned" in its desc prefix).

Run-time buffers (packed activations, padded planes) are kernel scratch: `scratch_bytes`,
placed in the arena by the planner under the name "#scratch<step>" and passed as the kernel's
last argument. Targets without data caches (microcontrollers) keep the reference kernels unless
forced, except for their own register-blocked kernels (schedule/mcu.py).

`--threads N` (Linux targets): `parallelise` gives every fast layer params["THREADS"] =
min(its independent blocks, N, its MACs / MIN_THREAD_MACS); its driver template then runs an
OpenMP loop over blocks that write disjoint outputs, each computed exactly as with one thread
(bit-identical results), with per-thread packing buffers (scratch x THREADS). Reference
kernels and layers left with 1 stay serial, and N = 1 generates exactly the serial code.
"""
from __future__ import annotations

import os

from tinydeploy import ir
from tinydeploy.ops import Kernel
from tinydeploy.schedule import tuning
# the planners (each in its module) and the names tests and the tuner use through this face
from tinydeploy.schedule.conv import _select_conv, conv_choice, conv_costs, is_depthwise  # noqa: F401  (the face)
from tinydeploy.schedule.cost import _algo_env, _isa, blocking, pick_tile, ranked_tiles  # noqa: F401
from tinydeploy.schedule.dense import _select_dense, dense_choice  # noqa: F401
from tinydeploy.schedule.first import drop_folded
from tinydeploy.schedule.mcu import OPTIMIZE, check_optimize, flash_choices, select_mcu  # noqa: F401
from tinydeploy.schedule import mcu, stream
from tinydeploy.schedule.q8 import fit_gemm, select_q8, select_qadd
from tinydeploy.schedule import q8lanes, q8wino
from tinydeploy.schedule.threads import parallel_blocks, parallelise  # noqa: F401
from tinydeploy.schedule.winograd import winograd_applies, winograd_costs  # noqa: F401


def select_kernels(g: ir.Graph, kernels: list[Kernel | None], target, threads: int = 1,
                   optimize: str = "balanced") -> list[Kernel | None]:
    """Replace generic fp32 conv2d/dense kernels by faster algorithms where the cost model says
    so, and 8-bit ones by the target's ISA kernels (schedule/q8.py); with threads > 1, spread each
    fast layer over up to that many threads. `optimize` (balanced, speed, size): what
    microcontroller kernels may spend flash on (schedule/mcu.py)."""
    force = _algo_env()
    # microcontrollers: weights packed for the DSP extension (8-bit) and the FPU (fp32) kernels
    kernels = select_mcu(g, kernels, target, optimize)
    if not target.caches and force == "auto":
        # cores without a data cache to block for (microcontrollers), where RAM matters more:
        # depthwise fp32 convolutions take the padded-plane kernel (one plane of scratch)
        return [mcu.in_place_dw_f32(_select_conv(g, s, k, target, "conv2d_dw"))
                if k is not None and k.family == "conv2d" and k.dtype == "f32" and is_depthwise(k.params) else k
                for s, k in enumerate(kernels)]
    # The tuning database's measured choice for a layer shape beats the cost model; the
    # environment overrides both (tests, experiments); the tuner forces its candidates.
    forced = tuning.forced_choice()
    db: dict = {}
    if force == "auto" and not os.environ.get("TINYDEPLOY_TILE") and forced is None:
        db, note = tuning.load(tuning.target_key(target, _isa("conv2d_gemm", target)))
        if note:
            g.notes.append(note)
    out: list[Kernel | None] = []
    for step, k in enumerate(kernels):
        if k is not None and k.family in ("qconv2d", "qdense") and target.caches:
            # 8-bit: the exact integer Winograd where it applies (schedule/q8wino.py), else q8.py's
            # (or the pixels-in-lanes kernel of short-K layers, schedule/q8lanes.py: one thread only,
            # it is not spread over threads as the GEMMs are)
            k = (q8wino.select_q8wino(g, step, k, target, force)
                 or (q8lanes.select_q8lanes(g, step, k, target, force) if threads <= 1 else None)
                 or select_q8(g, step, k, target, force))
        if k is not None and k.family == "qadd":
            k = select_qadd(k, target)                  # int32-lane constants (NEON, x86)
        if k is not None and k.dtype == "f32" and k.family in ("conv2d", "dense"):
            choice = forced if forced is not None else db.get(tuning.layer_signature(k)) if db else None
            if k.family == "conv2d":
                k = _select_conv(g, step, k, target, force, choice)
            else:
                k = _select_dense(g, step, k, target, force, choice)
            if choice is not None:
                k.desc = k.desc.replace("] ", " tuned] " if forced is None else " candidate] ", 1)
        out.append(parallelise(g, step, k, threads))
    return drop_folded(out)


def fit_scratch(k: Kernel, room: int) -> bool:
    """Size kernel k's scratch to the `room` bytes the planner found at its step (microcontroller
    kernels: GEMM tiles, patch-based chains; the 8-bit GEMM's column blocks on CPUs with caches);
    False for kernels whose scratch has one size."""
    if k.family == "qconv2d_gemm":
        return fit_gemm(k, room)
    if k.family == "qconv2d_winograd":
        return q8wino.fit(k, room)
    return (stream.fit if k.family == "stream" else mcu.fit_scratch)(k, room)


def chain_candidates(g: ir.Graph, kernels: list[Kernel | None]) -> list:
    """Patch-based chains the planner may take (schedule/stream.py)."""
    return stream.candidates(g, kernels)


def selection_state(target) -> str:
    """What the selection depends on besides the model, for build keys (see tuning.state)."""
    return tuning.state(tuning.target_key(target, _isa("conv2d_gemm", target)))


def describe(kernels: list[Kernel | None], fast_only: bool = False) -> list[str]:
    """One line per selected layer: '<step>: <algorithm desc>' (for `tinydeploy build`);
    fast_only leaves out the layers that kept the reference kernel."""
    return [f"{i}: {k.desc}" for i, k in enumerate(kernels)
            if k is not None and "algo" in k.params and not (fast_only and k.params["algo"] == "ref")]
