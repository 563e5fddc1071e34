"""Patch-based execution on microcontrollers: a run of high-resolution layers computed row by
row, so that their full-size intermediate tensors never exist.

A chain is consecutive layers L0 .. Ln-1 where each intermediate tensor has its one consumer
in the next layer (stride-1 or strided convolutions, depthwise or not; a leading NHWC -> NCHW
Transpose is folded into the reading of the source). Each layer keeps a window of its input,
only as many rows as one of its output rows needs ((KH - 1) DH + 1 rows, [C][rows][W]), in
arena scratch. For each output row of the last layer the windows are pulled from the bottom:
a window slides down by the stride (keeping the rows both positions cover: the halo is kept,
not recomputed, so every row of every layer is computed exactly once) and each new row is
computed by the layer below into its slot, recursively, down to rows copied from the source.
Rows outside the tensor are the padding: filled with the input zero point (8-bit, whose taps add
(zx - zx) w = 0 like the reference's skipped ones) or 0.0 (fp32). Each layer's kernel is its own
kernel specialised for a window: H = the window's rows, no vertical padding, one output row,
writing with output strides into the next window's slot.

The sink: where the source is NHWC and dies in the chain, the rows of the last layer go pixel
major (HWC) into source bytes that no later row reads (a source row is dead once copied into the
first window), and at the end are transposed into the sink, itself placed in the source's bytes
(Kernel.alias): the chain then needs little more than its source. Else straight into the sink.

The planner decides (planner.plan_memory, `chains`): a candidate is taken where it makes the arena
smaller by enough for the instructions it adds (estimated here: the windows' copies and shifts,
the calls per row), the smallest arena first.
"""
from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass

import numpy as np

from tinydeploy import ir
from tinydeploy.codegen.cfmt import c_type
from tinydeploy.ops import REGISTRY, Kernel
from tinydeploy.ops.registry import scratch_arg
from tinydeploy.schedule import mcu
from tinydeploy.schedule.depthwise import ref_scratch_bytes

MAX_LAYERS = 6
TILE_MIN = 8               # a chain's GEMM layers work on one row: their smallest tile
_CALL = 120                # instructions per kernel call beyond its work (estimate)
_BYTE = 2                  # instructions per byte copied, shifted or filled (estimate)


@dataclass
class Candidate:
    kernels: list[Kernel | None]
    added: int               # instructions added (estimate)
    desc: str


def _member_ok(k: Kernel | None) -> bool:
    """Kernels that can compute one output row from a window of their input rows."""
    if k is None or k.params.get("N", 1) != 1 or k.params.get("G", 1) not in (1, k.params.get("C")):
        return False
    if k.family == "qconv2d":
        return bool(k.params.get("PACKED")) or "HP" in k.params
    if k.family == "conv2d":
        return bool(k.params.get("PACKED"))
    return k.family == "conv2d_dw" and k.params.get("MULT") == 1 and k.params.get("THREADS", 1) == 1


def _nhwc_transpose(k: Kernel | None, g: ir.Graph, n: ir.Node) -> bool:
    """A Transpose [0, 3, 1, 2] of a 4-D tensor (NHWC -> NCHW) that a chain can fold in."""
    return (k is not None and k.family == "strided_copy" and n.op == "Transpose"
            and list(n.attrs.get("perm", [])) == [0, 3, 1, 2] and g.t(n.inputs[0]).shape[0] == 1)


def _window_rows(p: dict) -> int:
    return (p["KH"] - 1) * p["DH"] + 1


