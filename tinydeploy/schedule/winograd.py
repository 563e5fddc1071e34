"""Winograd convolution F(2x2,3x3) and F(4x4,3x3): when it applies, its cost, the filter
transform at build time, and the planner of conv2d_winograd."""
from __future__ import annotations

import os

import numpy as np

from tinydeploy import ir
from tinydeploy.ops import Kernel
from tinydeploy.ops.registry import scratch_arg
from tinydeploy.targets.isa import get_isa
from tinydeploy.schedule.cost import TILE_COST, _add_const, _isa, _round_up, _tiles, blocking, pick_tile


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
