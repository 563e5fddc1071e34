"""Fully connected layers with few rows (dense_gemv): the matrix-vector kernel on the same packed
weights as dense_packed (NR-column panels [N/NR][K][NR]), for every vector ISA, so no fp32 dense
layer of a SIMD target keeps the reference kernel (whose separate multiply and add gcc cannot
fuse under -std=c99: -ffp-contract=off). Panels are up to 8 vectors wide; narrower layers keep
KU sets of sums in flight instead (dense_gemv_f32.c.j2)."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.ops import Kernel
from tinydeploy.schedule.cost import _add_const, _round_up
from tinydeploy.targets.isa import get_isa

SUMS = 8        # vectors of sums in flight per panel (NV x KU)


def gemv_geometry(n: int, lanes: int) -> tuple[int, int]:
    """(NV vectors per panel, KU independent sums of each)."""
    nv = max(1, min(SUMS, -(-n // lanes)))
    return nv, max(1, SUMS // nv)


def select_gemv(g: ir.Graph, kern: Kernel, isa: str) -> Kernel:
    p = dict(kern.params)
    consts = dict(kern.consts)
    m, k, n = p["M"], p["K"], p["N"]
    vw = get_isa(isa).lanes
    nv, ku = gemv_geometry(n, vw)
    nr = nv * vw
    np_ = _round_up(n, nr)
    w = kern.tensor(kern.args[1], g).data.astype(np.float32)              # [K][N]
    b = np.zeros((k, np_), np.float32)
    b[:, :n] = w
    packed = np.ascontiguousarray(b.reshape(k, np_ // nr, nr).transpose(1, 0, 2)).reshape(-1)
    args = [kern.args[0], _add_const(g, consts, kern.args[-1] + "_weight_packed", packed)]
    rows = 1
    if p["has_bias"]:
        bias = kern.tensor(kern.args[2], g).data.astype(np.float32).reshape(-1, n)
        rows = bias.shape[0]
        padded = np.zeros((rows, np_), np.float32)
        padded[:, :n] = bias
        args.append(_add_const(g, consts, kern.args[-1] + "_bias_padded", padded.reshape(-1)))
    args.append(kern.args[-1])
    p.update(algo="dense_gemv", isa=isa, VW=vw, NV=nv, KU=ku, NR=nr, bias_rows=rows)
    desc = f"[dense_gemv {isa} {nr}-column panels, {ku} sums] {kern.desc}"
    return Kernel("dense_gemv", kern.dtype, p, args, 0, desc, consts=consts)
