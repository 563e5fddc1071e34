"""Operators that reduce or normalise along axes: Softmax, Reduce*, LRN, standalone BatchNorm."""
from __future__ import annotations

import math

import numpy as np

from tinydeploy import ir
from tinydeploy.codegen.cfmt import c_float
from tinydeploy.ops.registry import Kernel, dtype_tag, float_only, new_const, register
from tinydeploy.quant.params import QCtx, QInfo, softmax_table
from tinydeploy.ops.elementwise import broadcast_loops, epilogue
from tinydeploy.ops.verify import axes_problems, axis_problem, shape


def _axis(node, g, default):
    r = len(g.t(node.inputs[0]).shape)
    a = int(node.attrs.get("axis", default))
    return a + r if a < 0 else a


# ---- 8-bit: the QDQ match of Softmax (quant/qdq.py runs it) ------------------------------------

def qdq_softmax(ctx: QCtx, p: ir.Node, yq: QInfo, lo: int, hi: int) -> ir.Node | None:
    """DQ -> Softmax -> Q on the integers: e_k from a float32 table of exponentials
    (softmax_table), p_k = e_k / sum in float32, y_k = QuantizeLinear(p_k) = rint(p_k / s_y) + zy
    (docs/quantization.md)."""
    g = ctx.g
    x = ctx.runtime(p.inputs[0])
    if x is None or x.dtype != yq.dtype or not math.isfinite(float(x.s)) or not (float(x.s) > 0):
        return None
    shape = g.t(p.inputs[0]).shape
    if not shape:
        return None
    ax = int(p.attrs.get("axis", -1))
    ax = ax + len(shape) if ax < 0 else ax
    if not 0 <= ax < len(shape) or shape[ax] < 1:
        return None
    if not math.isfinite(float(yq.s)) or not (float(yq.s) > 0):
        return None
    table = softmax_table(float(x.s), int(shape[ax]))
    attrs = {"axis": ax, "_q": {"table": table, "xs": float(x.s), "ys": float(yq.s), "zy": yq.z, "lo": lo, "hi": hi}}
    return ir.Node("QSoftmax", p.name, [x.src], [yq.src], attrs, onnx_op=p.onnx_op)


def _verify_softmax(node, g) -> list[str]:
    p = axis_problem(int(node.attrs.get("axis", -1)), len(g.t(node.inputs[0]).shape))
    return [p] if p else []


@register("Softmax", check=float_only, verify=_verify_softmax, inplace=False, qdq=qdq_softmax)
def emit_softmax(node: ir.Node, g: ir.Graph) -> Kernel:
    x = g.t(node.inputs[0])
    ax = _axis(node, g, -1)
    outer = int(np.prod(x.shape[:ax], dtype=np.int64))
    inner = int(np.prod(x.shape[ax + 1:], dtype=np.int64))
    return Kernel("softmax", dtype_tag(x.dtype), {"outer": outer, "n": x.shape[ax], "inner": inner},
                  [node.inputs[0], node.outputs[0]], desc=f"over axis {ax} of {list(x.shape)}")


REDUCE_OPS = {"ReduceMean": "mean", "ReduceSum": "sum", "ReduceMax": "max", "ReduceMin": "min"}


def _reduce_axes(node, g) -> list[int] | None:
    r = len(g.t(node.inputs[0]).shape)
    if "axes" in node.attrs:
        axes = list(node.attrs["axes"])
    elif len(node.inputs) > 1 and node.inputs[1]:
        c = g.const(node.inputs[1])
        if c is None:
            return None
        axes = [int(v) for v in c.reshape(-1)]
    else:
        axes = []
    if not axes and not node.attrs.get("noop_with_empty_axes", 0):
        axes = list(range(r))
    return sorted(a + r if a < 0 else a for a in axes)


def _verify_reduce(node, g) -> list[str]:
    r = len(g.t(node.inputs[0]).shape)
    if "axes" in node.attrs:
        axes = [int(a) for a in node.attrs["axes"]]
    elif len(node.inputs) > 1 and node.inputs[1] and g.const(node.inputs[1]) is not None:
        axes = [int(v) for v in g.const(node.inputs[1]).reshape(-1)]
    else:
        return []
    return axes_problems(axes, r)


def _reduce_check(node, g):
    if _reduce_axes(node, g) is None:
        return "non-constant axes"
    return float_only(node, g)


