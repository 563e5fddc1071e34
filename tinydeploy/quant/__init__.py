"""Quantised (QDQ) models -> integer operators.

ONNX carries 8-bit models as QuantizeLinear / DequantizeLinear (Q / DQ) nodes around float
operators: `Q(op(DQ(x), DQ(w), DQ(b)))`. The `quantize_qdq` pass (first in passes.PASSES; a no-op
for graphs without Q/DQ) recognises those islands and replaces each with one integer operator
whose requantisation constants are computed here, at build time:

  QConv            DQ(x) -> Conv(DQ(w), DQ(b)) [-> Relu/Clip] -> Q
  QDense           DQ(x) -> MatMul(DQ(w)) [-> Add(DQ(b))] [-> Relu/Clip] -> Q, and Gemm
  QAdd             DQ(a), DQ(b) -> Add [-> Relu/Clip] -> Q   (any scales, numpy broadcasting)
  QAveragePool, QMaxPool, QGlobalAveragePool, QGlobalMaxPool
                   DQ(x) -> pool [-> Relu/Clip] -> Q
  data movement    DQ(x) -> Reshape/Transpose/Slice/Concat/... -> Q with equal scale and zero
                   point: the op itself runs on the integers (a copy or a view)
  QRequantize      DQ(x) [-> Relu/Clip] -> Q: a change of scale / zero point / type, clamped
  QSoftmax         DQ(x) -> Softmax -> Q (same 8-bit type): a float32 table of exponentials

QOperator models (QLinearConv, com.microsoft QLinearAdd, ...) reach this pass in QDQ form
(tinydeploy/frontend/qoperator.py rewrites them on import). Refused with a reason (`scheme_problem`):
4-bit, float8 and 16-bit Q/DQ, blocked quantisation, run-time scales, MatMulInteger/ConvInteger.

Relu / Clip between the op and its Q become the output clamp range (Q is monotone, so
Q(clip(v, a, b)) = clamp(Q(v), Q(a), Q(b))). Whatever does not match stays float: a remaining
DQ of a runtime tensor becomes a `DequantizeLinear` kernel, a remaining Q a `QuantizeLinear`
kernel, and the float operators between them run as usual (a "float island", e.g. a Sigmoid or a
Softmax between different 8-bit types); graph.notes says so. A DQ of a constant that a float
operator still uses is folded into a float32 constant.

The arithmetic of every integer operator, its rounding and its float32 steps, is defined in
docs/quantization.md; tinydeploy/quant/exact.py implements that definition in numpy, and every kernel
variant is tested against it bit for bit. In short: int32 accumulators on w - zw, the input
zero point folded into the bias where no padding is read; the multiplier r = s_x s_w / s_y
(float32, as a float implementation forms it) held exactly as M * 2**-S; QConv / QDense round
f32(f32(acc) * r), QAdd / QRequantize round the exact acc * M / 2**S; ties to even, the zero
point added after rounding, as QuantizeLinear does.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np

from tinydeploy import ir

QTYPES = (np.dtype(np.int8), np.dtype(np.uint8))
MOVES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Slice", "Concat", "Gather",
         "Expand", "Identity")


# --------------------------------------------------------------------------------------------
# Fixed-point requantisation (the C kernels implement exactly this)

def quantize_multiplier(r: float) -> tuple[int, int]:
    """(M, S) with r ~= M * 2**-S, 2**30 <= M < 2**31 and 1 <= S <= 62. Exact for any float32
    r in [2**-31, 2**30) (a float32 has 24 significant bits, M keeps 31). Smaller r lose low bits
    (M may reach 0: the output is then the zero point); larger r saturate every nonzero input."""
    r = float(r)
    if not (r > 0.0) or not math.isfinite(r):
        return 0, 1
    mant, exp = math.frexp(r)                      # r = mant * 2**exp, 0.5 <= mant < 1
    m = int(round(mant * (1 << 31)))
    if m == 1 << 31:
        m, exp = m >> 1, exp + 1
    s = 31 - exp
    if s > 62:
        m, s = int(round(m / 2.0 ** (s - 62))), 62
    if s < 1:
        m, s = (1 << 31) - 1, 1
    return m, s


def ties_possible(acc_bound, m, s) -> bool:
    """Whether acc * m / 2**s can be exactly halfway between two integers for some
    |acc| <= acc_bound (per channel arrays broadcast). That needs acc * m = (2k + 1) 2**(s-1),
    i.e. v2(acc) = s - 1 - v2(m): impossible when |acc| < 2**(s - 1 - v2(m)). Kernels without
    possible ties may round half up (cheaper) with identical results."""
    for b, mm, ss in np.broadcast(np.asarray(acc_bound, dtype=object), np.asarray(m, dtype=object),
                                  np.asarray(s, dtype=object)):
        mm, ss = int(mm), int(ss)
        if mm == 0:
            continue
        tz = (mm & -mm).bit_length() - 1
        if ss - 1 - tz <= 0 or int(b) >= 1 << (ss - 1 - tz):
            return True
    return False


def qrange(dtype) -> tuple[int, int]:
    info = np.iinfo(np.dtype(dtype))
    return int(info.min), int(info.max)


def quantize_value(v: float, scale: float, zp: int, dtype) -> int:
    """onnxruntime's QuantizeLinear of one float: saturate(nearbyint(v / scale) + zp)."""
    lo, hi = qrange(dtype)
    q = float(np.rint(np.float32(v) / np.float32(scale))) + zp
    return int(min(max(q, lo), hi))


