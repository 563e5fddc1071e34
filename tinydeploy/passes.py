"""Graph rewrites, run in a fixed order by `run_passes`. Each pass is a function Graph -> None
that keeps the graph valid; together they take an imported ONNX graph to the form the kernels
expect (BatchNorm folded, activations fused, no no-op nodes, reshapes as views)."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.ops import REGISTRY
from tinydeploy.ops.elementwise import ACTIVATIONS, activation_expr
from tinydeploy.quant import quantize_qdq  # QDQ islands -> integer ops; no-op for float graphs


def _replace_uses(g: ir.Graph, old: str, new: str) -> None:
    for n in g.nodes:
        n.inputs = [new if i == old else i for i in n.inputs]


def _single_consumer(g: ir.Graph, name: str) -> ir.Node | None:
    """The only consumer of a runtime tensor that is not a graph output, else None."""
    if name in g.outputs:
        return None
    users = g.consumers(name)
    return users[0] if len(users) == 1 and users[0].inputs.count(name) == 1 else None


def remove_identities(g: ir.Graph) -> None:
    """Identity and inference-mode Dropout pass their input through."""
    for n in list(g.nodes):
        if n.op not in ("Identity", "Dropout") or (n.op == "Dropout" and len(n.outputs) > 1 and n.outputs[1]
                                                   and g.consumers(n.outputs[1])):
            continue
        x, y = n.inputs[0], n.outputs[0]
        if y in g.outputs:
            if x in g.inputs or x in g.outputs or g.t(x).is_const:
                n.op, n.inputs, n.outputs, n.attrs = "Copy", [x], [y], {}
                continue
            prod = g.producer(x)
            prod.outputs = [y if o == x else o for o in prod.outputs]
            _replace_uses(g, x, y)
            g.tensors[y] = ir.Tensor(y, g.t(x).shape, g.t(x).dtype)
        else:
            _replace_uses(g, y, x)
        g.nodes.remove(n)


def expand_variadic(g: ir.Graph) -> None:
    """Sum/Max/Min with n inputs become chains of two-input nodes (one input: a copy)."""
    binary = {"Sum": "Add", "Max": "Max", "Min": "Min"}
    out = []
    for n in g.nodes:
        ins = [i for i in n.inputs if i]
        if n.op in binary and len(ins) != 2:
            if len(ins) == 1:
                out.append(ir.Node("Copy", n.name, ins, n.outputs, onnx_op=n.op))
                continue
            acc = ins[0]
            for k, b in enumerate(ins[1:]):
                last = k == len(ins) - 2
                y = n.outputs[0] if last else g.fresh_name(f"{n.outputs[0]}_part{k}")
                if not last:
                    shape = np.broadcast_shapes(g.t(acc).shape, g.t(b).shape)
                    g.tensors[y] = ir.Tensor(y, tuple(shape), g.t(n.outputs[0]).dtype)
                out.append(ir.Node(binary[n.op], f"{n.name}/{k}", [acc, b], [y], onnx_op=n.op))
                acc = y
            continue
        if n.op == "Sum":
            n.op = "Add"
        out.append(n)
    g.nodes = out


def fold_batchnorm(g: ir.Graph) -> None:
    """Conv/Gemm -> BatchNormalization becomes one Conv/Gemm with scaled weights and a bias."""
    for bn in list(g.nodes):
        if bn.op != "BatchNormalization" or any(g.const(i) is None for i in bn.inputs[1:5]):
            continue
        if bn.attrs.get("training_mode", 0) or any(bn.outputs[1:]):
            continue
        prod = g.producer(bn.inputs[0])
        if prod is None or prod.op not in ("Conv", "Gemm") or _single_consumer(g, bn.inputs[0]) is not bn:
            continue
        w = g.const(prod.inputs[1])
        if w is None or (len(prod.inputs) > 2 and prod.inputs[2] and g.const(prod.inputs[2]) is None):
            continue
        if prod.op == "Gemm" and (prod.attrs.get("transA", 0) or len(g.t(prod.outputs[0]).shape) != 2):
            continue
        scale, beta, mean, var = (g.const(i).astype(np.float64) for i in bn.inputs[1:5])
        s = scale / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
        nout = s.shape[0]
        if prod.op == "Conv":
            w2 = w.astype(np.float64) * s.reshape(-1, *([1] * (w.ndim - 1)))
        else:
            alpha = float(prod.attrs.get("alpha", 1.0))
            wt = w.T if not prod.attrs.get("transB", 0) else w      # [N, K]
            w2 = (alpha * wt.astype(np.float64)) * s[:, None]
            prod.attrs.update(transB=1, alpha=1.0)
        b = np.zeros(nout)
        if len(prod.inputs) > 2 and prod.inputs[2]:
            c = g.const(prod.inputs[2]).astype(np.float64)
            if prod.op == "Gemm":
                if c.size not in (1, nout) or (c.ndim == 2 and c.shape[0] != 1):
                    continue
                c = float(prod.attrs.get("beta", 1.0)) * c
            b = np.broadcast_to(c.reshape(-1), (nout,)).astype(np.float64)
        b2 = (b - mean) * s + beta
        wn, bn_name = g.fresh_name(prod.outputs[0] + "_w_bn"), g.fresh_name(prod.outputs[0] + "_b_bn")
        g.tensors[wn] = ir.Tensor(wn, w2.shape, np.dtype(np.float32), data=w2.astype(np.float32))
        g.tensors[bn_name] = ir.Tensor(bn_name, (nout,), np.dtype(np.float32), data=b2.astype(np.float32))
        prod.inputs = [prod.inputs[0], wn, bn_name]
        if prod.op == "Gemm":
            prod.attrs["beta"] = 1.0
        prod.outputs = [bn.outputs[0]]
        prod.onnx_op = f"{prod.onnx_op}+BatchNormalization"
        g.nodes.remove(bn)


def fold_bias_add(g: ir.Graph) -> None:
    """Conv or MatMul (constant 2-D weights) followed by Add of a constant per-output-channel
    vector: the vector becomes the layer's bias (MatMul turns into Gemm)."""
    for add in list(g.nodes):
        if add.op != "Add":
            continue
        for k in (0, 1):
            x, c = add.inputs[k], add.inputs[1 - k]
            prod = g.producer(x)
            cdata = g.const(c)
            if (prod is None or cdata is None or _single_consumer(g, x) is not add
                    or g.t(add.outputs[0]).shape != g.t(x).shape):
                continue
            y = g.t(x)
            if prod.op == "MatMul" and g.const(prod.inputs[1]) is not None and len(g.t(prod.inputs[1]).shape) == 2 \
                    and len(y.shape) == 2 and cdata.size in (1, y.shape[1]) and cdata.ndim <= 2 \
                    and (cdata.size == 1 or cdata.shape[-1] == y.shape[1]):   # not a column [M, 1] with M == N
                nout = y.shape[1]
                prod.op, prod.attrs = "Gemm", {}
            elif prod.op == "Conv" and (len(prod.inputs) < 3 or not prod.inputs[2]) and len(y.shape) >= 3 \
                    and cdata.size in (1, y.shape[1]) and cdata.ndim <= len(y.shape) \
                    and (cdata.size == 1 or cdata.shape[-len(y.shape) + 1:] in ((y.shape[1],) + (1,) * (len(y.shape) - 2),)
                         or (cdata.ndim == len(y.shape) - 1 and cdata.shape[0] == y.shape[1])):
                nout = y.shape[1]
            else:
                continue
            bias = np.broadcast_to(cdata.astype(np.float32).reshape(-1), (nout,)).copy()
            bname = g.fresh_name(add.outputs[0] + "_bias")
            g.tensors[bname] = ir.Tensor(bname, (nout,), np.dtype(np.float32), data=bias)
            prod.inputs = prod.inputs[:2] + [bname]
            prod.outputs = [add.outputs[0]]
            prod.onnx_op = f"{prod.onnx_op}+Add"
            g.nodes.remove(add)
            break


