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
import re

import numpy as np

from tinydeploy import ir
from tinydeploy.schedule import tuning
from tinydeploy.codegen import kernels as kreg
from tinydeploy.ops import Kernel
from tinydeploy.ops.registry import new_const, scratch_arg
from tinydeploy.schedule.mcu import select_mcu
from tinydeploy.targets.isa import get_isa

def _tiles(isa: str) -> tuple[tuple[int, int, float], ...]:
    """The register tiles of an ISA's GEMM micro-kernels (targets/isa.py)."""
    return get_isa(isa).tiles


def ranked_tiles(isa: str, rows: int, cols: int) -> list[tuple[int, int]]:
    """The ISA's tiles, least estimated cost first for a rows x cols output (padding + edge tiles)."""
    def cost(t):
        mr, nr, eff = t
        full = _round_up(rows, mr) * _round_up(cols, nr) * eff
        edges = (rows % mr != 0) * (cols // nr + 1) + (cols % nr != 0) * (rows // mr + 1)
        return full + edges * mr * nr
    return [(mr, nr) for mr, nr, _ in sorted(_tiles(isa), key=cost)]


def pick_tile(isa: str, rows: int, cols: int, choice: dict | None = None) -> tuple[int, int]:
    """The tile with the least estimated cost, or the tuned `choice`'s when it is one of the ISA's."""
    forced = os.environ.get("TINYDEPLOY_TILE", "")      # e.g. "8x32": experiments and tests
    if forced:
        mr, nr = (int(v) for v in forced.lower().split("x"))
        return mr, nr
    if choice and choice.get("tile") and tuple(choice["tile"]) in {t[:2] for t in _tiles(isa)}:
        return tuple(choice["tile"])
    return ranked_tiles(isa, rows, cols)[0]

# Cost model, in units of one micro-kernel multiply-accumulate (on padded tiles); measured
# roughly on the host (AVX-512 / AVX2) with single layers of ResNet-8 and ResNet-50.
PACK_COST = 11.0         # per im2col element gathered into the panels
COPY_COST = 3.0          # per activation element copied (1x1 packing, padded planes)
GATHER_COST = 6.0        # per element gathered with a stride (phase planes of a strided conv)
TILE_COST = 40.0         # per micro-tile call (C tile load/store, loop, epilogue)
GEMMT_MAX_K = 2048       # conv2d_gemmt keeps K in one block: MR x K and K x NR panels in L2 (2048: ResNet-50 stage 4, measured 1.7x in the network)
IGEMM_MAX_TAPS = 49      # taps are unrolled in the implicit micro-kernel
IGEMM_L2_PENALTY = 0.0    # measured: no visible slowdown up to 256 channels (ResNet-50 14x14)
IM2COL_FACTOR = 1.15      # micro-kernel MACs of an im2col GEMM vs a 1x1 one (measured, ResNet-50)
MIN_MACS = 4096          # below this a layer keeps the reference kernel


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def blocking(target, mr: int, nr: int, k: int, rows: int, cols: int) -> tuple[int, int, int]:
    """(kc, mc, nc): a kc x NR micro-panel of B takes about half of L1, an mc x kc block of A
    about half of L2, a kc x nc packed block of B an eighth of L2 (it is scratch in the arena)."""
    l1 = int(getattr(target, "l1d_bytes", 32768) or 32768)
    l2 = int(getattr(target, "l2_bytes", 524288) or 524288)
    kc = max(32, min(1024, (l1 // 2) // (nr * 4) // 8 * 8))
    blocks = -(-k // kc)
    kc = min(k, _round_up(-(-k // blocks), 4))           # equal blocks, no tiny tail block
    mc = max(mr, (l2 // 2) // (kc * 4) // mr * mr)
    mc = min(mc, _round_up(rows, mr))
    nc = max(2 * nr, (l2 // 8) // (kc * 4) // nr * nr)
    nc = min(nc, _round_up(cols, nr))
    return kc, mc, nc


def tuned_blocking(target, mr: int, nr: int, k: int, rows: int, cols: int, choice: dict | None):
    """blocking(), or the tuned `choice`'s (kc, mc, nc) made valid for this layer and tile."""
    if not (choice and choice.get("blocking")):
        return blocking(target, mr, nr, k, rows, cols)
    kc, mc, nc = choice["blocking"]
    return (max(1, min(k, _round_up(kc, 4))), max(mr, min(_round_up(rows, mr), mc // mr * mr)),
            max(nr, min(_round_up(cols, nr), nc // nr * nr)))


def _algo_env() -> str:
    return os.environ.get("TINYDEPLOY_ALGO", "auto").strip() or "auto"


def _isa(family: str, target) -> str:
    _, isa = kreg.resolve(family, "f32", list(target.isas))
    return isa


def _add_const(g: ir.Graph, consts: dict, base: str, data: np.ndarray) -> str:
    """A float32 constant of the kernel being made (its `consts`), under a fresh name."""
    return new_const(g, consts, base, np.asarray(data, np.float32))


# ---- convolution ---------------------------------------------------------------------------

def _igemm_geometry(p: dict) -> tuple[int, int, list[tuple[int, int]], list[int]]:
    """(HP, WP, phases, tap offsets) of conv2d_igemm's zero-padded planes: one set of C/G planes
    per stride phase (py, px) some tap uses; tap (ky, kx) reads phase ((ky*DH) % SH, (kx*DW) % SW)
    at row (ky*DH) // SH, column (kx*DW) // SW of the padded-flat output index."""
    sh, sw, dh, dw = p["SH"], p["SW"], p["DH"], p["DW"]
    hp = p["OH"] + (p["KH"] - 1) * dh // sh
    wp = p["OW"] + (p["KW"] - 1) * dw // sw
    taps = [(ky * dh, kx * dw) for ky in range(p["KH"]) for kx in range(p["KW"])]
    phases = sorted({(ty % sh, tx % sw) for ty, tx in taps})
    plane_set = (p["C"] // p["G"]) * hp * wp
    offs = [phases.index((ty % sh, tx % sw)) * plane_set + (ty // sh) * wp + tx // sw for ty, tx in taps]
    return hp, wp, phases, offs


def conv_costs(p: dict, isa: str, l1: int = 32768, l2: int = 524288) -> dict[str, float]:
    """Estimated time of each applicable algorithm, in micro-kernel MACs."""
    G, C, M = p["G"], p["C"], p["M"]
    mg, cg, k = M // G, C // G, (C // G) * p["KH"] * p["KW"]
    cols = p["OH"] * p["OW"]
    macs = p["N"] * M * cols * k
    out = {"ref": macs * get_isa(isa).ref_cost}
    mr, nr = pick_tile(isa, mg, cols)
    direct = p["KH"] == p["KW"] == p["SH"] == p["SW"] == 1 and p["PT"] == p["PL"] == 0
    padded = _round_up(mg, mr) * _round_up(cols, nr) * k
    tiles = (_round_up(mg, mr) // mr) * (_round_up(cols, nr) // nr)
    out["conv2d_gemm"] = p["N"] * G * (padded * (1.0 if direct else IM2COL_FACTOR)
                                       + k * cols * (COPY_COST if direct else PACK_COST) + tiles * TILE_COST)
    if direct and G == 1 and k <= GEMMT_MAX_K:      # transposed 1x1 GEMM: K in one block
        mr, nr = pick_tile(isa, cols, mg)
        padded = _round_up(cols, mr) * _round_up(mg, nr) * k
        tiles = (_round_up(cols, mr) // mr) * (_round_up(mg, nr) // nr)
        out["conv2d_gemmt"] = p["N"] * (padded + k * cols * GATHER_COST + tiles * (TILE_COST + 2 * mr * nr))
    if p["KH"] * p["KW"] <= IGEMM_MAX_TAPS:
        hp, wp, phases, _ = _igemm_geometry(p)
        mr, nr = pick_tile(isa, mg, p["OH"] * wp)
        padded = _round_up(mg, mr) * _round_up(p["OH"] * wp, nr) * k
        tiles = (_round_up(mg, mr) // mr) * (_round_up(p["OH"] * wp, nr) // nr)
        # B is read from the padded planes: past L1 (many input channels) the loads slow down
        spill = 1.0 + IGEMM_L2_PENALTY * (cg * (nr + (p["KH"] - 1) * p["DH"] * wp + p["KW"]) * 4 > l1 // 2)
        copy = cg * hp * wp * len(phases) * (COPY_COST if p["SW"] == 1 else GATHER_COST)
        out["conv2d_igemm"] = p["N"] * G * (padded * spill + copy + tiles * (TILE_COST + mr * nr))
    if winograd_applies(p) and not (G == C and G > 1):
        out.update(winograd_costs(p, isa, l2))
    return out


def is_depthwise(p: dict) -> bool:
    """One group per input channel, each with a whole number of output channels (conv2d_dw)."""
    return p["G"] == p["C"] > 1 and p["M"] % p["C"] == 0


def conv_choice(p: dict, isa: str, force: str, l1: int = 32768, l2: int = 524288) -> str:
    """Algorithm for one conv layer (params from ops.conv.conv_geometry)."""
    G, C, M = p["G"], p["C"], p["M"]
    depthwise = is_depthwise(p)
    if force == "ref":
        return "ref"
    if force == "conv2d_dw":
        return "conv2d_dw" if depthwise else "ref"
    costs = conv_costs(p, isa, l1, l2)
    if force in ("conv2d_gemm", "conv2d_igemm", "conv2d_gemmt", "conv2d_winograd2", "conv2d_winograd4"):
        return force if force in costs else "conv2d_gemm"
    macs = p["N"] * M * p["OH"] * p["OW"] * (C // G) * p["KH"] * p["KW"]
    if macs < MIN_MACS:
        return "ref"
    if depthwise:
        return "conv2d_dw"
    return min(costs, key=costs.get)


def _epilogue(g: ir.Graph, kern: Kernel, p: dict, mr: int, args: list[str], consts: dict) -> dict:
    """Fused-epilogue parameters; with a bias, args[2] becomes the bias padded to MR rows per group."""
    vact = p["activation"].vector_steps()
    if vact is None:
        return {"on": False, "bias": False, "act": p["act"], "vact": []}
    if p["has_bias"]:
        G, mg = p["G"], p["M"] // p["G"]
        mp = _round_up(mg, mr)
        bias = np.zeros((G, mp), np.float32)
        bias[:, :mg] = kern.tensor(kern.args[2], g).data.astype(np.float32).reshape(G, mg)
        args[2] = _add_const(g, consts, kern.args[-1] + "_bias_padded", bias.reshape(-1))
    return {"on": True, "bias": bool(p["has_bias"]), "act": p["act"], "vact": vact}


def _pack_conv_weights(w: np.ndarray, G: int, mr: int) -> np.ndarray:
    """[M][C/G][KH][KW] -> per group, panels of MR output channels: [G][Mp/MR][K][MR], zeros in
    the padding rows."""
    m = w.shape[0]
    mg, k = m // G, int(np.prod(w.shape[1:]))
    mp = _round_up(mg, mr)
    a = np.zeros((G, mp, k), np.float32)
    a[:, :mg, :] = w.reshape(G, mg, k)
    return np.ascontiguousarray(a.reshape(G, mp // mr, mr, k).transpose(0, 1, 3, 2)).reshape(-1)


def _select_conv(g: ir.Graph, step: int, kern: Kernel, target, force: str, choice: dict | None = None) -> Kernel:
    p = dict(kern.params)
    consts = dict(kern.consts)      # the generic kernel's own, and what this one adds
    algo = conv_choice(p, _isa("conv2d_gemm", target), choice["algo"] if choice else force,
                       int(getattr(target, "l1d_bytes", 32768)), int(getattr(target, "l2_bytes", 524288)))
    if algo == "conv2d_dw":
        isa = _isa("conv2d_dw", target)
        p.update(algo=algo, MULT=p["M"] // p["C"])
        hp = (p["OH"] - 1) * p["SH"] + (p["KH"] - 1) * p["DH"] + 1
        wp = (p["OW"] - 1) * p["SW"] + (p["KW"] - 1) * p["DW"] + 1
        planes, flat = hp * wp, 0
        if p["SH"] == p["SW"] == 1:
            flat = _round_up((p["OH"] - 1) * wp + p["OW"], 16)
        elif p["SH"] == p["SW"] == 2 and p["DH"] == p["DW"] == 1:    # 4 phase planes
            planes = 4 * ((hp + 1) // 2) * ((wp + 1) // 2)
            flat = _round_up((p["OH"] - 1) * ((wp + 1) // 2) + p["OW"], 16)
        scratch = 4 * (planes + 2 * flat)      # planes, zero slack, flat accumulator
        args = list(kern.args) + [scratch_arg(step)]
        return Kernel("conv2d_dw", kern.dtype, p, args, scratch, f"[conv2d_dw {isa}] {kern.desc}", consts=consts)
    if algo == "conv2d_igemm":
        return _select_igemm(g, step, kern, target, choice)
    if algo == "conv2d_gemmt":
        return _select_gemmt(g, step, kern, target, choice)
    if algo.startswith("conv2d_winograd"):
        return _select_winograd(g, step, kern, target, algo)
    if algo != "conv2d_gemm":
        kern.params = dict(kern.params, algo="ref")
        kern.desc = f"[ref direct] {kern.desc}"
        return kern
    isa = _isa("conv2d_gemm", target)
    G = p["G"]
    mg, k, cols = p["M"] // G, (p["C"] // G) * p["KH"] * p["KW"], p["OH"] * p["OW"]
    mr, nr = pick_tile(isa, mg, cols, choice)
    kc, mc, nc = tuned_blocking(target, mr, nr, k, mg, cols, choice)
    direct = p["KH"] == p["KW"] == p["SH"] == p["SW"] == 1 and p["PT"] == p["PL"] == 0
    w = kern.tensor(kern.args[1], g).data.astype(np.float32)
    wname = _add_const(g, consts, kern.args[-1] + "_weight_packed", _pack_conv_weights(w, G, mr))
    panel_floats = kc * _round_up(nc, nr)
    row_floats = 0 if direct else _round_up(nc, 16)
    scratch = 4 * (panel_floats + row_floats)
    args = [kern.args[0], wname] + kern.args[2:] + [scratch_arg(step)]
    p["E"] = _epilogue(g, kern, p, mr, args, consts)
    p.update(algo=algo, isa=isa, MR=mr, NR=nr, KC=kc, MC=mc, NC=nc, K=k, MG=mg, CG=p["C"] // G,
             MP=_round_up(mg, mr), P=cols, DIRECT=direct, ROWOFF=panel_floats)
    desc = f"[conv2d_gemm {isa} {mr}x{nr} kc {kc} mc {mc} nc {nc}{' direct' if direct else ' im2col'}] {kern.desc}"
    return Kernel("conv2d_gemm", kern.dtype, p, args, scratch, desc, consts=consts)


def _select_gemmt(g: ir.Graph, step: int, kern: Kernel, target, choice: dict | None = None) -> Kernel:
    p = dict(kern.params)
    consts = dict(kern.consts)      # the generic kernel's own, and what this one adds
    isa = _isa("conv2d_gemmt", target)
    k, m, cols = p["C"], p["M"], p["OH"] * p["OW"]
    mr, nr = pick_tile(isa, cols, m, choice)
    w = kern.tensor(kern.args[1], g).data.astype(np.float32).reshape(m, k)
    mp = _round_up(m, nr)
    b = np.zeros((mp, k), np.float32)
    b[:m] = w
    packed = np.ascontiguousarray(b.reshape(mp // nr, nr, k).transpose(0, 2, 1)).reshape(-1)   # [M/NR][K][NR]
    wname = _add_const(g, consts, kern.args[-1] + "_weight_packed", packed)
    scratch = 4 * _round_up(cols, mr) * k
    args = [kern.args[0], wname] + kern.args[2:] + [scratch_arg(step)]
    p.update(algo="conv2d_gemmt", isa=isa, MR=mr, NR=nr, K=k, P=cols)
    desc = f"[conv2d_gemmt {isa} {mr}x{nr} positions x channels] {kern.desc}"
    return Kernel("conv2d_gemmt", kern.dtype, p, args, scratch, desc, consts=consts)


def _select_igemm(g: ir.Graph, step: int, kern: Kernel, target, choice: dict | None = None) -> Kernel:
    p = dict(kern.params)
    consts = dict(kern.consts)      # the generic kernel's own, and what this one adds
    isa = _isa("conv2d_igemm", target)
    G = p["G"]
    mg, cg = p["M"] // G, p["C"] // G
    k = cg * p["KH"] * p["KW"]
    hp, wp, phases, offs = _igemm_geometry(p)
    mr, nr = pick_tile(isa, mg, p["OH"] * wp, choice)
    w = kern.tensor(kern.args[1], g).data.astype(np.float32)
    wname = _add_const(g, consts, kern.args[-1] + "_weight_packed", _pack_conv_weights(w, G, mr))
    slack = _round_up(nr + (p["KW"] - 1) * p["DW"] + 16, 16)   # tiles past the last row read here
    scratch = 4 * (len(phases) * cg * hp * wp + slack)
    args = [kern.args[0], wname] + kern.args[2:] + [scratch_arg(step)]
    p["E"] = _epilogue(g, kern, p, mr, args, consts)
    sw = p["SW"]
    ph = []
    for py, px in phases:       # columns j of a plane row that come from the image: [lo, hi)
        lo = min(max(0, -(-(p["PL"] - px) // sw)), wp)
        hi = max(min(wp, -(-(p["W"] + p["PL"] - px) // sw)), lo)
        ph.append({"py": py, "px": px, "lo": lo, "hi": hi})
    p.update(algo="conv2d_igemm", isa=isa, MR=mr, NR=nr, K=k, MG=mg, CG=cg, MP=_round_up(mg, mr),
             HP=hp, WP=wp, OFFS=offs, SLACK=slack, PHASES=ph)
    desc = f"[conv2d_igemm {isa} {mr}x{nr} {len(phases)} x {hp}x{wp} planes] {kern.desc}"
    return Kernel("conv2d_igemm", kern.dtype, p, args, scratch, desc, consts=consts)


# ---- Winograd convolution ------------------------------------------------------------------

# F(m x m, 3 x 3) (Lavin & Gray): Y = A^T [(G g G^T) * (B^T d B)] A over m x m output tiles read
# from (m+2) x (m+2) input patches. Interpolation points 0, -1, 1 (and -2, 2 for m = 4), inf.
WINOGRAD = {
    2: {"G": [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]],
        "BT": [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        "AT": [[1, 1, 1, 0], [0, 1, -1, -1]]},
    4: {"G": [[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6], [1 / 24, 1 / 12, 1 / 6],
              [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]],
        "BT": [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
               [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]],
        "AT": [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]},
}
# Measured on the host (Zen, AVX-512) with single layers and whole ResNet-18/50 (bench): in a
# deep network the weights come from memory, so when U exceeds L2, every pass over it beyond the
# direct weights' size costs WINO_MEM_COST (it rules out 512-channel 7x7 layers).
WINO_IN_COST = 10.0      # per element of V made by the input transform (rows, gather, B^T d B)
WINO_OUT_COST = 10.0     # per element of M read by the output transform (A^T M A, bias, act, store)
WINO_U_COST = 3.0        # per element of U streamed by each further block of tiles (from L2)
WINO_MEM_COST = 45.0     # per element of U read beyond the direct weights, when U exceeds L2


def winograd_applies(p: dict) -> bool:
    return p["KH"] == p["KW"] == 3 and p["SH"] == p["SW"] == p["DH"] == p["DW"] == 1


def _winograd_tile(isa: str, mg: int, tiles: int) -> tuple[int, int]:
    """The least padded tile: the GEMMs only see full tiles (no edge penalty as in pick_tile)."""
    if os.environ.get("TINYDEPLOY_TILE"):
        return pick_tile(isa, mg, tiles)
    mr, nr, _ = min(_tiles(isa), key=lambda t: _round_up(mg, t[0]) * _round_up(tiles, t[1]) * t[2])
    return mr, nr


def _winograd_plan(p: dict, wm: int, mr: int, nr: int, l2: int) -> dict:
    """Tiles and blocking of conv2d_winograd: NB tiles per block (a multiple of NR) with V and M
    ([WT*WT][CG][NB] and [WT*WT][MP][NB]) in a quarter of L2 (scratch in the arena), at least
    one NR panel; the matrices' strides VXS / MXS in floats."""
    wt = wm + 2
    th, tw = -(-p["OH"] // wm), -(-p["OW"] // wm)
    tiles = th * tw
    cg, mp = p["C"] // p["G"], _round_up(p["M"] // p["G"], mr)
    per_tile = wt * wt * (cg + mp) * 4
    nb = min(_round_up(tiles, nr), max(nr, (l2 // 4) // per_tile // nr * nr))
    rows = [(min(q + nb, tiles) - 1) // tw - q // tw + 1 for q in range(0, tiles, nb)]   # of tiles
    strip = max(max(rows) * tw, tw - 1 + nb)       # tiles per S/O strip (lanes past a block too)
    return {"WM": wm, "WT": wt, "TH": th, "TW": tw, "TILES": tiles, "NB": nb,
            "VXS": cg * nb + 16, "MXS": mp * nb + 16,     # skewed: no cache-set conflicts
            "SLEN": strip * wm, "OLEN": strip * 2, "WPAD": tw * wm + 2, "BLOCKS": len(rows)}


def winograd_costs(p: dict, isa: str, l2: int = 524288) -> dict[str, float]:
    """conv2d_winograd2 / conv2d_winograd4 in micro-kernel MACs: the WT*WT GEMMs on padded
    tiles, both transforms, and U read once per block of tiles."""
    out = {}
    cg, mg = p["C"] // p["G"], p["M"] // p["G"]
    for wm in (2, 4):
        mr, nr = _winograd_tile(isa, mg, -(-p["OH"] // wm) * -(-p["OW"] // wm))
        q = _winograd_plan(p, wm, mr, nr, l2)
        t2, cols = q["WT"] ** 2, q["BLOCKS"] * q["NB"]
        mp = _round_up(mg, mr)
        gemm = t2 * mp * cols * cg + t2 * (mp // mr) * (cols // nr) * TILE_COST
        transforms = t2 * cols * cg * WINO_IN_COST + t2 * q["TILES"] * mg * WINO_OUT_COST
        u = t2 * mp * cg
        if u * 4 > l2:      # every pass over U from memory (L3 or DRAM), less what a direct conv reads
            stream = (q["BLOCKS"] * u - 9 * mg * cg) * WINO_MEM_COST
        else:
            stream = (q["BLOCKS"] - 1) * u * WINO_U_COST
        out[f"conv2d_winograd{wm}"] = p["N"] * p["G"] * (gemm + transforms + stream)
    return out


def winograd_filters(w: np.ndarray, G: int, wm: int, mr: int) -> np.ndarray:
    """[M][C/G][3][3] -> U = G g G^T, computed in float64, packed for the micro-kernel as
    [G][WT*WT][MP/MR][C/G][MR] (zero rows up to MP), float32."""
    gm = np.array(WINOGRAD[wm]["G"], np.float64)
    u = np.einsum("ik,mckl,jl->ijmc", gm, w.astype(np.float64), gm)          # [WT][WT][M][C/G]
    wt, m, cg = gm.shape[0], w.shape[0], w.shape[1]
    mg, mp = m // G, _round_up(m // G, mr)
    a = np.zeros((G, wt * wt, mp, cg), np.float64)
    a[:, :, :mg, :] = u.reshape(wt * wt, G, mg, cg).transpose(1, 0, 2, 3)
    a = a.reshape(G, wt * wt, mp // mr, mr, cg).transpose(0, 1, 2, 4, 3)
    return np.ascontiguousarray(a, np.float32).reshape(-1)


def _select_winograd(g: ir.Graph, step: int, kern: Kernel, target, algo: str) -> Kernel:
    p = dict(kern.params)
    consts = dict(kern.consts)      # the generic kernel's own, and what this one adds
    isa = _isa("conv2d_winograd", target)
    wm = int(algo[-1])
    cg, mg = p["C"] // p["G"], p["M"] // p["G"]
    mr, nr = _winograd_tile(isa, mg, -(-p["OH"] // wm) * -(-p["OW"] // wm))
    q = _winograd_plan(p, wm, mr, nr, int(getattr(target, "l2_bytes", 524288) or 524288))
    kc = blocking(target, mr, nr, cg, mg, q["NB"])[0]
    vl = next(v for v in (get_isa(isa).winograd_lanes, 8, 4, 2, 1) if nr % v == 0)
    w = kern.tensor(kern.args[1], g).data.astype(np.float32)
    wname = _add_const(g, consts, kern.args[-1] + f"_winograd{wm}", winograd_filters(w, p["G"], wm, mr))
    mp = _round_up(mg, mr)
    scratch = 4 * (q["WT"] ** 2 * (q["VXS"] + q["MXS"]) + q["WT"] * (q["SLEN"] + q["OLEN"]) + q["WPAD"])
    args = [kern.args[0], wname] + kern.args[2:] + [scratch_arg(step)]
    p.update(q, algo=algo, isa=isa, MR=mr, NR=nr, KC=kc, MG=mg, CG=cg, MP=mp, VL=vl,
             BT=WINOGRAD[wm]["BT"], AT=WINOGRAD[wm]["AT"])
    desc = (f"[{algo} {isa} {mr}x{nr} F({wm}x{wm},3x3) {q['TILES']} tiles, {q['NB']} per block] "
            f"{kern.desc}")
    return Kernel("conv2d_winograd", kern.dtype, p, args, scratch, desc, consts=consts)


# ---- fully connected -----------------------------------------------------------------------

def dense_choice(p: dict, isa: str, force: str) -> str:
    if force == "ref":
        return "ref"
    if force == "dense_packed":
        return "dense_packed"
    mr, nr = pick_tile(isa, p["M"], p["N"])
    macs = p["M"] * p["K"] * p["N"]
    if macs < MIN_MACS or p["M"] < max(2, mr // 2):
        return "ref"      # a matrix-vector product: memory bound, the reference streams it
    return "dense_packed"


def _select_dense(g: ir.Graph, step: int, kern: Kernel, target, force: str, choice: dict | None = None) -> Kernel:
    p = dict(kern.params)
    consts = dict(kern.consts)      # the generic kernel's own, and what this one adds
    isa = _isa("dense_packed", target)
    if dense_choice(p, isa, choice["algo"] if choice else force) != "dense_packed" or kern.tensor(kern.args[1], g).data is None:
        kern.params = dict(kern.params, algo="ref")
        kern.desc = f"[ref direct] {kern.desc}"
        return kern
    m, k, n = p["M"], p["K"], p["N"]
    mr, nr = pick_tile(isa, m, n, choice)
    kc, mc, nc = tuned_blocking(target, mr, nr, k, m, n, choice)
    w = kern.tensor(kern.args[1], g).data.astype(np.float32)              # [K][N]
    np_ = _round_up(n, nr)
    b = np.zeros((k, np_), np.float32)
    b[:, :n] = w
    packed = np.ascontiguousarray(b.reshape(k, np_ // nr, nr).transpose(1, 0, 2)).reshape(-1)
    wname = _add_const(g, consts, kern.args[-1] + "_weight_packed", packed)
    scratch = 4 * kc * _round_up(mc, mr)
    args = [kern.args[0], wname] + kern.args[2:] + [scratch_arg(step)]
    p.update(algo="dense_packed", isa=isa, MR=mr, NR=nr, KC=kc, MC=mc, NC=nc)
    desc = f"[dense_packed {isa} {mr}x{nr} kc {kc} mc {mc} nc {nc}] {kern.desc}"
    return Kernel("dense_packed", kern.dtype, p, args, scratch, desc, consts=consts)


# ---- threads --------------------------------------------------------------------------------

MIN_THREAD_MACS = 65536     # least work per thread worth an OpenMP fork/join (a few microseconds)
THREADED = ("conv2d_gemm", "conv2d_igemm", "conv2d_gemmt", "conv2d_dw", "dense_packed")
_PER_THREAD_SCRATCH = ("conv2d_gemm", "conv2d_dw", "dense_packed")   # the others share theirs


def parallel_blocks(k: Kernel) -> int:
    """Blocks of a fast layer its threaded driver can hand to different threads: NR-column panels
    (conv2d_gemm, dense_packed), MR x NR output tiles (conv2d_igemm, conv2d_gemmt), channels
    (conv2d_dw)."""
    p, f = k.params, k.family
    if f == "conv2d_gemm":
        return -(-p["P"] // p["NR"])
    if f == "dense_packed":
        return -(-p["N"] // p["NR"])
    if f == "conv2d_igemm":
        return -(-p["OH"] * p["WP"] // p["NR"]) * -(-p["MG"] // p["MR"])
    if f == "conv2d_gemmt":
        return -(-p["M"] // p["NR"]) * -(-p["P"] // p["MR"])
    return p["N"] * p["M"] if f == "conv2d_dw" else 1


def parallelise(g: ir.Graph, step: int, k: Kernel | None, threads: int) -> Kernel | None:
    """Layer `step` on min(blocks, threads, MACs / MIN_THREAD_MACS) threads (see the docstring)."""
    if threads <= 1 or k is None or k.family not in THREADED:
        return k
    p = dict(k.params)
    macs = p["M"] * p["K"] * p["N"] if k.family == "dense_packed" else \
        p["N"] * p["M"] * p["OH"] * p["OW"] * (p["C"] // p["G"]) * p["KH"] * p["KW"]
    t = min(threads, parallel_blocks(k), macs // MIN_THREAD_MACS)
    if t <= 1:
        return k
    p["THREADS"] = t
    per, desc, args, scratch = k.scratch_bytes // 4, k.desc, list(k.args), k.scratch_bytes
    if k.family == "conv2d_gemm":       # a thread packs at most its own share of the columns
        nc = min(p["NC"], -(-parallel_blocks(k) // t) * p["NR"])
        p.update(NC=nc, ROWOFF=p["KC"] * nc)
        per = p["KC"] * nc + (0 if p["DIRECT"] else _round_up(nc, 16))
        desc = re.sub(r" nc \d+", f" nc {nc}", desc, count=1)
    if k.family in _PER_THREAD_SCRATCH:
        p["WST"] = _round_up(per, 16)   # one slice per thread, on cache lines of its own
        scratch = 4 * t * p["WST"]
        args[-1] = scratch_arg(step)
    return Kernel(k.family, k.dtype, p, args, scratch, desc.replace("] ", f" threads {t}] ", 1), consts=k.consts,
                  scratch_dtype=k.scratch_dtype)


def select_kernels(g: ir.Graph, kernels: list[Kernel | None], target, threads: int = 1) -> list[Kernel | None]:
    """Replace generic fp32 conv2d/dense kernels by faster algorithms where the cost model says
    so; with threads > 1, spread each fast layer over up to that many threads."""
    force = _algo_env()
    # microcontrollers: weights packed for the DSP extension (8-bit) and the FPU (fp32) kernels
    kernels = select_mcu(g, kernels, target)
    if not target.caches and force == "auto":
        # cores without a data cache to block for (microcontrollers), where RAM matters more:
        # depthwise fp32 convolutions take the padded-plane kernel (one plane of scratch)
        return [_select_conv(g, s, k, target, "conv2d_dw")
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
        if k is not None and k.dtype == "f32" and k.family in ("conv2d", "dense"):
            choice = forced if forced is not None else db.get(tuning.layer_signature(k)) if db else None
            if k.family == "conv2d":
                k = _select_conv(g, step, k, target, force, choice)
            else:
                k = _select_dense(g, step, k, target, force, choice)
            if choice is not None:
                k.desc = k.desc.replace("] ", " tuned] " if forced is None else " candidate] ", 1)
        out.append(parallelise(g, step, k, threads))
    return out


def selection_state(target) -> str:
    """What the selection depends on besides the model, for build keys (see tuning.state)."""
    return tuning.state(tuning.target_key(target, _isa("conv2d_gemm", target)))


def describe(kernels: list[Kernel | None], fast_only: bool = False) -> list[str]:
    """One line per selected layer: '<step>: <algorithm desc>' (for `tinydeploy build`);
    fast_only leaves out the layers that kept the reference kernel."""
    return [f"{i}: {k.desc}" for i, k in enumerate(kernels)
            if k is not None and "algo" in k.params and not (fast_only and k.params["algo"] == "ref")]