# --------------------------------------------------------------------------------------------
# Reading Q / DQ nodes

class QInfo:
    """What a DequantizeLinear output is: src (integer tensor), per-tensor or per-axis params."""

    def __init__(self, src: str, scale: np.ndarray, zp: np.ndarray, axis: int | None, dtype, data=None):
        self.src, self.scale, self.zp, self.axis, self.dtype, self.data = src, scale, zp, axis, dtype, data

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1 and self.zp.size == 1

    @property
    def s(self) -> np.float32:
        return np.float32(self.scale.reshape(-1)[0])

    @property
    def z(self) -> int:
        return int(self.zp.reshape(-1)[0])


def _params(g: ir.Graph, node: ir.Node, x_dtype) -> tuple[np.ndarray, np.ndarray, int | None] | None:
    """(scale float32, zero point int64, axis or None) of a Q/DQ node with constant params."""
    scale = g.const(node.inputs[1]) if len(node.inputs) > 1 else None
    if scale is None or node.attrs.get("block_size", 0):
        return None
    zp = g.const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    if len(node.inputs) > 2 and node.inputs[2] and zp is None:
        return None
    if zp is None:
        zp = np.zeros(scale.shape, dtype=np.int64)
    scale = np.asarray(scale, dtype=np.float32)
    zp = np.asarray(zp).astype(np.int64)
    axis = None
    if scale.size > 1 or scale.ndim == 1 and zp.size > 1:
        axis = int(node.attrs.get("axis", 1))
    if scale.size > 1 or zp.size > 1:
        if scale.ndim != 1 or (zp.size > 1 and zp.shape != scale.shape):
            return None
    return scale.reshape(-1), zp.reshape(-1), axis


def dq_info(g: ir.Graph, node: ir.Node) -> QInfo | None:
    x = g.t(node.inputs[0])
    p = _params(g, node, x.dtype)
    if p is None:
        return None
    scale, zp, axis = p
    if axis is not None:
        axis %= max(len(x.shape), 1)
        if x.shape[axis] != scale.size:
            return None
    return QInfo(node.inputs[0], scale, zp, axis, np.dtype(x.dtype), x.data)


def q_info(g: ir.Graph, node: ir.Node) -> QInfo | None:
    """Per-tensor QuantizeLinear to int8/uint8 only (the form activations take)."""
    y = g.t(node.outputs[0])
    if np.dtype(y.dtype) not in QTYPES or node.attrs.get("saturate", 1) != 1:
        return None
    p = _params(g, node, y.dtype)
    if p is None or p[0].size != 1 or p[1].size != 1:
        return None
    return QInfo(node.outputs[0], p[0], p[1], None, np.dtype(y.dtype))


