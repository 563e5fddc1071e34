"""Convolutions: the cost of each algorithm for a layer, the choice, and the planners of
conv2d_gemm (packed GEMM), conv2d_igemm (implicit GEMM), conv2d_gemmt (transposed 1x1 GEMM) and
conv2d_dw (depthwise); Winograd in winograd.py."""
from __future__ import annotations


import numpy as np

from tinydeploy import ir
from tinydeploy.ops import Kernel
from tinydeploy.ops.registry import scratch_arg
from tinydeploy.targets.isa import get_isa
from tinydeploy.schedule.cost import (COPY_COST, GATHER_COST, GEMMT_MAX_K, IGEMM_L2_PENALTY, IGEMM_MAX_TAPS,
                                      IM2COL_FACTOR, MIN_MACS, PACK_COST, TILE_COST, _add_const, _isa, _round_up,
                                      pick_tile, tuned_blocking)
from tinydeploy.schedule.winograd import _select_winograd, winograd_applies, winograd_costs


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


def dw_scratch_bytes(p: dict) -> int:
    """Scratch of the fp32 depthwise kernel (conv2d_dw_f32_ref.c.j2): the padded plane (stride 2:
    4 phase planes), zero slack, the flat accumulator."""
    hp = (p["OH"] - 1) * p["SH"] + (p["KH"] - 1) * p["DH"] + 1
    wp = (p["OW"] - 1) * p["SW"] + (p["KW"] - 1) * p["DW"] + 1
    planes, flat = hp * wp, 0
    if p["SH"] == p["SW"] == 1:
        flat = _round_up((p["OH"] - 1) * wp + p["OW"], 16)
    elif p["SH"] == p["SW"] == 2 and p["DH"] == p["DW"] == 1:    # 4 phase planes
        planes = 4 * ((hp + 1) // 2) * ((wp + 1) // 2)
        flat = _round_up((p["OH"] - 1) * ((wp + 1) // 2) + p["OW"], 16)
    return 4 * (planes + 2 * flat)      # planes, zero slack, flat accumulator


def _select_conv(g: ir.Graph, step: int, kern: Kernel, target, force: str, choice: dict | None = None) -> Kernel:
    p = dict(kern.params)
    consts = dict(kern.consts)      # the generic kernel's own, and what this one adds
    algo = conv_choice(p, _isa("conv2d_gemm", target), choice["algo"] if choice else force,
                       int(getattr(target, "l1d_bytes", 32768)), int(getattr(target, "l2_bytes", 524288)))
    if algo == "conv2d_dw":
        isa = _isa("conv2d_dw", target)
        p.update(algo=algo, MULT=p["M"] // p["C"])
        scratch = dw_scratch_bytes(p)
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
