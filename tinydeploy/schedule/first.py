"""First layers (conv2d_first): convolutions of an image with 1 to 4 channels (one group), where
the reduction (C x KH x KW) is short and the output planes are large, so every GEMM form pays for
its packing or its padded planes. The kernel (conv2d_first_f32.c.j2: avx2, avx512, neon) reads a
zero-padded copy of the input straight from the micro-kernel: PX output pixels x NR output
channels per tile, a pixel's input value broadcast against a vector of NR channels' weights
(packed at build time [M/NR][KH][KW][C][NR]), and the tile transposed in registers into the NCHW
output planes. NEON at stride 1, when the output rows are whole vectors: the other way round, 4
pixels of a row in the lanes x 16 channels, each channel's 4 inputs multiplied by its weights by
element (no broadcasts, no transpose; LANE_PIXELS, LANE_CHANNELS).

The input's layout change is folded in where the model has one: MLPerf Tiny's image models start
with Transpose(NHWC -> NCHW) of the graph input. When this layer is that Transpose's only reader,
the kernel reads the NHWC input itself (its padded copy is then NHWC: rows of W x C floats, each a
plain copy) and the Transpose is dropped from the schedule (its kernel becomes None: no code, no
buffer; planner.py and codegen follow the kernels' arguments)."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.ops import Kernel
from tinydeploy.ops.registry import scratch_arg
from tinydeploy.schedule.cost import TILE_COST, _add_const, _isa, _round_up
from tinydeploy.targets.isa import get_isa

MAX_CHANNELS = 4        # input channels of a first layer
MAX_K = 196             # the reduction is unrolled per kernel row: at most 4 channels x 7x7
PIXELS = 8              # output pixels per tile (the transpose of a tile is 8 x 8)
LANE_PIXELS = 4         # NEON at stride 1: the pixels of a tile are the lanes (one row, no transpose)
LANE_CHANNELS = 16      # ... and its 16 channels 16 vectors of sums
NCHW_TO_NHWC = [0, 3, 1, 2]


def first_applies(p: dict) -> bool:
    return p["G"] == 1 and p["C"] <= MAX_CHANNELS and p["C"] * p["KH"] * p["KW"] <= MAX_K


def _channel_vectors(isa: str) -> int:
    """Vectors of output channels per tile: NEON's 4-lane vectors two at a time (8 x 8 tiles)."""
    return 2 if get_isa(isa).lanes == 4 else 1


def first_costs(p: dict, isa: str) -> dict[str, float]:
    """Estimated time in micro-kernel MACs (schedule/conv.py conv_costs): padded tiles, the
    padded copy, the transposes."""
    if not first_applies(p) or isa == "ref":
        return {}
    nr = get_isa(isa).lanes * _channel_vectors(isa)
    k = p["C"] * p["KH"] * p["KW"]
    pix = _round_up(p["OH"] * p["OW"], PIXELS)
    tiles = (pix // PIXELS) * (_round_up(p["M"], nr) // nr)
    return {"conv2d_first": p["N"] * (pix * _round_up(p["M"], nr) * k + tiles * (TILE_COST + 2 * PIXELS * nr)
                                      + p["C"] * p["H"] * p["W"])}


def _foldable_transpose(g: ir.Graph, name: str) -> tuple[int, str] | None:
    """(step, NHWC graph input) when `name` is Transpose(perm 0,3,1,2) of a graph input read by
    nothing else."""
    node = g.producer(name)
    if node is None or node.op != "Transpose" or list(node.attrs.get("perm", [])) != NCHW_TO_NHWC:
        return None
    src = node.inputs[0]
    if src not in g.inputs or name in g.outputs or not g.single_consumer(name):
        return None
    return g.nodes.index(node), src


def select_first(g: ir.Graph, step: int, kern: Kernel, target) -> Kernel:
    p = dict(kern.params)
    consts = dict(kern.consts)
    isa = _isa("conv2d_first", target)
    vw, nv = get_isa(isa).lanes, _channel_vectors(isa)
    # NEON, stride 1, rows of whole vectors: 4 pixels of a row in the lanes x 16 channels
    lanes = isa == "neon" and p["SW"] == 1 and p["OW"] % LANE_PIXELS == 0
    if lanes:
        nv = LANE_CHANNELS // vw
    nr = vw * nv
    m, c, kh, kw = p["M"], p["C"], p["KH"], p["KW"]
    mp = _round_up(m, nr)
    w = kern.tensor(kern.args[1], g).data.astype(np.float32)              # [M][C][KH][KW]
    packed = np.zeros((mp, kh, kw, c), np.float32)
    packed[:m] = w.transpose(0, 2, 3, 1)
    packed = np.ascontiguousarray(packed.reshape(mp // nr, nr, kh, kw, c).transpose(0, 2, 3, 4, 1)).reshape(-1)
    args = [kern.args[0], _add_const(g, consts, kern.args[-1] + "_weight_packed", packed)]
    if p["has_bias"]:
        bias = np.zeros(mp, np.float32)
        bias[:m] = kern.tensor(kern.args[2], g).data.astype(np.float32).reshape(-1)
        args.append(_add_const(g, consts, kern.args[-1] + "_bias_padded", bias))
    args += [kern.args[-1], scratch_arg(step)]
    fold = _foldable_transpose(g, kern.args[0])
    if fold is not None:
        args[0] = fold[1]
    # the padded copy: exactly the rows and columns the taps reach
    hpd = (p["OH"] - 1) * p["SH"] + (kh - 1) * p["DH"] + 1
    wpd = (p["OW"] - 1) * p["SW"] + (kw - 1) * p["DW"] + 1
    nhwc = fold is not None
    rs, cs, cc = (wpd * c, c, 1) if nhwc else (wpd, 1, hpd * wpd)
    p.update(algo="conv2d_first", isa=isa, VW=vw, NV=nv, NR=nr, MP=mp, PX=LANE_PIXELS if lanes else PIXELS,
             LANES=lanes, NHWC=nhwc, HPD=hpd, WPD=wpd,
             RS=rs, CS=cs, CC=cc, FOLDED=fold[0] if fold else None,
             OFFS=[kx * p["DW"] * cs + ch * cc for kx in range(kw) for ch in range(c)])
    desc = (f"[conv2d_first {isa} {p['PX']} pixels{' in lanes' if lanes else ''} x {nr} channels"
            f"{', NHWC input: transpose folded' if nhwc else ''}] "
            f"{kern.desc}")
    return Kernel("conv2d_first", kern.dtype, p, args, 4 * c * hpd * wpd, desc, consts=consts)   # one image at a time


def drop_folded(kernels: list[Kernel | None]) -> list[Kernel | None]:
    """The Transposes a first-layer kernel reads through: no kernel of their own."""
    folded = {k.params["FOLDED"] for k in kernels if k is not None and k.params.get("FOLDED") is not None}
    return [None if s in folded else k for s, k in enumerate(kernels)]
