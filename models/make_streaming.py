"""Build a small streaming keyword-spotting network whose state is carried as input/output pairs,
as ONNX with seeded weights: each call takes one frame of features and the state the previous
call returned, and returns its scores and the new state.

    x          float32 [1, C]          this frame's C features (MFCC-like)
    frames_in  float32 [1, C, 1, K-1]  the K-1 frames before it           -> frames_out (the last K-1)
    h_in       float32 [1, H]          GRU-style hidden state             -> h_out
    mean_in    float32 [1, F]          running mean of the conv features  -> mean_out
    scores     float32 [1, N]          class scores of this step

Per step: cat = Concat(frames_in, x) along time; f = Relu(Conv 1xK over cat) (a streaming
temporal convolution); frames_out = cat without its oldest frame; a GRU-style cell on f:
z = Sigmoid(f Wz + h Uz + bz), r = Sigmoid(f Wr + h Ur + br), n = Tanh(f Wn + (r h) Un + bn),
h_out = n + z (h - n); mean_out = 0.9 mean_in + 0.1 f; scores = h_out Wo + mean_in Wm + bo, which
reads the old mean after the new one is made (so that state cannot share its bytes: the
library form copies it back after the run, while h and the frames are written in place).
Every state starts at zero. Opset 13, IR version 8; the same seed gives byte-identical files.

    python models/make_streaming.py -o OUTDIR [--seed N]   -> OUTDIR/streaming_kws.onnx
"""
import argparse
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 13
IR_VERSION = 8
C, K, F, H, N = 10, 4, 16, 24, 4     # features, kernel width (frames), conv channels, hidden, classes


def build(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = []

    def w(name, shape, scale):
        inits.append(numpy_helper.from_array(rng.normal(0.0, scale, shape).astype(np.float32), name))
        return name

    def const(name, values, dtype=np.int64):
        inits.append(numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
        return name

    nodes = []

    def node(op, inputs, out, **attrs):
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    x4 = node("Reshape", ["x", const("x_shape", [1, C, 1, 1])], "x_frame")
    cat = node("Concat", ["frames_in", x4], "window", axis=3)
    conv = node("Conv", [cat, w("conv.weight", (F, C, 1, K), 1 / np.sqrt(C * K)), w("conv.bias", (F,), 0.1)],
                "conv", kernel_shape=[1, K])
    f = node("Reshape", [node("Relu", [conv], "conv.relu"), const("f_shape", [1, F])], "features")
    node("Slice", [cat, const("s_start", [1]), const("s_end", [K]), const("s_axis", [3])], "frames_out")

    def gate(g, act, h):
        a = node("MatMul", [f, w(f"W{g}", (F, H), 1 / np.sqrt(F))], f"{g}.x")
        b = node("MatMul", [h, w(f"U{g}", (H, H), 1 / np.sqrt(H))], f"{g}.h")
        s = node("Add", [node("Add", [a, b], f"{g}.sum"), w(f"b{g}", (H,), 0.1)], f"{g}.pre")
        return node(act, [s], f"{g}.act")

    z = gate("z", "Sigmoid", "h_in")
    r = gate("r", "Sigmoid", "h_in")
    n = gate("n", "Tanh", node("Mul", [r, "h_in"], "rh"))
    d = node("Sub", ["h_in", n], "h_minus_n")
    node("Add", [n, node("Mul", [z, d], "z_d")], "h_out")
    decay = const("decay", [0.9], np.float32)
    rate = const("rate", [0.1], np.float32)
    node("Add", [node("Mul", ["mean_in", decay], "mean.old"), node("Mul", [f, rate], "mean.new")], "mean_out")
    ho = node("MatMul", ["h_out", w("Wo", (H, N), 1 / np.sqrt(H))], "scores.h")
    mo = node("MatMul", ["mean_in", w("Wm", (F, N), 1 / np.sqrt(F))], "scores.mean")
    node("Add", [node("Add", [ho, mo], "scores.sum"), w("bo", (N,), 0.1)], "scores")

    io = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    graph = helper.make_graph(
        nodes, "streaming_kws",
        [io("x", [1, C]), io("frames_in", [1, C, 1, K - 1]), io("h_in", [1, H]), io("mean_in", [1, F])],
        [io("scores", [1, N]), io("frames_out", [1, C, 1, K - 1]), io("h_out", [1, H]), io("mean_out", [1, F])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="tinydeploy models/make_streaming.py")
    onnx.checker.check_model(model)
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--outdir", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.makedirs(args.outdir, exist_ok=True)
    path = os.path.join(args.outdir, "streaming_kws.onnx")
    onnx.save(build(args.seed), path)
    print(f"{path}: {os.path.getsize(path)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
