"""fuse_activations: Relu / Clip / LeakyRelu after an operator that can apply them become its epilogue."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.ir.activation import FUSABLE_ONNX
from tinydeploy.ops import REGISTRY
from tinydeploy.ops.elementwise import activation_of


def fuse_activations(g: ir.Graph) -> None:
    """Relu / Clip / LeakyRelu right after a Conv, Gemm, MatMul, binary op or affine become the
    producer's epilogue (`_act`, an ir.activation.Activation)."""
    for act in list(g.nodes):
        if act.op not in FUSABLE_ONNX:
            continue
        if act.op == "Clip" and any(i and g.const(i) is None for i in act.inputs[1:]):
            continue
        prod = g.producer(act.inputs[0])
        if (prod is None or not REGISTRY[prod.op].epilogue or "_act" in prod.attrs
                or g.single_consumer(act.inputs[0]) is not act
                or g.t(act.inputs[0]).dtype != np.float32):
            continue
        prod.attrs["_act"] = activation_of(act, g)
        prod.outputs = [act.outputs[0]]
        prod.onnx_op = f"{prod.onnx_op}+{act.op}"
        g.nodes.remove(act)
