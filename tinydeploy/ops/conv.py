"""Conv (1-D and 2-D, any kernel, strides, dilations, explicit or auto pads, groups)."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.ops.elementwise import epilogue
from tinydeploy.ops.registry import Kernel, dtype_tag, float_only, register, window_2d
from tinydeploy.ops.verify import ints, shape, window_problems
from tinydeploy.quant.params import (QTYPES, QCtx, QInfo, add_const, add_multipliers, bias_acc, channel_params,
                                     exact_ratios, fit_int32, weights_minus_zp)


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


def verify_conv(node, g) -> list[str]:
    """Weights [M, C/group, k...], group >= 1 dividing C and M, kernel_shape equal to the weights'
    (onnxruntime refuses anything else), bias [M], and the window's own rules."""
    x, w, b = shape(g, node.inputs[0]), shape(g, node.inputs[1]), shape(g, node.inputs[2] if len(node.inputs) > 2 else "")
    if x is None or w is None or len(x) < 3:
        return [f"input of rank {len(x) if x is not None else '?'}"]
    if len(w) != len(x):
        return [f"weights of rank {len(w)} for an input of rank {len(x)}"]
    out = []
    group = int(node.attrs.get("group", 1))
    c, m = x[1], w[0]
    if group < 1:
        out.append(f"group {group} must be >= 1")
    elif c % group or w[1] * group != c:
        out.append(f"group {group} and weights {'x'.join(map(str, w))} do not fit the {c} input channels "
                   f"(weights' second dimension x group = {w[1] * group})")
    elif m % group:
        out.append(f"group {group} does not divide the {m} output channels")
    kernel = ints(node, "kernel_shape", list(w[2:]))
    if kernel != list(w[2:]):
        out.append(f"kernel_shape {kernel} differs from the weights' {list(w[2:])}")
    if b is not None and b != (m,):
        out.append(f"bias of shape {'x'.join(map(str, b))}; the {m} output channels need {m}")
    return out + window_problems(node, g, list(w[2:]), pool=False)


def conv_macs(node, g):
    p = conv_geometry(node, g)
    return p["N"] * p["M"] * p["OH"] * p["OW"] * (p["C"] // p["G"]) * p["KH"] * p["KW"]


# ---- 8-bit: the QDQ match (quant/qdq.py runs it) ----------------------------------------------

def qdq_conv(ctx: QCtx, p: ir.Node, yq: QInfo, lo: int, hi: int) -> ir.Node | None:
    """DQ(x) -> Conv(DQ(w), DQ(b)) [-> Relu/Clip] -> Q as a QConv: int32 accumulators on w - zw, the
    bias in accumulator units (the input zero point folded in where no padding is read), per-channel
    multipliers s_x s_w[c] / s_y (docs/quantization.md)."""
    g = ctx.g
    x = ctx.runtime(p.inputs[0])
    w = ctx.const(p.inputs[1])
    if x is None or w is None or w.dtype not in QTYPES or len(g.t(p.inputs[0]).shape) not in (3, 4):
        return None
    wdata = w.data
    n_out = wdata.shape[0]
    ch = channel_params(w, n_out, 0)
    if ch is None:
        return None
    sw, zw = ch
    acc_scale = (x.s * sw).astype(np.float32)                # float32, as onnxruntime computes it
    r = (acc_scale / yq.s).astype(np.float32)
    if not exact_ratios(r):
        return None
    bias = bias_acc(g, ctx, p.inputs[2] if len(p.inputs) > 2 else "", n_out, acc_scale, r=r)
    if bias is None:
        return None
    bshape = (-1,) + (1,) * (wdata.ndim - 1)
    wq = weights_minus_zp(wdata, zw, bshape)
    a = p.attrs
    rank = len(g.t(p.inputs[0]).shape) - 2
    pads = list(a.get("pads", [0] * (2 * rank)))
    padded = any(pads) or a.get("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER")
    zp_in_loop = bool(padded and x.z != 0)
    if not zp_in_loop:
        bias = bias - x.z * wq.reshape(n_out, -1).astype(np.int64).sum(axis=1)
    b32 = fit_int32(bias, wq, x.dtype, x.z if zp_in_loop else 0)
    if b32 is None:
        return None
    base = p.outputs[0]
    wname = add_const(g, base + "_qweight", wq)
    bname = add_const(g, base + "_qbias", b32)
    mname, sname = add_multipliers(g, base, r)
    attrs = {k: v for k, v in a.items() if not k.startswith("_")}
    attrs["_q"] = {"zx": x.z, "zy": yq.z, "lo": lo, "hi": hi, "zp_in_loop": zp_in_loop}
    return ir.Node("QConv", p.name, [x.src, wname, bname, mname, sname], [yq.src], attrs, onnx_op=p.onnx_op)


@register("Conv", check=_check, verify=verify_conv, macs=conv_macs, epilogue=True, qdq=qdq_conv)
def emit_conv(node: ir.Node, g: ir.Graph) -> Kernel:
    p = conv_geometry(node, g)
    has_bias = len(node.inputs) > 2 and bool(node.inputs[2])
    p.update(has_bias=has_bias, **epilogue(node))
    args = [node.inputs[0], node.inputs[1]] + ([node.inputs[2]] if has_bias else []) + [node.outputs[0]]
    kind = "depthwise " if p["G"] == p["C"] and p["G"] > 1 else ("grouped " if p["G"] > 1 else "")
    desc = (f"{kind}{p['KH']}x{p['KW']} stride {p['SH']}x{p['SW']}: "
            f"{p['C']}x{p['H']}x{p['W']} -> {p['M']}x{p['OH']}x{p['OW']}")
    return Kernel("conv2d", dtype_tag(g.t(node.outputs[0]).dtype), p, args, desc=desc)
