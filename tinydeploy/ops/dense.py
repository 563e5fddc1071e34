"""Gemm and MatMul. A product with constant weights becomes a fully connected layer
(weights stored [K][N] so the inner loop runs over contiguous outputs and vectorises without
reassociating float sums); a product of two runtime tensors is a batched matmul."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.ops.registry import Kernel, dtype_tag, float_only, register
from tinydeploy.ops.elementwise import broadcast_loops


def _gemm_check(node, g):
    a = node.attrs
    if g.const(node.inputs[1]) is None:
        return "non-constant B"
    if a.get("transA", 0) and g.const(node.inputs[0]) is None:
        return "transA=1 with a non-constant A"
    if len(node.inputs) > 2 and node.inputs[2] and g.const(node.inputs[2]) is None:
        return "non-constant C"
    return float_only(node, g)


def _gemm_macs(node, g):
    y = g.t(node.outputs[0])
    b = g.t(node.inputs[1])
    k = b.shape[1] if node.attrs.get("transB", 0) else b.shape[0]
    return y.size * k


def fc_kernel(node, g, x: str, w_kn: np.ndarray, bias: np.ndarray | None, y: str) -> Kernel:
    """y[M][N] = act(x[M][K] . w[K][N] + bias); adds the prepared constants to the graph. A bias
    that differs per row (Gemm's C of shape [M, N]) is kept whole, otherwise as one row [N]."""
    k, n = w_kn.shape
    m = g.t(y).size // n
    wname = g.fresh_name(node.outputs[0] + "_weight_kn")
    g.tensors[wname] = ir.Tensor(wname, (k, n), np.dtype(np.float32), data=np.ascontiguousarray(w_kn, np.float32))
    args, bias_2d = [x, wname], False
    if bias is not None:
        full = np.broadcast_to(bias.astype(np.float32), (m, n))
        bias_2d = m > 1 and not (full == full[:1]).all()
        data = np.ascontiguousarray(full if bias_2d else full[0])
        bname = g.fresh_name(node.outputs[0] + "_bias")
        g.tensors[bname] = ir.Tensor(bname, data.shape, np.dtype(np.float32), data=data)
        args.append(bname)
    args.append(y)
    return Kernel("dense", dtype_tag(g.t(y).dtype),
                  {"M": m, "K": k, "N": n, "has_bias": bias is not None, "bias_2d": bias_2d,
                   "act": node.attrs.get("_act", "v")}, args, desc=f"{m}x{k} . {k}x{n}")


@register("Gemm", check=_gemm_check, macs=_gemm_macs)
def emit_gemm(node: ir.Node, g: ir.Graph) -> Kernel:
    a = node.attrs
    alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
    w = g.const(node.inputs[1]).astype(np.float32)
    w = w.T if a.get("transB", 0) else w
    x = node.inputs[0]
    if a.get("transA", 0):  # constant A: transpose it at build time
        at = g.const(x).T
        x = g.fresh_name(node.outputs[0] + "_a_t")
        g.tensors[x] = ir.Tensor(x, at.shape, np.dtype(np.float32), data=np.ascontiguousarray(at, np.float32))
    c = g.const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    bias = None if c is None else (beta * c.astype(np.float32))
    return fc_kernel(node, g, x, (alpha * w).astype(np.float32), bias, node.outputs[0])


def _matmul_check(node, g):
    a, b = g.t(node.inputs[0]), g.t(node.inputs[1])
    if len(a.shape) < 1 or len(b.shape) < 1:
        return "scalar operand"
    return float_only(node, g)


def _matmul_macs(node, g):
    a = g.t(node.inputs[0])
    return g.t(node.outputs[0]).size * a.shape[-1]


@register("MatMul", check=_matmul_check, macs=_matmul_macs)
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
                   "sb": [s * k * n for s in sb], "act": node.attrs.get("_act", "v")},
                  [a, b, y], desc=f"batch {batch} of {m}x{k} . {k}x{n}")