FUSABLE = ("Conv", "Gemm", "MatMul", "Add", "Sub", "Mul", "BatchNormalization")


def fuse_activations(g: ir.Graph) -> None:
    """Relu / Clip / LeakyRelu right after a Conv, Gemm, MatMul, binary op or affine become the
    producer's epilogue (`_act`, a C expression over `v`)."""
    for act in list(g.nodes):
        if act.op not in ACTIVATIONS:
            continue
        if act.op == "Clip" and any(i and g.const(i) is None for i in act.inputs[1:]):
            continue
        prod = g.producer(act.inputs[0])
        if (prod is None or prod.op not in FUSABLE or "_act" in prod.attrs
                or _single_consumer(g, act.inputs[0]) is not act
                or g.t(act.inputs[0]).dtype != np.float32):
            continue
        prod.attrs["_act"] = activation_expr(act.op, act.attrs, g, act)
        prod.outputs = [act.outputs[0]]
        prod.onnx_op = f"{prod.onnx_op}+{act.op}"
        g.nodes.remove(act)


def _is_view_transpose(shape, perm) -> bool:
    """True when the permutation keeps every dimension larger than 1 in its order."""
    big = [p for p in perm if shape[p] != 1]
    return big == sorted(big)


def fold_transposes(g: ir.Graph) -> None:
    """Transpose(Transpose(x)) composes into one; a Transpose that moves only size-1 dimensions
    (e.g. the NHWC->NCHW input Transpose of a 1-channel model) becomes a zero-copy view."""
    changed = True
    while changed:
        changed = False
        for n in g.nodes:
            if n.op != "Transpose":
                continue
            x = g.t(n.inputs[0])
            perm = list(n.attrs.get("perm", range(len(x.shape) - 1, -1, -1)))
            prod = g.producer(n.inputs[0])
            if prod is not None and prod.op == "Transpose" and _single_consumer(g, n.inputs[0]) is n:
                p0 = list(prod.attrs.get("perm", range(len(x.shape) - 1, -1, -1)))
                n.attrs["perm"] = [p0[p] for p in perm]
                n.inputs = [prod.inputs[0]]
                g.nodes.remove(prod)
                changed = True
                break
            if _is_view_transpose(x.shape, perm):
                n.op, n.attrs = "Reshape", {}
                n.inputs = n.inputs[:1]
                changed = True
                break


def separate_outputs(g: ir.Graph) -> None:
    """Every graph output gets a buffer of its own: outputs that are graph inputs, constants or
    listed twice are copied."""
    seen = set()
    for k, name in enumerate(list(g.outputs)):
        t = g.t(name)
        if name in seen or name in g.inputs or t.is_const:
            y = g.fresh_name(f"{name}_out{k}")
            g.tensors[y] = ir.Tensor(y, t.shape, t.dtype)
            g.nodes.append(ir.Node("Copy", f"output_copy_{k}", [name], [y]))
            g.outputs[k] = y
        seen.add(g.outputs[k])


def dead_code(g: ir.Graph) -> None:
    g.prune()


PASSES = [quantize_qdq, remove_identities, expand_variadic, dead_code, fold_batchnorm, fold_bias_add,
          fuse_activations, fold_transposes, separate_outputs, dead_code]


def run_passes(g: ir.Graph) -> ir.Graph:
    for p in PASSES:
        p(g)
    return g


def is_view(n: ir.Node) -> bool:
    d = REGISTRY.get(n.op)
    return bool(d and d.view)
