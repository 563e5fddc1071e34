import onnx
from onnx import TensorProto, helper

from util import check_model


def test_conv_relu_matches_onnxruntime(tmp_path):
    import numpy as np
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 3, 3], rng.standard_normal(108).astype("float32"))
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w])
    check_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), tmp_path)
