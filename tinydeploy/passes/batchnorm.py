"""fold_batchnorm: Conv/Gemm -> BatchNormalization becomes one Conv/Gemm (weights scaled, a bias)."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir


def fold_batchnorm(g: ir.Graph) -> None:
    """Conv/Gemm -> BatchNormalization becomes one Conv/Gemm with scaled weights and a bias."""
    for bn in list(g.nodes):
        if bn.op != "BatchNormalization" or any(g.const(i) is None for i in bn.inputs[1:5]):
            continue
        if bn.attrs.get("training_mode", 0) or any(bn.outputs[1:]):
            continue
        prod = g.producer(bn.inputs[0])
        if prod is None or prod.op not in ("Conv", "Gemm") or g.single_consumer(bn.inputs[0]) is not bn:
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
