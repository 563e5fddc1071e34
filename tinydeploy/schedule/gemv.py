"""Fully connected layers with few rows (dense_gemv): the matrix-vector kernel on weights packed at
build time into NR-column panels [K][NR] one after the other (zero-padded to whole vectors), for
every vector ISA, so no fp32 dense layer of a SIMD target keeps the reference kernel (whose
separate multiply and add gcc cannot fuse under -std=c99: -ffp-contract=off).
x86: panels are up to 8 vectors wide (the last one as wide as the others); narrower layers keep
KU sets of sums in flight instead. NEON: panels of up to 16 vectors, the last one only as wide as
its columns, streamed in 64-byte loads (dense_gemv_f32.c.j2)."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.ops import Kernel
from tinydeploy.schedule.cost import _add_const, _round_up
from tinydeploy.targets.isa import get_isa

SUMS = 8        # vectors of sums in flight per panel (NV x KU)
NEON_SUMS = 16  # NEON: 16 of its 32 vector registers hold sums, 4 the weights, 2 the input


def gemv_geometry(n: int, lanes: int, sums: int = SUMS) -> tuple[int, int]:
    """(NV vectors per panel, KU independent sums of each)."""
    nv = max(1, min(sums, -(-n // lanes)))
    return nv, max(1, sums // nv)


def _pack(w: np.ndarray, widths: list[int]) -> np.ndarray:
    """[K][N] weights as panels [K][width] one after the other, zero-padded past column N."""
    k, n = w.shape
    padded = np.zeros((k, sum(widths)), np.float32)
    padded[:, :n] = w
    cuts = np.cumsum([0] + widths)
    return np.concatenate([padded[:, a:b].reshape(-1) for a, b in zip(cuts[:-1], cuts[1:])])


def select_gemv(g: ir.Graph, kern: Kernel, isa: str) -> Kernel:
    p = dict(kern.params)
    consts = dict(kern.consts)
    m, k, n = p["M"], p["K"], p["N"]
    vw = get_isa(isa).lanes
    neon = isa == "neon"
    nv, ku = gemv_geometry(n, vw, NEON_SUMS if neon else SUMS)
    if neon:
        ku = 1
    nr = nv * vw
    tail = n % nr
    nvl = -(-tail // vw) if neon else nv                      # vectors of the last, partial panel
    widths = [nr] * (n // nr) + ([nvl * vw] if tail else [])
    np_ = sum(widths)
    w = kern.tensor(kern.args[1], g).data.astype(np.float32)              # [K][N]
    args = [kern.args[0], _add_const(g, consts, kern.args[-1] + "_weight_packed", _pack(w, widths))]
    rows = 1
    if p["has_bias"]:
        bias = kern.tensor(kern.args[2], g).data.astype(np.float32).reshape(-1, n)
        rows = bias.shape[0]
        padded = np.zeros((rows, np_), np.float32)
        padded[:, :n] = bias
        args.append(_add_const(g, consts, kern.args[-1] + "_bias_padded", padded.reshape(-1)))
    args.append(kern.args[-1])
    p.update(algo="dense_gemv", isa=isa, VW=vw, NV=nv, KU=ku, NR=nr, NVL=nvl, NP=np_, bias_rows=rows)
    desc = f"[dense_gemv {isa} {nr}-column panels, {ku} sums] {kern.desc}"
    return Kernel("dense_gemv", kern.dtype, p, args, 0, desc, consts=consts)
