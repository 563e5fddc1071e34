"""expand_variadic: Sum/Max/Min with n inputs become chains of two-input nodes."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir


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
