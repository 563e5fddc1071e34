"""Gemm and MatMul. A product with constant weights becomes a fully connected layer
(weights stored [K][N] so the inner loop runs over contiguous outputs and vectorises without
reassociating float sums); a product of two runtime tensors is a batched matmul."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.ops.registry import Kernel, dtype_tag, float_only, new_const, register, register_qdq
from tinydeploy.quant.params import (QTYPES, QCtx, QInfo, add_const, add_multipliers, bias_acc, channel_params,
                                     exact_ratios, fit_int32, sole_use, weights_minus_zp)
from tinydeploy.ops.elementwise import broadcast_loops, epilogue
from tinydeploy.ops.verify import shape


def _gemm_check(node, g):
    a = node.attrs
    if g.const(node.inputs[1]) is None:
        return "non-constant B"
    if a.get("transA", 0) and g.const(node.inputs[0]) is None:
        return "transA=1 with a non-constant A"
    if len(node.inputs) > 2 and node.inputs[2] and g.const(node.inputs[2]) is None:
        return "non-constant C"
    return float_only(node, g)


def verify_gemm(node, g) -> list[str]:
    """A and B matrices whose inner dimensions agree; C broadcastable to the [M, N] result."""
    a, b = shape(g, node.inputs[0]), shape(g, node.inputs[1])
    c = shape(g, node.inputs[2]) if len(node.inputs) > 2 else None
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return [f"A and B must be matrices (ranks {len(a) if a else '?'} and {len(b) if b else '?'})"]
    (m, ka), (kb, n) = a[::-1] if node.attrs.get("transA", 0) else a, b[::-1] if node.attrs.get("transB", 0) else b
    if ka != kb:
        return [f"A is {m}x{ka} and B is {kb}x{n} after transposition: the inner dimensions differ"]
    if c is not None:
        try:
            np.broadcast_shapes(tuple(c), (m, n))
            if len(c) > 2 or np.broadcast_shapes(tuple(c), (m, n)) != (m, n):
                raise ValueError
        except ValueError:
            return [f"C of shape {'x'.join(map(str, c))} does not broadcast to the {m}x{n} result"]
    return []


def _gemm_macs(node, g):
    y = g.t(node.outputs[0])
    b = g.t(node.inputs[1])
    k = b.shape[1] if node.attrs.get("transB", 0) else b.shape[0]
    return y.size * k


def fc_kernel(node, g, x: str, w_kn: np.ndarray, bias: np.ndarray | None, y: str, consts: dict | None = None) -> Kernel:
    """y[M][N] = act(x[M][K] . w[K][N] + bias), with the prepared constants as the kernel's own
    (`consts`: a transposed A may already be there). A bias that differs per row (Gemm's C of
    shape [M, N]) is kept whole, otherwise as one row [N]."""
    k, n = w_kn.shape
    m = g.t(y).size // n
    consts = dict(consts or {})
    wname = new_const(g, consts, node.outputs[0] + "_weight_kn", w_kn.astype(np.float32))
    args, bias_2d = [x, wname], False
    if bias is not None:
        full = np.broadcast_to(bias.astype(np.float32), (m, n))
        bias_2d = m > 1 and not (full == full[:1]).all()
        args.append(new_const(g, consts, node.outputs[0] + "_bias", full if bias_2d else full[0]))
    args.append(y)
    return Kernel("dense", dtype_tag(g.t(y).dtype),
                  {"M": m, "K": k, "N": n, "has_bias": bias is not None, "bias_2d": bias_2d,
                   **epilogue(node)}, args, desc=f"{m}x{k} . {k}x{n}", consts=consts)


# ---- 8-bit: the QDQ matches (quant/qdq.py runs them) -------------------------------------------

def qdq_dense(ctx: QCtx, p: ir.Node, yq: QInfo, lo: int, hi: int, bias_name: str = "",
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
    ch = channel_params(w, n_out, out_axis)
    if ch is None:
        return None
    sw, zw = ch
    acc_scale = (x.s * sw).astype(np.float32)
    r = (acc_scale / yq.s).astype(np.float32)
    if alpha != 1.0:
        r = (r * np.float32(alpha)).astype(np.float32)
        acc_scale = (acc_scale * np.float32(alpha)).astype(np.float32)
    if not exact_ratios(r):
        return None
    if bias_name:
        bt = g.t(bias_name)
        if bt.size != n_out and bt.size != 1:
            return None
    bias = bias_acc(g, ctx, bias_name, n_out, acc_scale, beta, r=r)
    if bias is None:
        return None
    wq = weights_minus_zp(np.ascontiguousarray(w_nk), zw, (-1, 1))
    bias = bias - x.z * wq.astype(np.int64).sum(axis=1)
    b32 = fit_int32(bias, wq, x.dtype)
    if b32 is None:
        return None
    base = p.outputs[0]
    wname = add_const(g, base + "_qweight_nk", wq)
    bname = add_const(g, base + "_qbias", b32)
    mname, sname = add_multipliers(g, base, r)
    attrs = {"_q": {"zx": x.z, "zy": yq.z, "lo": lo, "hi": hi}}
    return ir.Node("QDense", p.name, [x.src, wname, bname, mname, sname], [yq.src], attrs,
                   onnx_op=p.onnx_op + extra)


def qdq_matmul_add(ctx: QCtx, p: ir.Node, yq: QInfo, lo: int, hi: int):
    """DQ(x) -> MatMul(DQ(w)) -> Add(bias) [-> Relu/Clip] -> Q (the Add's pattern, owned here):
    one QDense; returns it with the two nodes it replaces."""
    g = ctx.g
    for k in (0, 1):
        mm = g.producer(p.inputs[k])
        other = p.inputs[1 - k]
        if (mm is not None and mm.op == "MatMul" and sole_use(g, p.inputs[k], p)
                and (ctx.const(other) is not None or g.const(other) is not None)):
            new = qdq_dense(ctx, mm, yq, lo, hi, bias_name=other, extra="+Add")
            if new is not None:
                return new, [p, mm]
    return None


@register("Gemm", check=_gemm_check, verify=verify_gemm, macs=_gemm_macs, epilogue=True, qdq=qdq_dense)
def emit_gemm(node: ir.Node, g: ir.Graph) -> Kernel:
    a = node.attrs
    alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
    w = g.const(node.inputs[1]).astype(np.float32)
    w = w.T if a.get("transB", 0) else w
    x, consts = node.inputs[0], {}
    if a.get("transA", 0):  # constant A: transpose it at build time
        x = new_const(g, consts, node.outputs[0] + "_a_t", g.const(x).T.astype(np.float32))
    c = g.const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    bias = None if c is None else (beta * c.astype(np.float32))
    return fc_kernel(node, g, x, (alpha * w).astype(np.float32), bias, node.outputs[0], consts)


def _matmul_check(node, g):
    a, b = g.t(node.inputs[0]), g.t(node.inputs[1])
    if len(a.shape) < 1 or len(b.shape) < 1:
        return "scalar operand"
    return float_only(node, g)


def _matmul_macs(node, g):
    a = g.t(node.inputs[0])
    return g.t(node.outputs[0]).size * a.shape[-1]


@register("MatMul", check=_matmul_check, macs=_matmul_macs, epilogue=True, qdq=qdq_dense)
def emit_matmul(node: ir.Node, g: ir.Graph) -> Kernel:
    a, b, y = node.inputs[0], node.inputs[1], node.outputs[0]
    bt = g.t(b)
    if bt.is_const and len(bt.shape) == 2:
        return fc_kernel(node, g, a, bt.data, None, y)
    ash, bsh = list(g.t(a).shape), list(bt.shape)
    if len(ash) == 1:
        ash = [1] + ash
    if len(bsh) == 1:
        bsh = bsh + [1]
    m, k, n = ash[-2], ash[-1], bsh[-1]
    batch = list(np.broadcast_shapes(tuple(ash[:-2]), tuple(bsh[:-2])))
    dims, (sa, sb) = broadcast_loops(batch, [ash[:-2], bsh[:-2]]) if batch else ([1], [[0], [0]])
    return Kernel("matmul", dtype_tag(g.t(y).dtype),
                  {"M": m, "K": k, "N": n, "dims": dims, "sa": [s * m * k for s in sa],
                   "sb": [s * k * n for s in sb], **epilogue(node)},
                  [a, b, y], desc=f"batch {batch} of {m}x{k} . {k}x{n}")


register_qdq("Add", qdq_matmul_add)
