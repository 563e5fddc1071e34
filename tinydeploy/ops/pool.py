"""MaxPool, AveragePool (pads, ceil_mode, count_include_pad, dilations), global pools."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.ops.registry import Kernel, dtype_tag, float_only, register, window_2d
from tinydeploy.ops.verify import ints, shape, window_problems
from tinydeploy.quant.params import QCtx, QInfo, exact_ratios, quantize_multiplier


def _geometry(node: ir.Node, g: ir.Graph) -> dict:
    p = window_2d(node, g, node.attrs["kernel_shape"])
    xs, ys = p.pop("xs"), p.pop("ys")
    return {"NC": xs[0] * xs[1], "H": xs[2], "W": xs[3], "OH": ys[2], "OW": ys[3], **p}


def _check(node, g):
    if len(g.t(node.inputs[0]).shape) not in (3, 4):
        return "only 1-D and 2-D pooling"
    if len(node.outputs) > 1 and node.outputs[1]:
        return "MaxPool Indices output"
    if node.attrs.get("storage_order", 0):
        return "storage_order=1"
    if node.attrs.get("ceil_mode", 0) and node.attrs.get("auto_pad", "NOTSET") == "NOTSET" and _ceil_disagrees(node, g):
        return ("ceil_mode=1 with a last window starting in the right padding on only some axes "
                "(onnx shape inference keeps that window, onnxruntime drops it)")
    return float_only(node, g, [node.inputs[0], node.outputs[0]])


def verify_pool(node, g) -> list[str]:
    """kernel_shape given, flags 0 or 1, and the window's own rules (pads smaller than the kernel)."""
    kernel = ints(node, "kernel_shape")
    if kernel is None:
        return ["no kernel_shape"]
    out = [f"{k} {node.attrs[k]} must be 0 or 1" for k in ("ceil_mode", "count_include_pad", "storage_order")
           if k in node.attrs and node.attrs[k] not in (0, 1)]
    return out + window_problems(node, g, kernel, pool=True)


def verify_global(node, g) -> list[str]:
    x = shape(g, node.inputs[0])
    return [] if x is not None and len(x) >= 3 else [f"input of rank {len(x) if x is not None else '?'} (needs N, C "
                                                     "and at least one spatial axis)"]


def _ceil_disagrees(node: ir.Node, g: ir.Graph) -> bool:
    """The output shape is not the spec's: with ceil_mode, a window that would start in the right
    padding is dropped (importer rewrites the pools where that holds on every axis concerned)."""
    xs, ys, a = g.t(node.inputs[0]).shape, g.t(node.outputs[0]).shape, node.attrs
    k = list(a["kernel_shape"])
    r = len(k)
    s, d = list(a.get("strides", [1] * r)), list(a.get("dilations", [1] * r))
    p = list(a.get("pads", [0] * (2 * r)))
    for i in range(r):
        span = xs[2 + i] + p[i] + p[i + r] - (k[i] - 1) * d[i] - 1
        out = -(-span // s[i]) + 1
        if (out - 1) * s[i] >= xs[2 + i] + p[i]:
            out -= 1
        if out != ys[2 + i]:
            return True
    return False


def _emit(node: ir.Node, g: ir.Graph) -> Kernel:
    p = _geometry(node, g)
    p["mode"] = "max" if node.op == "MaxPool" else "avg"
    if (p["OH"] == p["OW"] == 1 and (p["KH"], p["KW"]) == (p["H"], p["W"]) and p["DH"] == p["DW"] == 1
            and p["PT"] == p["PL"] == p["PB"] == p["PR"] == 0):
        # one window over the whole plane (the last pool of ResNet-8, DS-CNN, MobileNet): the
        # global pool's contiguous reduction
        return Kernel("global_pool", dtype_tag(g.t(node.outputs[0]).dtype),
                      {"NC": p["NC"], "HW": p["H"] * p["W"], "mode": p["mode"]}, [node.inputs[0], node.outputs[0]],
                      desc=f"{p['mode']} {p['KH']}x{p['KW']} over the whole plane: {p['NC']} channels")
    p["include_pad"] = bool(node.attrs.get("count_include_pad", 0))
    desc = (f"{p['mode']} {p['KH']}x{p['KW']} stride {p['SH']}x{p['SW']}: "
            f"{p['NC']}x{p['H']}x{p['W']} -> {p['OH']}x{p['OW']}")
    return Kernel("pool2d", dtype_tag(g.t(node.outputs[0]).dtype), p, [node.inputs[0], node.outputs[0]], desc=desc)


def pool_macs(node, g):
    k = node.attrs.get("kernel_shape", [1])
    n = 1
    for v in k:
        n *= v
    return g.t(node.outputs[0]).size * n


# ---- 8-bit: the QDQ match (quant/qdq.py runs it) ----------------------------------------------

def qdq_pool(ctx: QCtx, p: ir.Node, yq: QInfo, lo: int, hi: int) -> ir.Node | None:
    g = ctx.g
    x = ctx.runtime(p.inputs[0])
    if x is None or len(g.t(p.inputs[0]).shape) not in (3, 4) or (len(p.outputs) > 1 and p.outputs[1]):
        return None
    if p.op in ("MaxPool", "AveragePool") and p.attrs.get("storage_order", 0):
        return None
    r = float(np.float32(x.s) / np.float32(yq.s))
    if not exact_ratios(r):
        return None
    q = {"zx": x.z, "zy": yq.z, "lo": lo, "hi": hi, "r": r, "xs": float(x.s), "ys": float(yq.s)}
    if p.op in ("AveragePool", "GlobalAveragePool"):
        xs = g.t(p.inputs[0]).shape
        window = int(np.prod(p.attrs["kernel_shape"])) if p.op == "AveragePool" else int(np.prod(xs[2:]))
        if not exact_ratios(r / window):
            return None
        # One multiplier per possible divisor (window clipped by the borders), r / count.
        q["table"] = [quantize_multiplier(float(np.float64(x.s) / np.float64(yq.s) / c)) if c else (0, 1)
                      for c in range(window + 1)]
    else:
        q["m"], q["s"] = quantize_multiplier(r)
        q["identity"] = bool(x.s == yq.s and x.z == yq.z)
    attrs = {k: v for k, v in p.attrs.items() if not k.startswith("_")}
    attrs["_q"] = q
    return ir.Node("Q" + p.op, p.name, [x.src], [yq.src], attrs, onnx_op=p.onnx_op)


register("MaxPool", check=_check, verify=verify_pool, macs=pool_macs, qdq=qdq_pool)(_emit)
register("AveragePool", check=_check, verify=verify_pool, macs=pool_macs, qdq=qdq_pool)(_emit)


def _global(node: ir.Node, g: ir.Graph) -> Kernel:
    x = g.t(node.inputs[0])
    nc = x.shape[0] * x.shape[1]
    return Kernel("global_pool", dtype_tag(x.dtype),
                  {"NC": nc, "HW": x.size // nc, "mode": "max" if node.op == "GlobalMaxPool" else "avg"},
                  [node.inputs[0], node.outputs[0]], desc=f"{nc} channels of {x.size // nc}")


def _gcheck(node, g):
    if len(g.t(node.inputs[0]).shape) < 3:
        return "input of rank < 3"
    return float_only(node, g)


register("GlobalAveragePool", check=_gcheck, verify=verify_global, macs=lambda n, g: g.t(n.inputs[0]).size, qdq=qdq_pool)(_global)
register("GlobalMaxPool", check=_gcheck, verify=verify_global, qdq=qdq_pool)(_global)
