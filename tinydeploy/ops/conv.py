"""Conv (1-D and 2-D, any kernel, strides, dilations, explicit or auto pads, groups)."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.ops.registry import Kernel, dtype_tag, float_only, register, window_2d


def conv_geometry(node: ir.Node, g: ir.Graph) -> dict:
    """Everything about a Conv as 2-D NCHW numbers (1-D convs get H = 1)."""
    w = g.t(node.inputs[1])
    p = window_2d(node, g, node.attrs.get("kernel_shape", list(w.shape[2:])))
    xs, ys = p.pop("xs"), p.pop("ys")
    p.pop("PB"), p.pop("PR")
    return {"N": xs[0], "C": xs[1], "H": xs[2], "W": xs[3], "M": ys[1], "OH": ys[2], "OW": ys[3],
            **p, "G": int(node.attrs.get("group", 1))}


def _check(node, g):
    x = g.t(node.inputs[0])
    if len(x.shape) not in (3, 4):
        return f"{len(x.shape) - 2}-D convolution (1-D and 2-D are supported)"
    if g.const(node.inputs[1]) is None:
        return "non-constant weights"
    if len(node.inputs) > 2 and node.inputs[2] and g.const(node.inputs[2]) is None:
        return "non-constant bias"
    return float_only(node, g)


def conv_macs(node, g):
    p = conv_geometry(node, g)
    return p["N"] * p["M"] * p["OH"] * p["OW"] * (p["C"] // p["G"]) * p["KH"] * p["KW"]


@register("Conv", check=_check, macs=conv_macs)
def emit_conv(node: ir.Node, g: ir.Graph) -> Kernel:
    p = conv_geometry(node, g)
    has_bias = len(node.inputs) > 2 and bool(node.inputs[2])
    p.update(has_bias=has_bias, act=node.attrs.get("_act", "v"))
    args = [node.inputs[0], node.inputs[1]] + ([node.inputs[2]] if has_bias else []) + [node.outputs[0]]
    kind = "depthwise " if p["G"] == p["C"] and p["G"] > 1 else ("grouped " if p["G"] > 1 else "")
    desc = (f"{kind}{p['KH']}x{p['KW']} stride {p['SH']}x{p['SW']}: "
            f"{p['C']}x{p['H']}x{p['W']} -> {p['M']}x{p['OH']}x{p['OW']}")
    return Kernel("conv2d", dtype_tag(g.t(node.outputs[0]).dtype), p, args, desc=desc)
