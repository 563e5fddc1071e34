"""Integer operators made by the QDQ pass (tinydeploy/quant/) and the QuantizeLinear /
DequantizeLinear kernels of float islands. Requantisation constants are computed by the pass
and travel in node.attrs["_q"] (scalars) or as int32 constant inputs (per-channel multipliers
and shifts); the kernels (firmware_templates/kernels/q*_ref.c.j2) only read them."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.codegen.cfmt import c_float, c_type
from tinydeploy.ops.registry import Kernel, dtype_tag, new_const, register
from tinydeploy.ops.conv import conv_geometry, conv_macs
from tinydeploy.ops.elementwise import broadcast_loops
from tinydeploy.ops.pool import _geometry as pool_geometry, pool_macs
from tinydeploy.ops.verify import axis_problem, scale_problems, shape
from tinydeploy.quant.params import qadd_ties, ties_possible

QTYPES = (np.dtype(np.int8), np.dtype(np.uint8))


def _qcheck(node: ir.Node, g: ir.Graph) -> str | None:
    for name in [i for i in node.inputs if i] + node.outputs:
        t = g.tensors.get(name)
        if t is not None and not t.is_const and np.dtype(t.dtype) not in QTYPES:
            return f"{np.dtype(t.dtype).name} tensor where an 8-bit one is expected"
    if "_q" not in node.attrs:
        return "made only by the QDQ pass"
    return None


def _types(g: ir.Graph, node: ir.Node) -> dict:
    return {"TX": c_type(g.t(node.inputs[0]).dtype), "TY": c_type(g.t(node.outputs[0]).dtype)}


@register("QConv", check=_qcheck, macs=conv_macs)
def emit_qconv(node: ir.Node, g: ir.Graph) -> Kernel:
    p = conv_geometry(node, g)
    q = node.attrs["_q"]
    p.update(_types(g, node), TW=c_type(g.t(node.inputs[1]).dtype), ZX=q["zx"], ZY=q["zy"], LO=q["lo"],
             HI=q["hi"], zp_in_loop=q["zp_in_loop"], TILE=min(p["OW"], 64))
    # Largest |acc| per channel (bias + worst-case input), to drop the tie logic when no exact
    # .5 can occur (see quant.ties_possible).
    xlo, xhi = (int(v) for v in (np.iinfo(g.t(node.inputs[0]).dtype).min, np.iinfo(g.t(node.inputs[0]).dtype).max))
    zx = q["zx"] if q["zp_in_loop"] else 0
    xmax = max(abs(xlo - zx), abs(xhi - zx))
    wdat = g.t(node.inputs[1]).data.reshape(p["M"], -1).astype(np.int64)
    bound = np.abs(g.t(node.inputs[2]).data.astype(np.int64)) + xmax * np.abs(wdat).sum(axis=1)
    p["ties"] = ties_possible(bound, g.t(node.inputs[3]).data, g.t(node.inputs[4]).data)
    # Output channels computed together (each input row is then read once for all of them).
    per_group = p["M"] // p["G"]
    p["OB"] = next(ob for ob in (4, 2, 1) if per_group % ob == 0)
    # "pixel": accumulators across output channels (weights re-laid [C][KH][KW][M]) when there
    # are enough channels to vectorise over and few enough for the stack; else "row".
    args, consts = list(node.inputs) + list(node.outputs), {}
    p["form"] = "pixel" if p["G"] == 1 and 16 <= p["M"] <= 512 else "row"
    if p["G"] == p["C"] == p["M"] and p["KH"] * p["KW"] <= 49:
        # "dw": depthwise; interior outputs (whole window inside the input) unrolled.
        p["form"] = "dw"

        def interior(pad, size, k, st, d, out):
            lo = -(-pad // st)
            hi = (size - 1 + pad - (k - 1) * d) // st + 1 if size - 1 + pad - (k - 1) * d >= 0 else 0
            lo, hi = min(max(lo, 0), out), min(max(hi, 0), out)
            return lo, max(lo, hi)
        p["IY0"], p["IY1"] = interior(p["PT"], p["H"], p["KH"], p["SH"], p["DH"], p["OH"])
        p["IX0"], p["IX1"] = interior(p["PL"], p["W"], p["KW"], p["SW"], p["DW"], p["OW"])
    if p["form"] == "pixel":
        w = g.t(node.inputs[1])
        wt = w.data.reshape(p["M"], p["C"], p["KH"], p["KW"]).transpose(1, 2, 3, 0)
        args[1] = new_const(g, consts, node.inputs[1] + "_ckkm", wt)
    # Output columns [OX0[kx], OX1[kx]) read inside the input for horizontal tap kx.
    p["OX0"], p["OX1"] = [], []
    for kx in range(p["KW"]):
        tx = p["PL"] - kx * p["DW"]
        o0 = -(-tx // p["SW"]) if tx > 0 else 0
        tx1 = p["W"] - 1 + p["PL"] - kx * p["DW"]
        o1 = 0 if tx1 < 0 else min(tx1 // p["SW"] + 1, p["OW"])
        p["OX0"].append(min(o0, p["OW"]))
        p["OX1"].append(max(o1, min(o0, p["OW"])))
    kind = "depthwise " if p["G"] == p["C"] and p["G"] > 1 else ("grouped " if p["G"] > 1 else "")
    desc = (f"{kind}{p['KH']}x{p['KW']} stride {p['SH']}x{p['SW']}: "
            f"{p['C']}x{p['H']}x{p['W']} -> {p['M']}x{p['OH']}x{p['OW']}")
    return Kernel("qconv2d", dtype_tag(g.t(node.inputs[0]).dtype), p, args, desc=desc, consts=consts)


def _dense_macs(node, g):
    return g.t(node.outputs[0]).size * g.t(node.inputs[1]).shape[1]


@register("QDense", check=_qcheck, macs=_dense_macs)
def emit_qdense(node: ir.Node, g: ir.Graph) -> Kernel:
    n, k = g.t(node.inputs[1]).shape
    m = g.t(node.outputs[0]).size // n
    q = node.attrs["_q"]
    p = dict(_types(g, node), TW=c_type(g.t(node.inputs[1]).dtype), M=m, K=k, N=n, ZY=q["zy"], LO=q["lo"],
             HI=q["hi"])
    return Kernel("qdense", dtype_tag(g.t(node.inputs[0]).dtype), p, node.inputs + node.outputs,
                  desc=f"{m}x{k} . {k}x{n}")


@register("QAdd", check=_qcheck, inplace=True, macs=lambda n, g: g.t(n.outputs[0]).size)
def emit_qadd(node: ir.Node, g: ir.Graph) -> Kernel:
    a, b, y = node.inputs[0], node.inputs[1], node.outputs[0]
    dims, (sa, sb) = broadcast_loops(g.t(y).shape, [g.t(a).shape, g.t(b).shape])
    q = node.attrs["_q"]
    p = {"TA": c_type(g.t(a).dtype), "TB": c_type(g.t(b).dtype), "TY": c_type(g.t(y).dtype),
         "dims": dims, "sa": sa, "sb": sb, "ZA": q["za"], "ZB": q["zb"], "ZY": q["zy"],
         "MA": q["ma"], "MB": q["mb"], "S": q["s"], "LO": q["lo"], "HI": q["hi"],
         "TIES": qadd_ties(g.t(a).dtype, g.t(b).dtype, q["za"], q["zb"], q["ma"], q["mb"], q["s"])}
    return Kernel("qadd", dtype_tag(g.t(y).dtype), p, [a, b, y],
                  desc=f"{list(g.t(a).shape)} + {list(g.t(b).shape)} -> {list(g.t(y).shape)}")


def _pool_check(node, g):
    why = _qcheck(node, g)
    if why:
        return why
    if len(g.t(node.inputs[0]).shape) not in (3, 4):
        return "only 1-D and 2-D pooling"
    return None


def avg_float_params(q: dict, x_dtype, window: int) -> dict:
    """The float32 constants of 8-bit average pooling (docs/quantization.md):
      window:  y = nearbyint(fl(fl(sum of DQ[x] in window order) / count) / s_y) + zy, DQ[x] =
               fl(s_x * (x - zx)), a 256-entry table (a table so that no compiler contracts
               the products into the sum);
      global:  y = nearbyint(fl(float(sum x - n zx) * R)) + zy, R = fl(s_x / fl(s_y * n)).
    All float32, round half to even, the zero point added after rounding as QuantizeLinear does."""
    xs, ys = np.float32(q["xs"]), np.float32(q["ys"])
    info = np.iinfo(x_dtype)
    vals = [i if info.min == 0 or i < 128 else i - 256 for i in range(256)]
    dq = [c_float(np.float32(xs * np.float32(v - q["zx"]))) for v in vals]
    r = np.float32(xs / np.float32(ys * np.float32(window)))
    return {"DQ": dq, "YS": c_float(ys), "R": c_float(r), "WINDOW": window}


POOL_ROW_MAX = 1024     # bytes of stack the 8-bit max pooling may take for one input row


def _interior(p: dict) -> dict:
    """The output rows [OY_LO, OY_HI) and columns [OX_LO, OX_HI) whose pooling window lies
    wholly inside the input (no clipping); FAST where there are any and a row of the input fits
    the kernel's stack buffer (POOL_ROW_MAX bytes: the maximum over the window's rows is kept
    for one output row; ResNet's stem pool needs 112)."""
    def span(o, s, d, k, pad, n):
        lo = min(-(-pad // s), o)
        hi = max(min(o, (n - 1 - (k - 1) * d + pad) // s + 1), lo)
        return lo, hi
    oy = span(p["OH"], p["SH"], p["DH"], p["KH"], p["PT"], p["H"])
    ox = span(p["OW"], p["SW"], p["DW"], p["KW"], p["PL"], p["W"])
    return {"OY_LO": oy[0], "OY_HI": oy[1], "OX_LO": ox[0], "OX_HI": ox[1],
            "FAST": oy[1] > oy[0] and ox[1] > ox[0] and p["W"] <= POOL_ROW_MAX, "ROW_MAX": POOL_ROW_MAX}


def _qpool(node: ir.Node, g: ir.Graph) -> Kernel:
    p = pool_geometry(node, g)
    q = node.attrs["_q"]
    mode = "max" if node.op == "QMaxPool" else "avg"
    p.update(_types(g, node), mode=mode, ZX=q["zx"], ZY=q["zy"], LO=q["lo"], HI=q["hi"],
             include_pad=bool(node.attrs.get("count_include_pad", 0)))
    if mode == "avg":
        p.update(avg_float_params(q, g.t(node.inputs[0]).dtype, p["KH"] * p["KW"]))
        # A window covering the whole (unpadded) input: onnxruntime's QLinearAveragePool then
        # computes a global average pool (integer sum, one float32 multiply).
        p["as_global"] = (p["KH"], p["KW"]) == (p["H"], p["W"]) and not any(
            (p["PT"], p["PL"], p["PB"], p["PR"]))
    else:
        p.update(M=q["m"], S=q["s"], identity=q["identity"], QMIN=int(np.iinfo(g.t(node.inputs[0]).dtype).min))
        p.update(_interior(p))          # the max kernel's unclipped windows
    desc = (f"{mode} {p['KH']}x{p['KW']} stride {p['SH']}x{p['SW']}: "
            f"{p['NC']}x{p['H']}x{p['W']} -> {p['OH']}x{p['OW']}")
    return Kernel("qpool2d", dtype_tag(g.t(node.inputs[0]).dtype), p, [node.inputs[0], node.outputs[0]], desc=desc)


register("QMaxPool", check=_pool_check, macs=pool_macs)(_qpool)
register("QAveragePool", check=_pool_check, macs=pool_macs)(_qpool)


def _qglobal(node: ir.Node, g: ir.Graph) -> Kernel:
    x = g.t(node.inputs[0])
    nc = x.shape[0] * x.shape[1]
    hw = x.size // nc
    q = node.attrs["_q"]
    mode = "max" if node.op == "QGlobalMaxPool" else "avg"
    if mode == "avg":
        m, s = q["table"][hw]
    else:
        m, s = q["m"], q["s"]
    p = dict(_types(g, node), NC=nc, HW=hw, mode=mode, M=m, S=s, ZX=q["zx"], ZY=q["zy"], LO=q["lo"], HI=q["hi"],
             QMIN=int(np.iinfo(x.dtype).min))
    if mode == "avg":
        p.update(avg_float_params(q, x.dtype, hw))
    return Kernel("qglobal_pool", dtype_tag(x.dtype), p, [node.inputs[0], node.outputs[0]],
                  desc=f"{mode} of {nc} channels of {hw}")


register("QGlobalAveragePool", check=_pool_check, macs=lambda n, g: g.t(n.inputs[0]).size)(_qglobal)
register("QGlobalMaxPool", check=_pool_check)(_qglobal)


@register("QSoftmax", check=_qcheck)
def emit_qsoftmax(node: ir.Node, g: ir.Graph) -> Kernel:
    """Softmax on 8-bit integers: a table of exponentials, then QuantizeLinear of e / sum
    (quant.softmax_table)."""
    x = g.t(node.inputs[0])
    ax = node.attrs["axis"]
    q = node.attrs["_q"]
    p = dict(_types(g, node), outer=int(np.prod(x.shape[:ax], dtype=np.int64)), n=int(x.shape[ax]),
             inner=int(np.prod(x.shape[ax + 1:], dtype=np.int64)), table=[c_float(v) for v in q["table"]],
             YS=c_float(q["ys"]), ZY=q["zy"], LO=q["lo"], HI=q["hi"])
    return Kernel("qsoftmax", dtype_tag(x.dtype), p, [node.inputs[0], node.outputs[0]],
                  desc=f"over axis {ax} of {list(x.shape)}")


@register("QRequantize", check=_qcheck, inplace=True)
def emit_qrequantize(node: ir.Node, g: ir.Graph) -> Kernel:
    q = node.attrs["_q"]
    n = g.t(node.outputs[0]).size
    p = dict(_types(g, node), n=n, ZX=q["zx"], ZY=q["zy"], M=q["m"], S=q["s"], LO=q["lo"], HI=q["hi"])
    return Kernel("qrequantize", dtype_tag(g.t(node.inputs[0]).dtype), p, [node.inputs[0], node.outputs[0]],
                  desc=f"{n} elements")


# ---- QuantizeLinear / DequantizeLinear kernels (graph edges and float islands) -------------

def _qdq_params(node: ir.Node, g: ir.Graph):
    from tinydeploy.quant.params import dq_info, q_info
    return dq_info(g, node) if node.op == "DequantizeLinear" else q_info(g, node)


def _dq_check(node: ir.Node, g: ir.Graph) -> str | None:
    x = g.t(node.inputs[0])
    if x.is_const:
        return None   # folded into a float constant by the QDQ pass
    if np.dtype(x.dtype) not in QTYPES + (np.dtype(np.int32),):
        return f"{np.dtype(x.dtype).name} input"
    if _qdq_params(node, g) is None:
        return "non-constant or blocked scale / zero point"
    return None


def verify_qdq(node: ir.Node, g: ir.Graph) -> list[str]:
    """QuantizeLinear / DequantizeLinear: constant scales positive, finite and normal; per-axis
    parameters one per element of the axis; the zero point shaped like the scale (one value may
    have either rank) and 0 for int32 data, which has no zero point."""
    scale = g.const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
    zname = node.inputs[2] if len(node.inputs) > 2 else ""
    zp = g.const(zname)
    x = shape(g, node.inputs[0])
    out = scale_problems(scale, "scale") if scale is not None and scale.size else []
    if node.attrs.get("block_size", 0) or x is None:
        return out
    s, z = shape(g, node.inputs[1]), shape(g, zname)
    # one element each may differ in rank ([] beside [1]: onnxruntime's own quantiser writes that)
    if z is not None and s is not None and z != s and not (int(np.prod(z, dtype=np.int64)) == 1 == int(
            np.prod(s, dtype=np.int64))):
        out.append(f"zero point of shape {list(z)} for a scale of shape {list(s)}")
    if s is not None and int(np.prod(s, dtype=np.int64)) > 1 or (s is not None and len(s) == 1 and s != (1,)):
        ax = int(node.attrs.get("axis", 1))
        p = axis_problem(ax, len(x))
        if p:
            out.append(p)
        elif len(s) != 1 or s[0] != x[ax]:
            out.append(f"per-axis scale of shape {list(s)} for axis {ax} of size {x[ax]}")
    elif s is not None and len(s) > 1:
        out.append(f"scale of shape {list(s)}: a scalar or one value per element of the axis")
    if node.op == "DequantizeLinear" and zp is not None and np.dtype(g.t(node.inputs[0]).dtype) == np.int32 \
            and np.any(zp):
        out.append("int32 data with a nonzero zero point (it must be 0)")
    return out


@register("DequantizeLinear", check=_dq_check, verify=verify_qdq)
def emit_dequantize(node: ir.Node, g: ir.Graph) -> Kernel:
    info = _qdq_params(node, g)
    x = g.t(node.inputs[0])
    if info.axis is None:
        outer, ch, inner = 1, 1, x.size
    else:
        outer = int(np.prod(x.shape[:info.axis], dtype=np.int64))
        ch = x.shape[info.axis]
        inner = int(np.prod(x.shape[info.axis + 1:], dtype=np.int64))
    zps = np.broadcast_to(info.zp, (ch,)) if info.zp.size > 1 or ch > 1 else info.zp
    p = {"TX": c_type(x.dtype), "outer": outer, "channels": ch, "inner": inner,
         "scales": [c_float(v) for v in np.broadcast_to(info.scale, (ch,))],
         "zps": [int(v) for v in zps.reshape(-1)]}
    return Kernel("dequantize", dtype_tag(x.dtype), p, [node.inputs[0], node.outputs[0]],
                  desc=f"{x.size} elements" + (f", {ch} channels" if ch > 1 else ""))


def _q_check(node: ir.Node, g: ir.Graph) -> str | None:
    x = g.t(node.inputs[0])
    if not x.is_const and np.dtype(x.dtype) != np.float32:
        return f"{np.dtype(x.dtype).name} input"
    if _qdq_params(node, g) is None:
        return "only per-tensor quantisation to int8/uint8 with constant scale and zero point"
    return None


@register("QuantizeLinear", check=_q_check, verify=verify_qdq)
def emit_quantize(node: ir.Node, g: ir.Graph) -> Kernel:
    info = _qdq_params(node, g)
    y = g.t(node.outputs[0])
    info_t = np.iinfo(y.dtype)
    p = {"TY": c_type(y.dtype), "n": y.size, "scale": c_float(info.s), "zp": info.z, "zpf": c_float(info.z),
         "lof": c_float(info_t.min), "hif": c_float(info_t.max)}
    return Kernel("quantize", dtype_tag(y.dtype), p, [node.inputs[0], node.outputs[0]], desc=f"{y.size} elements")
