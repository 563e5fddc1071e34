"""fold_bias_add: Conv or MatMul followed by Add of a per-output-channel constant takes it as its bias."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir


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
            if (prod is None or cdata is None or g.single_consumer(x) is not add
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
