"""The QDQ pass: quantised (QDQ) models -> integer operators.

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

from collections import Counter

import numpy as np

from tinydeploy import ir
from tinydeploy.ops.registry import REGISTRY, qdq_matchers
from tinydeploy.quant.params import (QTYPES, QCtx, QInfo, dequantize_const, dq_info, exact_ratios, q_info, qrange,
                                     quantize_multiplier, quantize_value, sole_use)


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


def _match_move(ctx: QCtx, p: ir.Node, yq: QInfo, lo: int, hi: int) -> ir.Node | None:
    """Data movement between a DQ and a Q with identical parameters runs on the integers."""
    if len(p.outputs) != 1 or (lo, hi) != qrange(yq.dtype):
        return None
    ins = p.inputs if REGISTRY[p.op].moves == "all" else p.inputs[:1]
    new_inputs = list(p.inputs)
    for k, name in enumerate(ins):
        info = ctx.runtime(name)
        if info is None or info.s != yq.s or info.z != yq.z or info.dtype != yq.dtype:
            return None
        new_inputs[k] = info.src
    return ir.Node(p.op, p.name, new_inputs, [yq.src], dict(p.attrs), onnx_op=p.onnx_op)


def _match_requant(ctx: QCtx, t: str, yq: QInfo, lo: int, hi: int, dq: ir.Node) -> ir.Node | None:
    x = ctx.runtime(t)
    if x is None:
        return None
    r = float(np.float32(x.s) / np.float32(yq.s))
    if not exact_ratios(r):
        return None
    m, s = quantize_multiplier(r)
    attrs = {"_q": {"zx": x.z, "zy": yq.z, "m": m, "s": s, "lo": lo, "hi": hi}}
    return ir.Node("QRequantize", dq.name, [x.src], [yq.src], attrs, onnx_op="DequantizeLinear")


def quantize_qdq(g: ir.Graph) -> None:
    """The pass: see the module docstring."""
    if not any(n.op in ("QuantizeLinear", "DequantizeLinear") for n in g.nodes):
        return
    ctx = QCtx(g)
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
        while p is not None and p.op in ("Relu", "Clip") and sole_use(g, t, user):
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
        elif not sole_use(g, t, user):
            continue
        else:       # the operator's own QDQ matches (tinydeploy/ops: register(..., qdq=...))
            for match in qdq_matchers(p.op):
                res = match(ctx, p, yq, lo, hi)
                if res is not None:
                    new, removed = res if isinstance(res, tuple) else (res, [p])
                    break
            d = REGISTRY.get(p.op)
            if new is None and d is not None and d.moves:   # data movement: runs on the integers
                new = _match_move(ctx, p, yq, lo, hi)
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
