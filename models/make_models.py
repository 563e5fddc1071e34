"""Build deterministic ImageNet-shaped ResNets as ONNX, with seeded random weights.

The graphs have the structure of a PyTorch (torchvision) export in eval mode without
BatchNorm folding: Conv (no bias) -> BatchNormalization -> Relu, MaxPool 3x3/2 pad 1,
residual Add then Relu, downsample Conv1x1 + BN, GlobalAveragePool, Flatten, Gemm
(transB=1, with bias); opset 13. Nodes are named like torchvision modules
(``layer1.0.conv1``) and initializers like its state dict (``layer1.0.bn1.running_var``).

Models: ``resnet18`` (BasicBlock [2,2,2,2]) and ``resnet50`` (v1.5: Bottleneck [3,4,6,3],
stride on the 3x3 conv). Input ``input`` float32 [1,3,224,224] NCHW, output ``logits``
float32 [1,1000]; ``--dynamic-batch`` makes the first dim of both the symbol ``N``.

Weights come from ``numpy.random.default_rng(seed)``: He-normal convs, BatchNorm with
gamma ~ U(0.5,1.5) (U(0.2,0.5) on the last BN of each residual branch so the residual
stream stays bounded), small beta and running_mean, running_var ~ U(0.5,2); the fc layer
uses torch.nn.Linear's default U(+-1/sqrt(fan_in)). The same seed gives byte-identical files.

    python models/make_models.py resnet18 resnet50 -o OUTDIR [--seed N] [--dynamic-batch]
"""
import argparse
import os
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 13
IR_VERSION = 8  # accepted by every onnxruntime that supports opset 13
ARCHS = {"resnet18": ("basic", [2, 2, 2, 2]), "resnet50": ("bottleneck", [3, 4, 6, 3])}


class _Builder:
    """Accumulates nodes and initializers; every tensor is named after its producer."""

    def __init__(self, rng):
        self.rng, self.nodes, self.inits = rng, [], []

    def _init(self, name, arr):
        self.inits.append(numpy_helper.from_array(arr.astype(np.float32), name))
        return name

    def node(self, op, name, inputs, **attrs):
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def conv(self, x, name, cin, cout, k, stride=1):
        std = np.sqrt(2.0 / (cin * k * k))  # He-normal, fan_in
        w = self._init(f"{name}.weight", self.rng.normal(0.0, std, (cout, cin, k, k)))
        return self.node("Conv", name, [x, w], dilations=[1, 1], group=1, kernel_shape=[k, k],
                         pads=[k // 2] * 4, strides=[stride, stride])

    def bn(self, x, name, c, last=False):
        r = self.rng
        lo, hi = (0.2, 0.5) if last else (0.5, 1.5)
        params = [self._init(f"{name}.{p}", a) for p, a in (
            ("weight", r.uniform(lo, hi, c)), ("bias", r.uniform(-0.1, 0.1, c)),
            ("running_mean", r.uniform(-0.1, 0.1, c)), ("running_var", r.uniform(0.5, 2.0, c)))]
        return self.node("BatchNormalization", name, [x, *params], epsilon=1e-5, momentum=0.9)

    def conv_bn(self, x, name, bn_name, cin, cout, k, stride=1, relu=True, last=False):
        y = self.bn(self.conv(x, name, cin, cout, k, stride), bn_name, cout, last)
        return self.node("Relu", f"{name}.relu", [y]) if relu else y

    def block(self, x, p, kind, cin, width, stride):
        """One residual block at prefix ``p``; returns (output, channels out)."""
        if kind == "basic":
            cout = width
            y = self.conv_bn(x, f"{p}.conv1", f"{p}.bn1", cin, width, 3, stride)
            y = self.conv_bn(y, f"{p}.conv2", f"{p}.bn2", width, cout, 3, relu=False, last=True)
        else:
            cout = width * 4
            y = self.conv_bn(x, f"{p}.conv1", f"{p}.bn1", cin, width, 1)
            y = self.conv_bn(y, f"{p}.conv2", f"{p}.bn2", width, width, 3, stride)
            y = self.conv_bn(y, f"{p}.conv3", f"{p}.bn3", width, cout, 1, relu=False, last=True)
        if stride != 1 or cin != cout:
            x = self.conv_bn(x, f"{p}.downsample.0", f"{p}.downsample.1", cin, cout, 1, stride,
                             relu=False)
        return self.node("Relu", f"{p}.relu", [self.node("Add", f"{p}.add", [y, x])]), cout


def build(name: str, seed: int = 0, dynamic_batch: bool = False) -> onnx.ModelProto:
    """Return the checked ONNX model ``name`` ('resnet18' or 'resnet50') with seeded weights."""
    if name not in ARCHS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(ARCHS)}")
    kind, layers = ARCHS[name]
    b = _Builder(np.random.default_rng(seed))
    x = b.conv_bn("input", "conv1", "bn1", 3, 64, 7, stride=2)
    x = b.node("MaxPool", "maxpool", [x], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2])
    cin = 64
    for i, (n, width) in enumerate(zip(layers, [64, 128, 256, 512])):
        for j in range(n):
            stride = 2 if (i > 0 and j == 0) else 1
            x, cin = b.block(x, f"layer{i + 1}.{j}", kind, cin, width, stride)
    x = b.node("GlobalAveragePool", "avgpool", [x])
    x = b.node("Flatten", "flatten", [x], axis=1)
    bound = 1.0 / np.sqrt(cin)  # torch.nn.Linear default init
    fc_w = b._init("fc.weight", b.rng.uniform(-bound, bound, (1000, cin)))
    fc_b = b._init("fc.bias", b.rng.uniform(-bound, bound, 1000))
    b.nodes.append(helper.make_node("Gemm", [x, fc_w, fc_b], ["logits"], name="fc",
                                    alpha=1.0, beta=1.0, transB=1))
    batch = "N" if dynamic_batch else 1
    graph = helper.make_graph(
        b.nodes, name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 1000])], b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="tinydeploy.make_models", ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def stats(model: onnx.ModelProto) -> tuple[int, int]:
    """(parameters, MACs): parameters exclude BN running stats (as torch counts them);
    MACs count Conv and Gemm only, for batch 1."""
    inits = {t.name: t for t in model.graph.initializer}
    params = sum(int(np.prod(t.dims)) for n, t in inits.items()
                 if not n.endswith(("running_mean", "running_var")))
    shapes = {v.name: [d.dim_value or 1 for d in v.type.tensor_type.shape.dim]
              for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    macs = 0
    for nd in model.graph.node:
        w = inits.get(nd.input[1]) if len(nd.input) > 1 else None
        if nd.op_type == "Conv":
            macs += int(np.prod(shapes[nd.output[0]])) * int(np.prod(w.dims[1:]))
        elif nd.op_type == "Gemm":
            macs += int(np.prod(w.dims))
    return params, macs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", choices=sorted(ARCHS))
    ap.add_argument("-o", "--outdir", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dynamic-batch", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs(args.outdir, exist_ok=True)
    for name in args.models:
        t0 = time.perf_counter()
        model = build(name, args.seed, args.dynamic_batch)
        path = os.path.join(args.outdir, f"{name}.onnx")
        onnx.save(model, path)
        params, macs = stats(model)
        print(f"wrote {path}: {os.path.getsize(path) / 1e6:.1f} MB, {params:,} params, "
              f"{macs / 1e9:.3f} GMACs, {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
