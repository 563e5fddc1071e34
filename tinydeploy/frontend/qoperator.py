"""QOperator models -> QDQ form, at the ONNX-proto level, before checking and shape inference.

onnxruntime's quantiser writes 8-bit models in two forms. QDQ (QuantizeLinear / DequantizeLinear
around float operators) is what tinydeploy's QDQ pass (tinydeploy/quant/) turns into integer
kernels. QOperator writes the same computation as dedicated operators: QLinearConv and
QLinearMatMul (standard ONNX) and com.microsoft contrib operators (QGemm, QLinearAdd, QLinearMul,
QLinearAveragePool, QLinearGlobalAveragePool, QLinearConcat, QLinearSigmoid, QLinearLeakyRelu,
QLinearSoftmax). onnx shape inference does not know the contrib operators, so `rewrite_qoperator`
replaces every such node, right after loading, by its QDQ subgraph:

    QLinearX(x, s_x, z_x, [w, s_w, z_w,] s_y, z_y, [B])
      ->  Q( X( DQ(x, s_x, z_x), [DQ(w, s_w, z_w),] [DQ(B, s_x * s_w, 0)] ), s_y, z_y )

Why this is the same model: each QLinear operator is *defined* on the real values its integer
inputs stand for. QLinearConv, for instance, is y = saturate(round(real / s_y) + z_y) with
real = s_x s_w[c] (sum (x - z_x)(w - z_w[c]) + B[c]), the int32 bias B being in units of
s_x s_w[c] with zero point 0. The right-hand side computes exactly that real value: DQ gives
(x - z_x) s_x and (w - z_w) s_w, DQ of the bias with scale s_x s_w[c] (float32, per channel, the
product onnxruntime forms) and zero point 0 gives B s_x s_w[c], Conv sums the products, and Q is
saturate(round(v / s_y) + z_y). The QDQ pass then recognises DQ -> Conv -> Q and computes the
integer accumulator sum (x - z_x)(w - z_w) + B exactly (the bias scale equals s_x s_w, so B is
taken as is), followed by the fixed-point requantisation by s_x s_w / s_y: the same integer
arithmetic QLinearConv specifies. The other operators follow the same pattern (QGemm's bias is
in units of alpha s_a s_b: it becomes DQ(C, s_a s_b) with Gemm beta = alpha). Operators that
have no integer kernel (Sigmoid, LeakyRelu) become float islands DQ -> op -> Q, which is their
definition too; onnxruntime evaluates some of them with lookup tables, which may round
differently by an LSB. QLinearSoftmax becomes DQ -> Softmax -> Q, which the QDQ pass runs on
the integers (quant.softmax_table).

Standard operators that QOperator models apply to 8-bit tensors directly keep doing so
(Reshape, Transpose, ... run on the integers); MaxPool, which has no 8-bit kernel of its own,
becomes DQ -> MaxPool -> Q with the input's scale and zero point (exact: max commutes with the
monotone Q/DQ), which the QDQ pass turns back into an integer max pool.

Not rewritten, and refused later with a reason (quant.scheme_problem): MatMulInteger and
ConvInteger (onnxruntime's *dynamic* quantisation, which quantize_static never emits: they
return an int32 accumulator whose scale is only known at run time), and contrib operators with
no float counterpart here (QLinearWhere, QLinearReduceMean, QAttention, ...), or with
channels_last layouts.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError

MS = "com.microsoft"

# op -> (float op, input slots as (x, scale, zp) triples, (y_scale, y_zp) slots)
_UNARY = {"QLinearAveragePool": "AveragePool", "QLinearGlobalAveragePool": "GlobalAveragePool",
          "QLinearSigmoid": "Sigmoid", "QLinearLeakyRelu": "LeakyRelu", "QLinearSoftmax": "Softmax"}
_BINARY = {"QLinearAdd": "Add", "QLinearMul": "Mul"}
REWRITTEN = set(_UNARY) | set(_BINARY) | {"QLinearConv", "QLinearMatMul", "QGemm", "QLinearConcat"}


def _passes_through(op: str) -> bool:
    """Standard operators QOperator models apply to 8-bit tensors as they are (same scale and zero
    point in and out): the registry's single-input data movement (ops: moves="first"), and
    MaxPool, which has no 8-bit form of its own and is wrapped in DQ / Q."""
    from tinydeploy.ops import REGISTRY
    d = REGISTRY.get(op)
    return op == "MaxPool" or (d is not None and d.moves == "first")


def _is(node: onnx.NodeProto, op: str) -> bool:
    return node.op_type == op and node.domain in ("", "ai.onnx", MS)


class _Rewriter:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        g = model.graph
        self.consts = {i.name: i for i in g.initializer}
        for n in g.node:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.output) == 1:
                for a in n.attribute:
                    if a.name == "value":
                        self.consts[n.output[0]] = a.t
        self.dtypes: dict[str, int] = {i.name: i.data_type for i in g.initializer}
        for vi in list(g.input) + list(g.value_info) + list(g.output):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                self.dtypes.setdefault(vi.name, vi.type.tensor_type.elem_type)
        self.names = {i.name for i in g.initializer} | {n for node in g.node for n in list(node.input) + list(node.output)}
        self.new_inits: list[onnx.TensorProto] = []
        self.qparams: dict[str, tuple[str, str]] = {}   # 8-bit tensor -> (scale, zero point) names
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)

    def fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self.names:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name

    def const(self, name: str, what: str, node: onnx.NodeProto) -> np.ndarray:
        t = self.consts.get(name)
        if t is None:
            raise TinydeployError(f"{node.op_type} {printable(node.name, 60)!r}: {what} {printable(name, 60)!r} is "
                                  "not a constant (quantisation parameters must be known at build time)")
        return numpy_helper.to_array(t)

    def add_const(self, base: str, arr: np.ndarray) -> str:
        name = self.fresh(base)
        self.new_inits.append(numpy_helper.from_array(np.asarray(arr), name))
        self.dtypes[name] = helper.np_dtype_to_tensor_dtype(np.asarray(arr).dtype)
        return name

    def dtype_of(self, x: str, zp: str) -> int:
        if zp and zp in self.dtypes:
            return self.dtypes[zp]
        return self.dtypes.get(x, TensorProto.UINT8)

    def dq(self, out_nodes, node, x, scale, zp, tag, axis=None):
        y = self.fresh(f"{node.output[0]}__dq_{tag}")
        ins = [x, scale] + ([zp] if zp else [])
        kw = {} if axis is None else {"axis": axis}
        out_nodes.append(helper.make_node("DequantizeLinear", ins, [y], name=self.fresh(f"{node.name}/dq_{tag}"), **kw))
        self.dtypes[y] = TensorProto.FLOAT
        return y

    def q(self, out_nodes, node, v, scale, zp, y_dtype, out):
        if not zp:   # QuantizeLinear without a zero point makes uint8: say the type explicitly
            zp = self.add_const(f"{out}__zp", np.zeros((), helper.tensor_dtype_to_np_dtype(y_dtype)))
        out_nodes.append(helper.make_node("QuantizeLinear", [v, scale, zp], [out], name=self.fresh(f"{node.name}/q")))
        self.dtypes[out] = y_dtype

    def per_channel(self, node, scale: str, zp: str, what: str) -> tuple[str, str, bool]:
        """A weight's scale / zero point as DequantizeLinear wants them: a per-channel scale
        with a scalar zero point gets a zero point array of the same length."""
        s = self.const(scale, f"{what} scale", node)
        if s.size <= 1:
            return scale, zp, False
        if s.ndim != 1:
            raise TinydeployError(f"{node.op_type} {printable(node.name, 60)!r}: {what} scale of shape "
                                  f"{list(s.shape)} (only per-tensor or 1-D per-channel scales)")
        if zp:
            z = self.const(zp, f"{what} zero point", node)
            if z.size != s.size:
                zp = self.add_const(f"{zp}__per_channel", np.full(s.shape, z.reshape(-1)[0], z.dtype))
        return scale, zp, True

    def bias(self, out_nodes, node, b: str, s_a: str, s_b: str, tag: str) -> str:
        sa = np.float32(self.const(s_a, "input scale", node).reshape(-1)[0])
        sb = self.const(s_b, "weight scale", node).astype(np.float32).reshape(-1)
        bscale = (sa * sb).astype(np.float32)          # float32 product, as onnxruntime forms it
        bdata = self.consts.get(b)
        per = bscale.size > 1
        name = self.add_const(f"{b}__scale", bscale if per else bscale.reshape(()))
        zero = self.add_const(f"{b}__zp", np.zeros(bscale.shape if per else (), np.int32))
        if bdata is not None and per and numpy_helper.to_array(bdata).ndim != 1:
            raise TinydeployError(f"{node.op_type} {printable(node.name, 60)!r}: bias is not 1-D")
        return self.dq(out_nodes, node, b, name, zero, tag, axis=0 if per else None)

    def note_output(self, node: onnx.NodeProto) -> None:
        """Remember the (scale, zero point) of a QLinear node's 8-bit output."""
        ins = list(node.input) + [""] * 9
        pos = {"QLinearConv": (6, 7), "QLinearMatMul": (6, 7), "QGemm": (7, 8), "QLinearConcat": (0, 1)}
        s, z = pos.get(node.op_type, (6, 7) if node.op_type in _BINARY else (3, 4))
        if ins[s]:
            self.qparams[node.output[0]] = (ins[s], ins[z])

    def wrap(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """An operator QOperator models apply to 8-bit tensors directly (MaxPool): the same
        operator between DQ and Q of the input's parameters, which the QDQ pass runs on integers."""
        x, out = node.input[0], node.output[0]
        scale, zp = self.qparams[x]
        res: list[onnx.NodeProto] = []
        y_dtype = self.dtype_of(x, zp)
        fx = self.dq(res, node, x, scale, zp, "x")
        fl = self.fresh(f"{out}__float")
        res.append(helper.make_node(node.op_type, [fx] + list(node.input[1:]), [fl], name=node.name))
        res[-1].attribute.extend(node.attribute)
        self.q(res, node, fl, scale, zp, y_dtype, out)
        return res

    # ---- per operator ------------------------------------------------------------------------

    def check_params_constant(self, node: onnx.NodeProto) -> None:
        op = node.op_type
        if op == "QLinearConcat":
            data = set(range(2, len(node.input), 3))
        elif op in ("QLinearConv", "QLinearMatMul", "QGemm") or op in _BINARY:
            data = {0, 3, 8} if op == "QLinearConv" else ({0, 3, 6} if op == "QGemm" else {0, 3})
        else:
            data = {0}
        for k, name in enumerate(node.input):
            if name and k not in data and name not in self.consts:
                raise TinydeployError(f"{op} {printable(node.name, 60)!r}: scale / zero point input {printable(name, 60)!r} is not "
                                      "a constant (quantisation parameters must be known at build time)")

    def rewrite(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        self.check_params_constant(node)
        op, ins, out = node.op_type, list(node.input) + [""] * 9, node.output[0]
        attrs = [a for a in node.attribute]
        res: list[onnx.NodeProto] = []
        if op in ("QLinearConv", "QLinearMatMul", "QGemm"):
            x, sx, zx, w, sw, zw = ins[:6]
            if op == "QLinearConv":
                sy, zy, b = ins[6], ins[7], ins[8]
            elif op == "QLinearMatMul":
                sy, zy, b = ins[6], ins[7], ""
            else:
                b, sy, zy = ins[6], ins[7], ins[8]
            a = {at.name: helper.get_attribute_value(at) for at in attrs}
            if op == "QGemm" and a.get("transA", 0):
                raise TinydeployError(f"QGemm {printable(node.name, 60)!r}: transA=1 is not supported")
            y_dtype = self.dtype_of(x, zx)
            xd = self.dq(res, node, x, sx, zx, "x")
            sw, zw, per = self.per_channel(node, sw, zw, "weight")
            axis = None
            if per:
                axis = 0 if op == "QLinearConv" or (op == "QGemm" and a.get("transB", 0)) else 1
                if op == "QLinearMatMul":
                    axis = -1
            wd = self.dq(res, node, w, sw, zw, "w", axis=axis)
            float_ins = [xd, wd]
            if b:
                float_ins.append(self.bias(res, node, b, sx, sw, "b"))
            fl = self.fresh(f"{out}__float")
            if op == "QLinearConv":
                res.append(helper.make_node("Conv", float_ins, [fl], name=node.name))
                res[-1].attribute.extend(attrs)
            elif op == "QLinearMatMul":
                res.append(helper.make_node("MatMul", float_ins, [fl], name=node.name))
            else:
                alpha = float(a.get("alpha", 1.0))
                res.append(helper.make_node("Gemm", float_ins, [fl], name=node.name, alpha=alpha, beta=alpha,
                                            transB=int(a.get("transB", 0))))
            if op == "QGemm" and not sy:     # float output
                res[-1].output[0] = out
                self.dtypes[out] = TensorProto.FLOAT
                return res
            self.q(res, node, fl, sy, zy, y_dtype, out)
            return res
        if op in _BINARY:
            a_, sa, za, b_, sb, zb, sy, zy = ins[:8]
            y_dtype = self.dtype_of(a_, za)
            fa, fb = self.dq(res, node, a_, sa, za, "a"), self.dq(res, node, b_, sb, zb, "b")
            fl = self.fresh(f"{out}__float")
            res.append(helper.make_node(_BINARY[op], [fa, fb], [fl], name=node.name))
            self.q(res, node, fl, sy, zy, y_dtype, out)
            return res
        if op in _UNARY:
            x, sx, zx, sy, zy = ins[:5]
            kept = []
            for at in attrs:
                if at.name == "channels_last":
                    if at.i:
                        raise TinydeployError(f"{op} {printable(node.name, 60)!r}: channels_last=1 (NHWC) "
                                              "is not supported")
                    continue
                if at.name == "opset":
                    continue
                kept.append(at)
            if op == "QLinearSoftmax":
                a = {at.name: helper.get_attribute_value(at) for at in attrs}
                ver, axis = int(a.get("opset", 13)), int(a.get("axis", -1))
                if (ver < 13) != (self.opset < 13) and axis != -1:
                    raise TinydeployError(f"QLinearSoftmax {printable(node.name, 60)!r}: softmax semantics of "
                                          f"opset {ver} with axis {axis} differ from the model's opset "
                                          f"{self.opset}; not supported")
            y_dtype = self.dtype_of(x, zx)
            fx = self.dq(res, node, x, sx, zx, "x")
            fl = self.fresh(f"{out}__float")
            res.append(helper.make_node(_UNARY[op], [fx], [fl], name=node.name))
            res[-1].attribute.extend(kept)
            self.q(res, node, fl, sy, zy, y_dtype, out)
            return res
        if op == "QLinearConcat":
            sy, zy, rest = node.input[0], node.input[1], list(node.input[2:])
            if len(rest) % 3 or not rest:
                raise TinydeployError(f"QLinearConcat {printable(node.name, 60)!r}: inputs are not "
                                      "(tensor, scale, zero point) triples")
            y_dtype = self.dtype_of(rest[0], zy)
            fins = [self.dq(res, node, rest[k], rest[k + 1], rest[k + 2], f"in{k // 3}") for k in range(0, len(rest), 3)]
            fl = self.fresh(f"{out}__float")
            res.append(helper.make_node("Concat", fins, [fl], name=node.name))
            res[-1].attribute.extend(attrs)
            self.q(res, node, fl, sy, zy, y_dtype, out)
            return res
        raise AssertionError(op)


def rewrite_qoperator(model: onnx.ModelProto) -> bool:
    """Rewrite every QLinear* node of `model` (in place) into its QDQ subgraph. Returns whether
    anything was rewritten."""
    g = model.graph
    if not any(_is(n, n.op_type) and n.op_type in REWRITTEN for n in g.node):
        return False
    rw = _Rewriter(model)
    new_nodes = []
    for n in g.node:
        if n.op_type in REWRITTEN and n.domain in ("", "ai.onnx", MS):
            new_nodes.extend(rw.rewrite(n))
            rw.note_output(n)
        else:
            new_nodes.append(n)
            if n.op_type == "QuantizeLinear" and n.output:
                zp = n.input[2] if len(n.input) > 2 else ""
                rw.dtypes[n.output[0]] = rw.dtypes.get(zp, TensorProto.UINT8) if zp else TensorProto.UINT8
            elif n.domain in ("", "ai.onnx") and _passes_through(n.op_type) and n.input and n.output:
                if n.input[0] in rw.dtypes:
                    rw.dtypes[n.output[0]] = rw.dtypes[n.input[0]]
                if n.input[0] in rw.qparams:
                    rw.qparams[n.output[0]] = rw.qparams[n.input[0]]
                    if n.op_type == "MaxPool" and len(n.output) == 1:   # on the integers: DQ -> MaxPool -> Q
                        new_nodes.pop()
                        new_nodes.extend(rw.wrap(n))
            if n.op_type == "QuantizeLinear" and len(n.input) > 1:
                rw.qparams[n.output[0]] = (n.input[1], n.input[2] if len(n.input) > 2 else "")
    del g.node[:]
    g.node.extend(new_nodes)
    g.initializer.extend(rw.new_inits)
    # The contrib domain may now be unused; onnx's checker ignores unused opset imports.
    return True
