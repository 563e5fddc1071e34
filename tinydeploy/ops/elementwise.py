"""Elementwise operators: unary math, activations (also used as fused epilogues), and binary
arithmetic with numpy broadcasting."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.codegen.cfmt import c_float
from tinydeploy.ir.activation import FUSABLE_ONNX, LINEAR, Activation
from tinydeploy.ops.registry import Kernel, dtype_tag, float_only, register
from tinydeploy.quant.params import QCtx, QInfo, add_multiplier_pair, exact_ratios


def _f(x) -> str:
    return c_float(float(x))


def activation_of(node: ir.Node, g: ir.Graph) -> Activation:
    """The Activation a Relu, LeakyRelu or Clip node computes (Clip's bounds: constant inputs)."""
    lo = g.const(node.inputs[1]) if node.op == "Clip" and len(node.inputs) > 1 else None
    hi = g.const(node.inputs[2]) if node.op == "Clip" and len(node.inputs) > 2 else None
    return Activation.of(node.op, node.attrs, None if lo is None else float(lo), None if hi is None else float(hi))


def epilogue(node: ir.Node) -> dict:
    """Kernel parameters of a node's fused activation (passes/fuse_activations.py): `activation`
    (the Activation) and `act` (its C expression over v, for the templates)."""
    a = node.attrs.get("_act", LINEAR)
    return {"activation": a, "act": a.c_expr()}


def _clip_check(node, g):
    for i in node.inputs[1:]:
        if i and g.const(i) is None:
            return "Clip with non-constant min/max"
    return float_only(node, g, [node.inputs[0]])


UNARY = {
    "Sigmoid": lambda a: "(1.0f / (1.0f + expf(-v)))",
    "Tanh": lambda a: "tanhf(v)",
    "HardSigmoid": lambda a: f"fmaxf(0.0f, fminf(1.0f, {_f(a.get('alpha', 0.2))} * v + {_f(a.get('beta', 0.5))}))",
    "HardSwish": lambda a: "(v * fmaxf(0.0f, fminf(1.0f, v * (1.0f / 6.0f) + 0.5f)))",
    "Exp": lambda a: "expf(v)",
    "Log": lambda a: "logf(v)",
    "Sqrt": lambda a: "sqrtf(v)",
    "Abs": lambda a: "fabsf(v)",
    "Neg": lambda a: "(-v)",
    "Reciprocal": lambda a: "(1.0f / v)",
    "Floor": lambda a: "floorf(v)",
    "Ceil": lambda a: "ceilf(v)",
    "Elu": lambda a: f"(v >= 0.0f ? v : {_f(a.get('alpha', 1.0))} * (expf(v) - 1.0f))",
    "Selu": lambda a: (f"({_f(a.get('gamma', 1.05070102214813232421875))} * (v > 0.0f ? v : "
                       f"{_f(a.get('alpha', 1.67326319217681884765625))} * (expf(v) - 1.0f)))"),
    "Softplus": lambda a: "(v > 20.0f ? v : log1pf(expf(v)))",
    "Softsign": lambda a: "(v / (1.0f + fabsf(v)))",
    "Erf": lambda a: "erff(v)",
    "Sin": lambda a: "sinf(v)",
    "Cos": lambda a: "cosf(v)",
}


def _unary_kernel(node: ir.Node, g: ir.Graph, expr: str) -> Kernel:
    x, y = node.inputs[0], node.outputs[0]
    n = g.t(y).size
    return Kernel("unary", dtype_tag(g.t(y).dtype), {"n": n, "expr": expr}, [x, y], desc=f"{n} elements")


for _op in FUSABLE_ONNX:
    register(_op, inplace=True, check=_clip_check if _op == "Clip" else float_only)(
        lambda node, g: _unary_kernel(node, g, activation_of(node, g).c_expr()))
for _op in UNARY:
    register(_op, inplace=True, check=float_only)(
        lambda node, g: _unary_kernel(node, g, UNARY[node.op](node.attrs)))


BINARY = {
    "Add": "(a_ + b_)", "Sub": "(a_ - b_)", "Mul": "(a_ * b_)", "Div": "(a_ / b_)",
    "Max": "fmaxf(a_, b_)", "Min": "fminf(a_, b_)", "Pow": "powf(a_, b_)",
    # PRelu(x, slope): the slope broadcasts to x (unidirectionally; onnx shape inference checks it)
    "PRelu": "(a_ >= 0.0f ? a_ : a_ * b_)",
}


def broadcast_loops(out_shape, in_shapes) -> tuple[list[int], list[list[int]]]:
    """Coalesced loop extents and per-input element strides (0 where broadcast) for iterating the
    output in order. Adjacent dims that broadcast the same way in every input are merged."""
    r = len(out_shape)
    strides = []
    for s in in_shapes:
        s = (1,) * (r - len(s)) + tuple(s)
        st, acc = [0] * r, 1
        for d in range(r - 1, -1, -1):
            st[d] = acc if s[d] != 1 or out_shape[d] == 1 else 0
            acc *= s[d]
        strides.append(st)
    dims, outs = [], [[] for _ in in_shapes]
    for d in range(r):
        n = out_shape[d]
        if n == 1:
            continue
        if dims and all((outs[k][-1] == st[d] * n) for k, st in enumerate(strides)):
            dims[-1] *= n
            for k, st in enumerate(strides):
                outs[k][-1] = st[d]
            continue
        dims.append(n)
        for k, st in enumerate(strides):
            outs[k].append(st[d])
    if not dims:
        dims, outs = [1], [[0] for _ in in_shapes]
    return dims, outs


def binary_kernel(node: ir.Node, g: ir.Graph, op: str) -> Kernel:
    a, b, y = node.inputs[0], node.inputs[1], node.outputs[0]
    dims, (sa, sb) = broadcast_loops(g.t(y).shape, [g.t(a).shape, g.t(b).shape])
    return Kernel("binary", dtype_tag(g.t(y).dtype),
                  {"dims": dims, "sa": sa, "sb": sb, "expr": BINARY[op], **epilogue(node)},
                  [a, b, y], desc=f"{op} {list(g.t(a).shape)} , {list(g.t(b).shape)} -> {list(g.t(y).shape)}")


def _binary_emit(node, g):
    return binary_kernel(node, g, node.op)


# Variadic ops: passes.expand_variadic turns them into chains of two-input nodes before lowering.
VARIADIC = {"Sum": "Add", "Max": "Max", "Min": "Min"}


def _binary_check(node, g):
    n = len([i for i in node.inputs if i])
    if n != 2 and not (node.op in VARIADIC and n >= 1):
        return f"{len(node.inputs)} inputs (expected 2)"
    for name in node.inputs:   # constants too: Pow's exponent may have a type of its own
        t = g.tensors.get(name) if name else None
        if t is not None and t.is_const and np.dtype(t.dtype) != np.float32:
            return f"{np.dtype(t.dtype).name} constant input (the kernel computes in float32)"
    return float_only(node, g)


# ---- 8-bit: the QDQ match of Add (quant/qdq.py runs it) ----------------------------------------

def qdq_add(ctx: QCtx, p: ir.Node, yq: QInfo, lo: int, hi: int) -> ir.Node | None:
    if len(p.inputs) != 2:
        return None
    a, b = ctx.runtime(p.inputs[0]), ctx.runtime(p.inputs[1])
    if a is None or b is None:
        return None
    ra = float(np.float32(a.s) / np.float32(yq.s))
    rb = float(np.float32(b.s) / np.float32(yq.s))
    if not exact_ratios(ra, rb):
        return None
    ma, mb, s = add_multiplier_pair(ra, rb)
    attrs = {"_q": {"za": a.z, "zb": b.z, "zy": yq.z, "ma": ma, "mb": mb, "s": s, "lo": lo, "hi": hi}}
    return ir.Node("QAdd", p.name, [a.src, b.src], [yq.src], attrs, onnx_op=p.onnx_op)


for _op in BINARY:
    register(_op, check=_binary_check, inplace=True, epilogue=_op in ("Add", "Sub", "Mul"),
             qdq=qdq_add if _op == "Add" else None)(_binary_emit)
register("Sum", check=_binary_check, inplace=True)(
    lambda node, g: binary_kernel(node, g, "Add"))