def _reduce_emit(node: ir.Node, g: ir.Graph) -> Kernel:
    x = g.t(node.inputs[0])
    axes = _reduce_axes(node, g)
    kept = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
    dims, (sx, sy) = broadcast_loops(x.shape, [x.shape, kept])
    count = x.size // max(1, int(np.prod(kept, dtype=np.int64)))
    return Kernel("reduce", dtype_tag(x.dtype),
                  {"dims": dims, "sy": sy, "out": g.t(node.outputs[0]).size, "mode": REDUCE_OPS[node.op],
                   "count": count}, [node.inputs[0], node.outputs[0]],
                  desc=f"{REDUCE_OPS[node.op]} over axes {axes} of {list(x.shape)}")


for _op in REDUCE_OPS:
    register(_op, check=_reduce_check, verify=_verify_reduce)(_reduce_emit)


def _verify_lrn(node, g) -> list[str]:
    """onnxruntime's LRN: an odd size >= 1 and positive alpha, beta and bias (it refuses others)."""
    a, out = node.attrs, []
    size = int(a.get("size", 0))
    if size < 1 or size % 2 == 0:
        out.append(f"size {size} must be an odd number >= 1")
    for k, default in (("alpha", 1e-4), ("beta", 0.75), ("bias", 1.0)):
        v = float(a.get(k, default))
        if not (math.isfinite(v) and v > 0):
            out.append(f"{k} {v:g} must be a positive number")
    x = shape(g, node.inputs[0])
    if x is None or len(x) < 2:
        out.append("input of rank < 2 (needs N and C)")
    return out


@register("LRN", check=float_only, verify=_verify_lrn)
def emit_lrn(node: ir.Node, g: ir.Graph) -> Kernel:
    x = g.t(node.inputs[0])
    a = node.attrs
    size = int(a["size"])
    return Kernel("lrn", dtype_tag(x.dtype),
                  {"N": x.shape[0], "C": x.shape[1], "inner": x.size // (x.shape[0] * x.shape[1]),
                   "lo": (size - 1) // 2, "hi": (size - 1) - (size - 1) // 2,
                   "alpha_over_size": c_float(float(a.get("alpha", 1e-4)) / size),
                   "beta": c_float(a.get("beta", 0.75)), "bias": c_float(a.get("bias", 1.0))},
                  [node.inputs[0], node.outputs[0]], desc=f"size {size} over {list(x.shape)}")


def _bn_check(node, g):
    if any(g.const(i) is None for i in node.inputs[1:5]):
        return "non-constant statistics"
    if node.attrs.get("training_mode", 0) or len([o for o in node.outputs if o]) > 1:
        return "training mode"
    return float_only(node, g)


def channel_affine(node: ir.Node, g: ir.Graph, x: str, scale: np.ndarray, shift: np.ndarray, y: str) -> Kernel:
    xt = g.t(x)
    consts: dict = {}
    names = [new_const(g, consts, f"{y}_{what}", data.astype(np.float32)) for what, data in (("scale", scale), ("shift", shift))]
    c = xt.shape[1] if len(xt.shape) > 1 else 1
    inner = xt.size // (xt.shape[0] * c)
    return Kernel("channel_affine", dtype_tag(xt.dtype), {"N": xt.shape[0], "C": c, "inner": inner,
                  **epilogue(node)}, [x, *names, y], desc=f"per-channel scale+shift of {list(xt.shape)}",
                  consts=consts)


def _verify_bn(node, g) -> list[str]:
    x = shape(g, node.inputs[0])
    if x is None or len(x) < 2:
        return ["input of rank < 2 (needs N and C)"]
    bad = [f"{what} has shape {'x'.join(map(str, s))}" for what, i in (("scale", 1), ("B", 2), ("mean", 3), ("var", 4))
           if len(node.inputs) > i and (s := shape(g, node.inputs[i])) is not None and s != (x[1],)]
    return [f"{', '.join(bad)}; the {x[1]} channels need {x[1]} values each"] if bad else []


@register("BatchNormalization", check=_bn_check, verify=_verify_bn, inplace=True, epilogue=True)
def emit_bn(node: ir.Node, g: ir.Graph) -> Kernel:
    scale, bias, mean, var = (g.const(i).astype(np.float64) for i in node.inputs[1:5])
    s = scale / np.sqrt(var + float(node.attrs.get("epsilon", 1e-5)))
    return channel_affine(node, g, node.inputs[0], s, bias - mean * s, node.outputs[0])
