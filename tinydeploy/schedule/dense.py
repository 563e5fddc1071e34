"""Fully connected layers: dense_packed (weights packed into NR-column panels at build time), the
matrix-vector kernel dense_gemv on the same panels for few rows (schedule/gemv.py), or, on
targets without a vector ISA, the reference kernel for those."""
from __future__ import annotations


import numpy as np

from tinydeploy import ir
from tinydeploy.ops import Kernel
from tinydeploy.ops.registry import scratch_arg
from tinydeploy.schedule.cost import MIN_MACS, _add_const, _isa, _round_up, pick_tile, tuned_blocking
from tinydeploy.schedule.gemv import select_gemv


def dense_choice(p: dict, isa: str, force: str) -> str:
    if force == "ref":
        return "ref"
    if force in ("dense_packed", "dense_gemv"):
        return force if force == "dense_packed" or isa != "ref" else "ref"
    mr, nr = pick_tile(isa, p["M"], p["N"])
    macs = p["M"] * p["K"] * p["N"]
    if p["M"] < max(2, mr // 2):
        # a matrix-vector product, memory bound: streamed once per row by the vector kernel (the
        # reference on targets without one)
        return "dense_gemv" if isa != "ref" else "ref"
    if macs < MIN_MACS and isa == "ref":
        return "ref"
    return "dense_packed"


def _select_dense(g: ir.Graph, step: int, kern: Kernel, target, force: str, choice: dict | None = None) -> Kernel:
    p = dict(kern.params)
    consts = dict(kern.consts)      # the generic kernel's own, and what this one adds
    isa = _isa("dense_packed", target)
    algo = dense_choice(p, isa, choice["algo"] if choice else force)
    if algo == "ref" or kern.tensor(kern.args[1], g).data is None:
        kern.params = dict(kern.params, algo="ref")
        kern.desc = f"[ref direct] {kern.desc}"
        return kern
    if algo == "dense_gemv":
        return select_gemv(g, kern, _isa("dense_gemv", target))
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