def _member(g: ir.Graph, step: int, k: Kernel, ycs: int, yps: int) -> Kernel:
    """Kernel k of layer `step` specialised for one output row from a window of its input rows
    (no vertical padding), writing with output strides YCS (channels) and YPS (pixels)."""
    n = g.nodes[step]
    p = k.params
    rows = _window_rows(p)
    x, y = g.t(n.inputs[0]), g.t(n.outputs[0])
    fx, fy = f"#win{step}", f"#row{step}"
    tensors = ChainMap({fx: ir.Tensor(fx, (1, p["C"], rows, p["W"]), x.dtype),
                        fy: ir.Tensor(fy, (1, p["M"], 1, p["OW"]), y.dtype)}, g.tensors)
    fake_g = ir.Graph(tensors, [], [], [])
    pads = list(n.attrs.get("pads", [0, 0, 0, 0]))
    attrs = dict(n.attrs, pads=[0, pads[1], 0, pads[3]], auto_pad="NOTSET")
    if n.attrs.get("auto_pad", "NOTSET") != "NOTSET":
        attrs["pads"] = [0, p["PL"], 0, p["PL"] + max(0, (p["OW"] - 1) * p["SW"] + (p["KW"] - 1) * p["DW"] + 1
                                                     - p["W"] - p["PL"])]
    node = ir.Node(n.op, n.name, [fx] + list(n.inputs[1:]), [fy], attrs, n.onnx_op)
    geo = REGISTRY[n.op].emit(node, fake_g).params
    params = dict(p, **{key: geo[key] for key in geo if key not in ("form",)}, YCS=ycs, YPS=yps, INPLACE=False)
    args = ["@in" if i == 0 else "@out" if a == n.outputs[0] else "@scratch" if a.startswith("#scratch") else a
            for i, a in enumerate(k.args)]
    m = Kernel(k.family, k.dtype, params, args, k.scratch_bytes, k.desc, k.consts, k.scratch_dtype)
    if "HP" in p:       # depthwise plane: the window framed by its columns' padding
        hp = rows
        wp = max(p["W"] + p["PL"], (p["OW"] - 1) * p["SW"] + 3) + (1 if p["SW"] == 1 and p["OW"] % 2 else 0)
        m.params.update(HP=hp, WP=wp)
        m.scratch_bytes = hp * wp + 4
    elif k.family == "conv2d_dw":
        m.scratch_bytes = ref_scratch_bytes(m.params)
    else:
        mcu.fit_scratch(m, 1 << 30)
    return m


def _rows_needed(levels: list[dict], r: int) -> int:
    """The last source row read to compute output row r of the chain (rows clipped to each
    tensor)."""
    hi = r
    for lv in reversed(levels):
        hi = min(lv["H"] - 1, hi * lv["SH"] - lv["PT"] + lv["KHE"] - 1)
    return hi


