"""--threads N: OpenMP over each fast layer's independent blocks, bit-identical to one thread."""
from __future__ import annotations

import re


from tinydeploy import ir
from tinydeploy.ops import Kernel
from tinydeploy.ops.registry import scratch_arg
from tinydeploy.schedule import q8
from tinydeploy.schedule.cost import _round_up


# ---- threads --------------------------------------------------------------------------------

MIN_THREAD_MACS = 65536     # least work per thread worth an OpenMP fork/join (a few microseconds)
THREADED = ("conv2d_gemm", "conv2d_igemm", "conv2d_gemmt", "conv2d_dw", "dense_packed",
            "qconv2d_gemm", "qconv2d_igemm", "qconv2d_dw", "qdense_packed")
_PER_THREAD_SCRATCH = ("conv2d_gemm", "conv2d_dw", "dense_packed",
                       "qconv2d_gemm", "qconv2d_dw")   # the others share theirs


def parallel_blocks(k: Kernel) -> int:
    """Blocks of a fast layer its threaded driver can hand to different threads: NR-column panels
    (conv2d_gemm, dense_packed), MR x NR output tiles (conv2d_igemm, conv2d_gemmt), channels
    (conv2d_dw); qconv2d_igemm: its MR x NR tiles (of the output rows, or of the flattened planes),
    after its threads have built the planes of disjoint channel groups."""
    p, f = k.params, k.family
    if f in ("conv2d_gemm", "qconv2d_gemm"):
        return -(-p["P"] // p["NR"])
    if f == "dense_packed":
        return -(-p["N"] // p["NR"])
    if f == "qdense_packed":
        return p["NP"] // p["NRD"]
    if f == "conv2d_igemm":
        return -(-p["OH"] * p["WP"] // p["NR"]) * -(-p["MG"] // p["MR"])
    if f == "qconv2d_igemm":
        cols = p["OH"] * p["OW"] if p["ROWS"] else p["FLATP"]
        return -(-p["M"] // p["MR"]) * (cols // p["NR"])
    if f == "conv2d_gemmt":
        return -(-p["M"] // p["NR"]) * -(-p["P"] // p["MR"])
    if f == "qconv2d_dw" and "DWL" in p:           # blocks of 16 channels (q8.dw_lanes)
        return p["N"] * p["DWL"]["NB"]
    return p["N"] * p["M"] if f in ("conv2d_dw", "qconv2d_dw") else 1


def parallelise(g: ir.Graph, step: int, k: Kernel | None, threads: int) -> Kernel | None:
    """Layer `step` on min(blocks, threads, MACs / MIN_THREAD_MACS) threads (see the docstring)."""
    if threads <= 1 or k is None or k.family not in THREADED:
        return k
    p = dict(k.params)
    macs = p["M"] * p["K"] * p["N"] if k.family in ("dense_packed", "qdense_packed") else \
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
    if k.family == "qconv2d_gemm":     # the same for the 8-bit GEMM (schedule/q8.py)
        p["NC"] = min(p["NC"], -(-parallel_blocks(k) // t) * p["NR"])
        per = q8.gemm_scratch_words(p)
        desc = re.sub(r" nc \d+", f" nc {p['NC']}", desc, count=1)
    if k.family in _PER_THREAD_SCRATCH:
        p["WST"] = _round_up(per, 16)   # one slice per thread, on cache lines of its own
        scratch = 4 * t * p["WST"]
        args[-1] = scratch_arg(step)
    return Kernel(k.family, k.dtype, p, args, scratch, desc.replace("] ", f" threads {t}] ", 1), consts=k.consts,
                  scratch_dtype=k.scratch_dtype)