def dequantize_const(info: QInfo, shape) -> np.ndarray:
    """ONNX DequantizeLinear of constant data, in float32 like onnxruntime: (x - zp) * scale."""
    x = info.data.astype(np.int64)
    if info.axis is None:
        return ((x - info.z).astype(np.float32) * info.s).astype(np.float32)
    bshape = [1] * x.ndim
    bshape[info.axis] = -1
    return ((x - info.zp.reshape(bshape)).astype(np.float32) * info.scale.reshape(bshape)).astype(np.float32)


# --------------------------------------------------------------------------------------------
# The pass

# --------------------------------------------------------------------------------------------
# Quantisation schemes tinydeploy refuses (reported by ops.unsupported_nodes with the node name)

def scheme_problem(node: ir.Node, g: ir.Graph) -> str | None:
    """Why the quantisation scheme of Q/DQ (and dynamic-quantisation) node `node` is not
    supported, or None. The QDQ pass leaves such nodes alone, so they reach the support check."""
    if node.op in ("MatMulInteger", "ConvInteger"):
        return ("dynamic quantisation (an int32 accumulator whose scale is only known at run time) is not "
                "supported; quantise statically instead (tinydeploy quantize)")
    if node.op not in ("QuantizeLinear", "DequantizeLinear"):
        return None
    ints = [node.inputs[0] if node.op == "DequantizeLinear" else node.outputs[0]]
    if len(node.inputs) > 2 and node.inputs[2]:
        ints.append(node.inputs[2])
    for name in ints:
        t = g.tensors.get(name)
        if t is None:
            continue
        dt = np.dtype(t.dtype)
        if dt.name in ("int4", "uint4", "int2", "uint2"):
            return f"{dt.name[-1]}-bit ({dt.name}) quantisation is not supported (only 8-bit int8/uint8)"
        if dt.name.startswith("float8") or dt.name.startswith("float4"):
            return f"{dt.name} quantisation is not supported (only 8-bit integers int8/uint8)"
        if dt.kind in "iu" and dt.itemsize == 2:
            what = "activations" if not t.is_const else "weights"
            return f"16-bit ({dt.name}) {what} are not supported (only int8/uint8, and int32 biases)"
    if int(node.attrs.get("block_size", 0) or 0):
        return (f"blocked quantisation (block_size={node.attrs['block_size']}) is not supported "
                "(only per-tensor and per-channel scales)")
    for k, what in ((1, "scale"), (2, "zero point")):
        if len(node.inputs) > k and node.inputs[k] and g.const(node.inputs[k]) is None:
            return (f"{what} {node.inputs[k]!r} is not a constant (quantisation parameters must be known "
                    "at build time)")
    return None


class _Ctx:
    def __init__(self, g: ir.Graph):
        self.g = g
        self.deq: dict[str, QInfo] = {}
        for n in g.nodes:
            if n.op == "DequantizeLinear" and scheme_problem(n, g) is None:
                info = dq_info(g, n)
                if info is not None:
                    self.deq[n.outputs[0]] = info

    def runtime(self, name: str) -> QInfo | None:
        """The per-tensor 8-bit integer tensor behind float tensor `name`, if it is a DQ of one."""
        info = self.deq.get(name)
        if info is None or info.data is not None or not info.per_tensor or info.dtype not in QTYPES:
            return None
        return info

    def const(self, name: str) -> QInfo | None:
        info = self.deq.get(name)
        return info if info is not None and info.data is not None else None


def _sole_use(g: ir.Graph, name: str, user: ir.Node) -> bool:
    if name in g.outputs:
        return False
    users = g.consumers(name)
    return len(users) == 1 and users[0] is user and user.inputs.count(name) == 1