def build(g: ir.Graph, kernels: list[Kernel | None], s0: int, s1: int) -> Kernel | None:
    """The chain of steps s0 .. s1 (s0 may be a folded NHWC -> NCHW Transpose) as one kernel at
    step s1 whose parts are the layers' window kernels, or None when it does not apply."""
    nhwc = _nhwc_transpose(kernels[s0], g, g.nodes[s0])
    first = s0 + 1 if nhwc else s0
    if first > s1 or not all(_member_ok(kernels[s]) for s in range(first, s1 + 1)):
        return None
    for s in range(s0, s1):
        out = g.nodes[s].outputs[0]
        if out in g.outputs or [c for c in g.consumers(out)] != [g.nodes[s + 1]] or g.nodes[s + 1].inputs[0] != out:
            return None
    src = g.nodes[s0].inputs[0]
    sink = g.nodes[s1].outputs[0]
    levels = []
    for s in range(first, s1 + 1):
        p = kernels[s].params
        levels.append({"step": s, "C": p["C"], "H": p["H"], "W": p["W"], "KHE": _window_rows(p), "SH": p["SH"],
                       "PT": p["PT"], "M": p["M"], "OH": p["OH"], "OW": p["OW"], "T": c_type(g.t(g.nodes[s].inputs[0]).dtype),
                       "ZERO": int(p["ZX"]) if p.get("zp_in_loop") else 0, "item": g.t(g.nodes[s].inputs[0]).dtype.itemsize})
    last = levels[-1]
    ty = c_type(g.t(sink).dtype)
    item = g.t(sink).dtype.itemsize
    sink_bytes = g.t(sink).nbytes
    src_t = g.t(src)
    # HWC staging inside the source: source rows die once copied into the first window
    alias, d_hwc = None, 0
    if nhwc:
        row_src = src_t.nbytes // src_t.shape[1]
        row_sink = last["OW"] * last["M"] * item
        slack = min((_rows_needed(levels, r) + 1) * row_src - (r + 1) * row_sink for r in range(last["OH"]))
        d_hwc = max(0, slack) // 8 * 8
        d = (src_t.nbytes - sink_bytes) // 8 * 8
        if slack >= 0 and d_hwc + sink_bytes <= d:
            alias = d
    # windows: level i's input window [C][KHE][W], then the members' shared scratch
    offs, off = [], 0
    for lv in levels:
        offs.append(off)
        off += (lv["C"] * lv["KHE"] * lv["W"] * lv["item"] + 7) // 8 * 8
    parts = []
    for i, lv in enumerate(levels):
        if i + 1 < len(levels):
            ycs, yps = levels[i + 1]["KHE"] * lv["OW"], 1
        elif alias is not None:
            ycs, yps = 1, lv["M"]
        else:
            ycs, yps = lv["OH"] * lv["OW"], 1
        parts.append(_member(g, lv["step"], kernels[lv["step"]], ycs, yps))
    params = {"levels": levels, "WOFF": offs, "MS": off, "NHWC": nhwc, "SRC": list(src_t.shape), "TX": levels[0]["T"],
              "TY": ty, "HWC": alias is not None, "D_HWC": d_hwc, "STEPS": [s0, s1],
              "parts_scratch": [c_type(np.dtype(pt.scratch_dtype)) for pt in parts]}
    k = Kernel("stream", kernels[s1].dtype, params, [src, sink, scratch_arg(s1)],
               off + max(pt.scratch_bytes for pt in parts),
               f"[patch-based: steps {s0}-{s1} row by row, windows of "
               f"{'/'.join(str(lv['KHE']) for lv in levels)} rows] {kernels[s1].desc}",
               scratch_dtype="uint8")
    k.parts = parts
    k.fused = tuple(range(s0, s1))
    k.alias = alias
    return k


def fit(k: Kernel, room: int) -> bool:
    """A chain's scratch: its windows, then the largest member tiles that fit in the rest."""
    rest = room - k.params["MS"]
    for pt in k.parts:
        mcu.fit_scratch(pt, max(rest, 0), TILE_MIN)
    k.scratch_bytes = k.params["MS"] + max(pt.scratch_bytes for pt in k.parts)
    return True


def added_instructions(g: ir.Graph, k: Kernel) -> int:
    """What running the chain row by row adds (estimate): per row of each layer a call and the
    window's shift, the source rows copied in, the padding rows filled, the staging transposed;
    minus the folded Transpose's copy."""
    total = 0
    levels = k.params["levels"]
    for i, lv in enumerate(levels):
        shifted = max(0, lv["KHE"] - lv["SH"]) * lv["C"] * lv["W"] * lv["item"]
        rows_out = lv["OH"]
        total += rows_out * (_CALL + _BYTE * shifted // max(1, lv["SH"]))
    src = levels[0]
    total += _BYTE * src["C"] * src["H"] * src["W"] * src["item"]
    if k.params["HWC"]:
        total += 3 * g.t(k.args[1]).nbytes
    if k.params["NHWC"]:
        total -= 3 * src["C"] * src["H"] * src["W"] * src["item"]
    return max(total, 0)


def candidates(g: ir.Graph, kernels: list[Kernel | None]) -> list[Candidate]:
    """Every chain of 2 to MAX_LAYERS layers (a folded Transpose counts as none), as kernels."""
    out = []
    n = len(kernels)
    for s0 in range(n):
        if kernels[s0] is None or kernels[s0].family == "stream":
            continue
        for s1 in range(s0 + 1, min(n, s0 + MAX_LAYERS + 1)):
            if any(kernels[s] is None or kernels[s].family == "stream" for s in range(s0, s1 + 1)):
                break
            k = build(g, kernels, s0, s1)
            if k is None:
                continue
            ks = list(kernels)
            for s in range(s0, s1):
                ks[s] = None
            ks[s1] = k
            out.append(Candidate(ks, added_instructions(g, k), k.desc.split("]")[0][1:]))
    return out