def _clamp_from_activation(g: ir.Graph, act: ir.Node, yq: QInfo, lo: int, hi: int) -> tuple[int, int] | None:
    if act.op == "Relu":
        return max(lo, quantize_value(0.0, yq.s, yq.z, yq.dtype)), hi
    if act.op == "Clip":
        a = g.const(act.inputs[1]) if len(act.inputs) > 1 and act.inputs[1] else None
        b = g.const(act.inputs[2]) if len(act.inputs) > 2 and act.inputs[2] else None
        if (len(act.inputs) > 1 and act.inputs[1] and a is None) or (len(act.inputs) > 2 and act.inputs[2] and b is None):
            return None
        if a is None and "min" in act.attrs:
            a = act.attrs["min"]
        if b is None and "max" in act.attrs:
            b = act.attrs["max"]
        if a is not None:
            lo = max(lo, quantize_value(float(np.asarray(a).reshape(-1)[0]), yq.s, yq.z, yq.dtype))
        if b is not None:
            hi = min(hi, quantize_value(float(np.asarray(b).reshape(-1)[0]), yq.s, yq.z, yq.dtype))
        return lo, hi
    return None


def _channel_params(info: QInfo, n_out: int, axis: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-output-channel (scale, zp) arrays of a weight DQ, when its axis is the output axis."""
    if info.axis is None:
        return np.full(n_out, info.s, np.float32), np.full(n_out, info.z, np.int64)
    if info.axis != axis or info.scale.size != n_out:
        return None
    zp = info.zp if info.zp.size == n_out else np.full(n_out, info.zp[0], np.int64)
    return info.scale.astype(np.float32), zp


def _weights(w: np.ndarray, zp_w: np.ndarray, bshape) -> np.ndarray:
    """w - zp_w, kept in the weight type when the zero point is 0, else int16."""
    if not np.any(zp_w):
        return np.ascontiguousarray(w)
    return np.ascontiguousarray((w.astype(np.int32) - zp_w.reshape(bshape)).astype(np.int16))


def _bias_acc(g: ir.Graph, ctx: _Ctx, name: str, n_out: int, acc_scale: np.ndarray, beta: float = 1.0) -> np.ndarray | None:
    """The bias in accumulator units (real / (s_x * s_w[c])), int64 [n_out]."""
    if not name:
        return np.zeros(n_out, np.int64)
    info = ctx.const(name)
    if info is not None:
        b = info.data.reshape(-1).astype(np.int64)
        if b.size not in (1, n_out):
            return None
        b = np.broadcast_to(b, (n_out,))
        sb = np.broadcast_to(info.scale.astype(np.float32), (n_out,)) if info.scale.size in (1, n_out) else None
        zb = np.broadcast_to(info.zp, (n_out,)) if info.zp.size in (1, n_out) else None
        if sb is None or zb is None:
            return None
        if beta == 1.0 and np.array_equal(sb, acc_scale) and not np.any(zb):
            return b.copy()
        real = (b - zb).astype(np.float64) * sb.astype(np.float64) * beta
    else:
        data = g.const(name)
        if data is None or data.dtype.kind != "f" or data.size not in (1, n_out):
            return None
        real = np.broadcast_to(data.reshape(-1).astype(np.float64), (n_out,)) * beta
    with np.errstate(divide="ignore", invalid="ignore"):
        acc = np.where(acc_scale > 0, real / acc_scale.astype(np.float64), 0.0)
    return np.rint(acc).astype(np.int64)


def _multipliers(g: ir.Graph, base: str, r: np.ndarray) -> tuple[str, str]:
    ms = [quantize_multiplier(float(v)) for v in r.reshape(-1)]
    mname, sname = g.fresh_name(base + "_qmult"), g.fresh_name(base + "_qshift")
    g.tensors[mname] = ir.Tensor(mname, (len(ms),), np.dtype(np.int32), data=np.array([m for m, _ in ms], np.int32))
    g.tensors[sname] = ir.Tensor(sname, (len(ms),), np.dtype(np.int32), data=np.array([s for _, s in ms], np.int32))
    return mname, sname


def _const(g: ir.Graph, base: str, data: np.ndarray) -> str:
    name = g.fresh_name(base)
    g.tensors[name] = ir.Tensor(name, tuple(data.shape), data.dtype, data=data)
    return name


def _fit_int32(a: np.ndarray, w: np.ndarray | None = None, x_dtype=None, zp_x: int = 0) -> np.ndarray | None:
    """a as int32, or None when it, or an accumulator starting from it and adding
    sum |x - zp_x| * |w| over a row of w (worst case input), could leave the int32 range."""
    if a.size and (a.min() < -2**31 or a.max() >= 2**31):
        return None
    if w is not None:
        lo, hi = qrange(x_dtype)
        xmax = max(abs(lo), abs(hi), abs(lo - zp_x), abs(hi - zp_x))
        worst = np.abs(a.astype(np.int64)) + xmax * np.abs(w.reshape(a.size, -1).astype(np.int64)).sum(axis=1)
        if worst.max(initial=0) >= 2**31:
            return None
    return a.astype(np.int32)


def _match_conv(ctx: _Ctx, p: ir.Node, yq: QInfo, lo: int, hi: int) -> ir.Node | None:
    g = ctx.g
    x = ctx.runtime(p.inputs[0])
    w = ctx.const(p.inputs[1])
    if x is None or w is None or w.dtype not in QTYPES or len(g.t(p.inputs[0]).shape) not in (3, 4):
        return None
    wdata = w.data
    n_out = wdata.shape[0]
    ch = _channel_params(w, n_out, 0)
    if ch is None:
        return None
    sw, zw = ch
    acc_scale = (x.s * sw).astype(np.float32)                # float32, as onnxruntime computes it
    r = (acc_scale / yq.s).astype(np.float32)
    bias = _bias_acc(g, ctx, p.inputs[2] if len(p.inputs) > 2 else "", n_out, acc_scale)
    if bias is None:
        return None
    bshape = (-1,) + (1,) * (wdata.ndim - 1)
    wq = _weights(wdata, zw, bshape)
    a = p.attrs
    rank = len(g.t(p.inputs[0]).shape) - 2
    pads = list(a.get("pads", [0] * (2 * rank)))
    padded = any(pads) or a.get("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER")
    zp_in_loop = bool(padded and x.z != 0)
    if not zp_in_loop:
        bias = bias - x.z * wq.reshape(n_out, -1).astype(np.int64).sum(axis=1)
    b32 = _fit_int32(bias, wq, x.dtype, x.z if zp_in_loop else 0)
    if b32 is None:
        return None
    base = p.outputs[0]
    wname = _const(g, base + "_qweight", wq)
    bname = _const(g, base + "_qbias", b32)
    mname, sname = _multipliers(g, base, r)
    attrs = {k: v for k, v in a.items() if not k.startswith("_")}
    attrs["_q"] = {"zx": x.z, "zy": yq.z, "lo": lo, "hi": hi, "zp_in_loop": zp_in_loop}
    return ir.Node("QConv", p.name, [x.src, wname, bname, mname, sname], [yq.src], attrs, onnx_op=p.onnx_op)


def _match_dense(ctx: _Ctx, p: ir.Node, yq: QInfo, lo: int, hi: int, bias_name: str = "",
                 extra: str = "") -> ir.Node | None:
    """MatMul (2-D constant weights) or Gemm; `bias_name` is the other input of a following Add."""
    g = ctx.g
    x = ctx.runtime(p.inputs[0])
    w = ctx.const(p.inputs[1])
    if x is None or w is None or w.dtype not in QTYPES or w.data.ndim != 2:
        return None
    alpha, beta = 1.0, 1.0
    wdata = w.data
    out_axis = 1
    if p.op == "Gemm":
        if p.attrs.get("transA", 0):
            return None
        alpha, beta = float(p.attrs.get("alpha", 1.0)), float(p.attrs.get("beta", 1.0))
        if p.attrs.get("transB", 0):
            out_axis = 0
        if len(p.inputs) > 2 and p.inputs[2]:
            if bias_name:
                return None
            bias_name = p.inputs[2]
    w_nk = wdata if out_axis == 0 else wdata.T
    n_out, k = w_nk.shape
    xs = g.t(p.inputs[0]).shape
    if xs[-1] != k:
        return None
    ch = _channel_params(w, n_out, out_axis)
    if ch is None:
        return None
    sw, zw = ch
    acc_scale = (x.s * sw).astype(np.float32)
    r = (acc_scale / yq.s).astype(np.float32)
    if alpha != 1.0:
        r = (r * np.float32(alpha)).astype(np.float32)
        acc_scale = (acc_scale * np.float32(alpha)).astype(np.float32)
    if bias_name:
        bt = g.t(bias_name)
        if bt.size != n_out and bt.size != 1:
            return None
    bias = _bias_acc(g, ctx, bias_name, n_out, acc_scale, beta)
    if bias is None:
        return None
    wq = _weights(np.ascontiguousarray(w_nk), zw, (-1, 1))
    bias = bias - x.z * wq.astype(np.int64).sum(axis=1)
    b32 = _fit_int32(bias, wq, x.dtype)
    if b32 is None:
        return None
    base = p.outputs[0]
    wname = _const(g, base + "_qweight_nk", wq)
    bname = _const(g, base + "_qbias", b32)
    mname, sname = _multipliers(g, base, r)
    attrs = {"_q": {"zx": x.z, "zy": yq.z, "lo": lo, "hi": hi}}
    return ir.Node("QDense", p.name, [x.src, wname, bname, mname, sname], [yq.src], attrs,
                   onnx_op=p.onnx_op + extra)


def _add_multipliers(ra: float, rb: float) -> tuple[int, int, int]:
    """Ma, Mb, S with ra ~= Ma 2**-S, rb ~= Mb 2**-S, max(Ma, Mb) < 2**31, S <= 62."""
    top = max(ra, rb)
    if not (top > 0) or not math.isfinite(top):
        return 0, 0, 1
    _, exp = math.frexp(top)
    s = min(62, 31 - exp)
    if s < 1:
        return min((1 << 31) - 1, int(round(ra * 2))), min((1 << 31) - 1, int(round(rb * 2))), 1
    ma, mb = int(round(ra * 2.0 ** s)), int(round(rb * 2.0 ** s))
    ma, mb = min(ma, (1 << 31) - 1), min(mb, (1 << 31) - 1)
    return ma, mb, s


def _match_add(ctx: _Ctx, p: ir.Node, yq: QInfo, lo: int, hi: int) -> ir.Node | None:
    if len(p.inputs) != 2:
        return None
    a, b = ctx.runtime(p.inputs[0]), ctx.runtime(p.inputs[1])
    if a is None or b is None:
        return None
    ra = float(np.float32(a.s) / np.float32(yq.s))
    rb = float(np.float32(b.s) / np.float32(yq.s))
    ma, mb, s = _add_multipliers(ra, rb)
    attrs = {"_q": {"za": a.z, "zb": b.z, "zy": yq.z, "ma": ma, "mb": mb, "s": s, "lo": lo, "hi": hi}}
    return ir.Node("QAdd", p.name, [a.src, b.src], [yq.src], attrs, onnx_op=p.onnx_op)


def _match_pool(ctx: _Ctx, p: ir.Node, yq: QInfo, lo: int, hi: int) -> ir.Node | None:
    g = ctx.g
    x = ctx.runtime(p.inputs[0])
    if x is None or len(g.t(p.inputs[0]).shape) not in (3, 4) or (len(p.outputs) > 1 and p.outputs[1]):
        return None
    if p.op in ("MaxPool", "AveragePool") and p.attrs.get("storage_order", 0):
        return None
    r = float(np.float32(x.s) / np.float32(yq.s))
    q = {"zx": x.z, "zy": yq.z, "lo": lo, "hi": hi, "r": r, "xs": float(x.s), "ys": float(yq.s)}
    if p.op in ("AveragePool", "GlobalAveragePool"):
        xs = g.t(p.inputs[0]).shape
        window = int(np.prod(p.attrs["kernel_shape"])) if p.op == "AveragePool" else int(np.prod(xs[2:]))
        # One multiplier per possible divisor (window clipped by the borders), r / count.
        q["table"] = [quantize_multiplier(float(np.float64(x.s) / np.float64(yq.s) / c)) if c else (0, 1)
                      for c in range(window + 1)]
    else:
        q["m"], q["s"] = quantize_multiplier(r)
        q["identity"] = bool(x.s == yq.s and x.z == yq.z)
    attrs = {k: v for k, v in p.attrs.items() if not k.startswith("_")}
    attrs["_q"] = q
    return ir.Node("Q" + p.op, p.name, [x.src], [yq.src], attrs, onnx_op=p.onnx_op)


def softmax_table(x_scale: float, n: int) -> list[float]:
    """The float32 exponentials of QSoftmax: table[i] = float32(exp((i - 255 + b) * s_x)) computed
    in double, for the 256 possible values of x - max (i = x - max + 255). b = max(0, ln(FLT_MAX /
    n) - 5) / s_x shifts every entry by the same factor e^(b s_x), which cancels in e_k / sum but
    keeps entries from underflowing to 0 for large s_x and the sum of n entries finite."""
    xs = float(np.float32(x_scale))
    b = max(0.0, math.log(float(np.finfo(np.float32).max) / n) - 5.0) / xs
    table = [float(np.float32(math.exp((i - 255 + b) * xs))) for i in range(256)]
    return table


def _match_softmax(ctx: _Ctx, p: ir.Node, yq: QInfo, lo: int, hi: int) -> ir.Node | None:
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


def _match_move(ctx: _Ctx, p: ir.Node, yq: QInfo, lo: int, hi: int) -> ir.Node | None:
    """Data movement between a DQ and a Q with identical parameters runs on the integers."""
    g = ctx.g
    if len(p.outputs) != 1 or (lo, hi) != qrange(yq.dtype):
        return None
    ins = p.inputs[:1] if p.op not in ("Concat",) else p.inputs
    new_inputs = list(p.inputs)
    for k, name in enumerate(ins):
        info = ctx.runtime(name)
        if info is None or info.s != yq.s or info.z != yq.z or info.dtype != yq.dtype:
            return None
        new_inputs[k] = info.src
    return ir.Node(p.op, p.name, new_inputs, [yq.src], dict(p.attrs), onnx_op=p.onnx_op)


def _match_requant(ctx: _Ctx, t: str, yq: QInfo, lo: int, hi: int, dq: ir.Node) -> ir.Node | None:
    x = ctx.runtime(t)
    if x is None:
        return None
    m, s = quantize_multiplier(float(np.float32(x.s) / np.float32(yq.s)))
    attrs = {"_q": {"zx": x.z, "zy": yq.z, "m": m, "s": s, "lo": lo, "hi": hi}}
    return ir.Node("QRequantize", dq.name, [x.src], [yq.src], attrs, onnx_op="DequantizeLinear")


def quantize_qdq(g: ir.Graph) -> None:
    """The pass: see the module docstring."""
    if not any(n.op in ("QuantizeLinear", "DequantizeLinear") for n in g.nodes):
        return
    ctx = _Ctx(g)
    fused: Counter = Counter()
    for q in list(g.nodes):
        if q.op != "QuantizeLinear" or q not in g.nodes:
            continue
        yq = q_info(g, q)
        if yq is None:
            continue
        lo, hi = qrange(yq.dtype)
        t, user, chain = q.inputs[0], q, []
        p = g.producer(t)
        ok = True
        while p is not None and p.op in ("Relu", "Clip") and _sole_use(g, t, user):
            rng = _clamp_from_activation(g, p, yq, lo, hi)
            if rng is None:
                ok = False
                break
            lo, hi = rng
            chain.append(p)
            t, user = p.inputs[0], p
            p = g.producer(t)
        if not ok or p is None:
            continue
        new, removed = None, [p]
        if p.op == "DequantizeLinear":           # Q([Relu/Clip](DQ(x))): rescale and clamp
            new, removed = _match_requant(ctx, t, yq, lo, hi, p), []
        elif not _sole_use(g, t, user):
            continue
        elif p.op == "Conv":
            new = _match_conv(ctx, p, yq, lo, hi)
        elif p.op in ("MatMul", "Gemm"):
            new = _match_dense(ctx, p, yq, lo, hi)
        elif p.op == "Add":
            new = _match_add(ctx, p, yq, lo, hi)
            if new is None:   # MatMul -> Add(bias)
                for k in (0, 1):
                    mm = g.producer(p.inputs[k])
                    other = p.inputs[1 - k]
                    if (mm is not None and mm.op == "MatMul" and _sole_use(g, p.inputs[k], p)
                            and (ctx.const(other) is not None or g.const(other) is not None)):
                        new = _match_dense(ctx, mm, yq, lo, hi, bias_name=other, extra="+Add")
                        if new is not None:
                            removed = [p, mm]
                            break
        elif p.op in ("AveragePool", "MaxPool", "GlobalAveragePool", "GlobalMaxPool"):
            new = _match_pool(ctx, p, yq, lo, hi)
        elif p.op in MOVES:
            new = _match_move(ctx, p, yq, lo, hi)
        elif p.op == "Softmax":
            new = _match_softmax(ctx, p, yq, lo, hi)
        if new is None:
            continue
        if chain:
            new.onnx_op += "+" + "+".join(c.op for c in chain)
        g.nodes[g.nodes.index(q)] = new
        g.t(yq.src).quant = ir.QuantParams(yq.scale, yq.zp, None)
        for n in removed + chain:
            g.nodes.remove(n)
        fused[new.op] += 1
    g.prune()

    # What is left: DQ of constants used by float ops -> float constants; DQ / Q of runtime
    # tensors -> DequantizeLinear / QuantizeLinear kernels around float islands.
    islands: Counter = Counter()
    for n in list(g.nodes):
        if n.op != "DequantizeLinear":
            continue
        info = ctx.deq.get(n.outputs[0])
        if info is not None and info.data is not None:
            out = g.t(n.outputs[0])
            out.data = dequantize_const(info, info.data.shape).reshape(out.shape)
            out.dtype = np.dtype(np.float32)
            g.nodes.remove(n)
        else:
            for u in g.consumers(n.outputs[0]):
                if u.op not in ("QuantizeLinear", "DequantizeLinear"):
                    islands[u.op] += 1
    g.prune()
    for n in g.nodes:
        if n.op in ("QuantizeLinear", "DequantizeLinear"):
            info = dq_info(g, n) if n.op == "DequantizeLinear" else q_info(g, n)
            name = n.inputs[0] if n.op == "DequantizeLinear" else n.outputs[0]
            if info is not None and np.dtype(g.t(name).dtype) in QTYPES:
                g.t(name).quant = ir.QuantParams(info.scale, info.zp, info.axis)
    for info in ctx.deq.values():
        t = g.tensors.get(info.src)
        if t is not None and not t.is_const and info.per_tensor and t.quant is None:
            t.quant = ir.QuantParams(info.scale, info.zp, None)
    notes = []
    if fused:
        notes.append("quantised: " + ", ".join(f"{op} x{c}" for op, c in sorted(fused.items()))
                     + " run as integer kernels")
    if islands:
        nq = sum(1 for n in g.nodes if n.op == "QuantizeLinear")
        nd = sum(1 for n in g.nodes if n.op == "DequantizeLinear")
        notes.append("float island: " + ", ".join(f"{op} x{c}" for op, c in sorted(islands.items()))
                     + f" run in float32 between {nd} DequantizeLinear and {nq} QuantizeLinear kernel(s)")
    g.notes.extend(n for n in notes if n not in g.notes)   # the pass may run twice (pipeline, PASSES)
