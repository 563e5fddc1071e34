"""ONNX file -> ir.Graph.

Steps: read and parse defensively; load external data only from inside the model's folder;
check; bring old opsets to a known range with onnx's version converter; pin symbolic input
dimensions; run onnx shape inference; fold constant subgraphs; build the typed graph.

Constant folding is written here because onnx itself has no folder: each foldable node is
evaluated by onnx's own reference evaluator (so the semantics are onnx's, not ours).
"""
from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference, version_converter

from tinydeploy import ir, limits
from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.inputfiles import read_regular, regular_size
from tinydeploy.ops import REGISTRY

MIN_OPSET = 13          # older models are converted up to this
MAX_FILE_BYTES = 2 << 30  # protobuf's own limit
# How large a folded constant may be is not a fixed cap but tinydeploy.limits' weights budget.
EXPANSION_NOTE_BYTES = 16 << 20   # folding that makes more than this, and more than the file's size, is noted
NO_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
           "Bernoulli", "If", "Loop", "Scan",
           # Q/DQ of constant weights stay: the QDQ pass (tinydeploy/quant/) reads them as
           # integer weights with their scales instead of float constants.
           "QuantizeLinear", "DequantizeLinear"}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parse_shape_overrides(specs: list[str] | None) -> dict[str, tuple[int, ...]]:
    """`NAME=1x3x224x224` -> {NAME: (1, 3, 224, 224)}."""
    out = {}
    for spec in specs or []:
        name, sep, dims = spec.rpartition("=")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            shape = ()
        if not sep or not name or not shape or min(shape) <= 0:
            raise TinydeployError(f"--input-shape {printable(spec)!r} is not NAME=DxDx...D with positive "
                                  "integers, e.g. input=1x3x224x224")
        out[name] = shape
    return out


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Read and parse an ONNX file; every failure becomes a one-line TinydeployError."""
    path = Path(path)
    size = regular_size(path, "model file")
    if size == 0:
        raise TinydeployError(f"model file {printable(str(path))!r} is empty")
    if size >= MAX_FILE_BYTES:
        raise TinydeployError(f"model file is {size} bytes; ONNX protobuf files must be < 2 GiB "
                              "(store large weights as external data)")
    data = read_regular(path, "model file", MAX_FILE_BYTES - 1)
    try:
        model = onnx.load_model_from_string(data)
    except Exception:  # protobuf raises DecodeError, RuntimeError or ValueError depending on backend
        raise TinydeployError(f"{printable(path.name)!r} is not a valid ONNX file (protobuf parse "
                              "failed; is it truncated or of another format?)") from None
    if model.HasField("graph") and len(model.graph.node) == 0 and len(model.graph.output) == 0:
        raise TinydeployError(f"{printable(path.name)!r} has an empty graph (no nodes and no outputs); "
                              "there is nothing to compile")
    if not model.HasField("graph"):
        raise TinydeployError(f"{printable(path.name)!r} is not an ONNX model (no graph); "
                              "is it truncated or of another format?")
    _load_external_data(model, path.parent)
    _check_initializers(model)
    return model


def _check_initializers(model: onnx.ModelProto) -> None:
    """Every initializer holds exactly the values its dims call for (a longer or shorter one
    would be cut or read past its end)."""
    for t in model.graph.initializer:
        where = f"initializer {printable(t.name, 80)!r}"
        if any(d < 0 for d in t.dims):
            raise TinydeployError(f"{where} has negative dimensions {list(t.dims)}")
        n = math.prod(t.dims)
        dt = None
        try:
            dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
        except Exception:
            pass
        whole_bytes = dt is not None and not any(k in dt.name for k in ("int4", "int2", "float4"))   # not packed
        if t.HasField("raw_data") and whole_bytes:
            if len(t.raw_data) != n * dt.itemsize:
                raise TinydeployError(f"{where} holds {len(t.raw_data)} bytes of data where its dims "
                                      f"{'x'.join(map(str, t.dims)) or '(scalar)'} need {n * dt.itemsize} "
                                      f"({n} x {dt.name}); the model is malformed")
            continue
        try:
            numpy_helper.to_array(t)
        except Exception as e:
            raise TinydeployError(f"{where} cannot be read as {'x'.join(map(str, t.dims)) or 'a scalar'} of "
                                  f"element type {t.data_type}: {printable(str(e).splitlines()[0] if str(e) else type(e).__name__, 120)}; "
                                  "the model is malformed") from None


def _external_number(t: onnx.TensorProto, info: dict, key: str) -> int:
    text = info.get(key, "") or "0"
    if not text.isdigit() or len(text) > 18:
        raise TinydeployError(f"initializer {printable(t.name, 80)!r}: external data {key} {printable(text, 30)!r} is "
                              "not a whole number of bytes; the model is malformed")
    return int(text)


def _load_external_data(model: onnx.ModelProto, base: Path) -> None:
    base = base.resolve()
    tensors = list(onnx.external_data_helper._get_all_tensors(model))
    for t in tensors:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        if not loc or "\0" in loc:
            raise TinydeployError(f"initializer {printable(t.name)!r} points to external data {printable(loc)!r}, "
                                  "which is no file name; the model is malformed")
        try:
            target = (base / loc).resolve()
        except (OSError, RuntimeError):   # a loop of symbolic links
            target = Path("/")
        if os.path.isabs(loc) or not target.is_relative_to(base):
            raise TinydeployError(f"initializer {printable(t.name)!r} points to external data "
                                  f"{printable(loc)!r} outside the model's folder; refusing to read it")
        if not target.is_file():
            raise TinydeployError(f"external data file {printable(loc)!r} for initializer "
                                  f"{printable(t.name)!r} is missing next to the model")
        end = _external_number(t, info, "offset") + _external_number(t, info, "length")
        if end > target.stat().st_size:
            raise TinydeployError(f"external data for {printable(t.name)!r} runs past the end of "
                                  f"{printable(loc)!r}; the data file is truncated")
    try:
        onnx.external_data_helper.load_external_data_for_model(model, str(base))
    except Exception as e:
        raise TinydeployError(f"could not load external data: {printable(str(e).splitlines()[0])}") from None


def _opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return 1


def _channel_slopes_of_opset6(model: onnx.ModelProto) -> None:
    """Before opset 7 a PRelu slope of shape [C] applied per channel (axis 1); from opset 7 it
    broadcasts numpy-style, from the last axis. onnx's version converter keeps the tensor as it
    is, so a constant per-channel slope is given its [C, 1, ..., 1] shape here first."""
    prelus = [n for n in model.graph.node if n.op_type == "PRelu" and n.domain in ("", "ai.onnx") and len(n.input) > 1]
    if not prelus:
        return
    try:
        shapes = _shapes(shape_inference.infer_shapes(model))
    except Exception:
        return   # the strict inference after conversion reports what is wrong
    inits = {i.name: i for i in model.graph.initializer}
    for n in prelus:
        x, s = shapes.get(n.input[0], (None, 0))[0], inits.get(n.input[1])
        if x is None or s is None or len(x) < 3 or len(s.dims) != 1 or s.dims[0] in (1,) or s.dims[0] != x[1]:
            continue
        slope = numpy_helper.to_array(s).reshape((x[1],) + (1,) * (len(x) - 2))
        name = s.name + "_per_channel"
        if name not in inits:
            t = numpy_helper.from_array(slope, name)
            model.graph.initializer.append(t)
            inits[name] = t
            if any(i.name == s.name for i in model.graph.input):   # IR < 4: initializers are inputs too
                model.graph.input.append(onnx.helper.make_tensor_value_info(name, s.data_type, list(slope.shape)))
        n.input[1] = name


def _normalise_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    v = _opset(model)
    if v < 7:
        _channel_slopes_of_opset6(model)
    if v < MIN_OPSET:
        try:
            model = version_converter.convert_version(model, MIN_OPSET)
        except Exception as e:
            raise TinydeployError(f"model uses opset {v}; converting it to opset {MIN_OPSET} failed: "
                                  f"{printable(str(e).splitlines()[0] if str(e) else type(e).__name__)}") from None
        # The converter keeps the old IR version. Under IR < 4 shape inference ignores
        # initializers that are not also graph inputs, which is what constant folding adds.
        try:
            model.ir_version = max(model.ir_version, onnx.helper.find_min_ir_version_for(
                [o for o in model.opset_import if o.domain in ("", "ai.onnx")], ignore_unknown=True))
        except Exception:
            pass
    elif v > onnx.defs.onnx_opset_version():
        raise TinydeployError(f"model uses opset {v}, newer than this onnx package knows "
                              f"({onnx.defs.onnx_opset_version()}); upgrade onnx")
    return model


def _pin_input_shapes(model: onnx.ModelProto, overrides: dict[str, tuple[int, ...]], notes: list[str]) -> None:
    inits = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    names = {i.name for i in inputs}
    for name in overrides:
        if name not in names:
            raise TinydeployError(f"--input-shape names {printable(name)!r}, but the model's inputs are "
                                  f"{', '.join(repr(printable(n)) for n in sorted(names))}")
    for inp in inputs:
        tt = inp.type.tensor_type
        if not inp.type.HasField("tensor_type"):
            raise TinydeployError(f"input {printable(inp.name)!r} is not a tensor (sequences and maps are not supported)")
        dims = tt.shape.dim
        if inp.name in overrides:
            shape = overrides[inp.name]
            if len(shape) != len(dims):
                raise TinydeployError(f"--input-shape gives {len(shape)} dimensions for {printable(inp.name)!r}, "
                                      f"the model says {len(dims)}")
            for d, v in zip(dims, shape):
                if d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != v:
                    raise TinydeployError(f"--input-shape {printable(inp.name)}={'x'.join(map(str, shape))} "
                                          f"conflicts with the model's fixed dimension {d.dim_value}")
                d.Clear()
                d.dim_value = v
            continue
        for axis, d in enumerate(dims):
            if d.HasField("dim_value"):   # fixed, even 0 (the verifier refuses empty tensors)
                continue
            sym = d.dim_param or "?"
            if axis == 0:
                d.Clear()
                d.dim_value = 1
                notes.append(f"input {printable(inp.name)!r}: batch dimension {printable(sym)!r} set to 1")
            else:
                raise TinydeployError(
                    f"input {printable(inp.name)!r} has symbolic dimension {printable(sym)!r} at axis {axis}; "
                    f"give its shape with --input-shape {printable(inp.name)}=" + "x".join(
                        str(x.dim_value) if x.dim_value > 0 else "N" for x in dims))
    # Output and value_info dims are re-derived by shape inference from the pinned inputs.
    for vi in list(model.graph.output) + list(model.graph.value_info):
        if vi.type.HasField("tensor_type"):
            for d in vi.type.tensor_type.shape.dim:
                if not d.HasField("dim_value"):
                    d.Clear()
    del model.graph.value_info[:]


def _declared_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """The intermediate shapes the model states (value_info; static dims, None where symbolic)."""
    out = {}
    for vi in model.graph.value_info:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
    return out


def _refuse_contradicted_shapes(declared: dict[str, list[int | None]], inferred: dict) -> None:
    """A model whose stated intermediate shapes contradict what its inputs and attributes make is
    invalid (onnx's strict shape inference says so; onnxruntime plans its buffers by the stated
    shapes and fails). The import re-derives those shapes, so it checks them first."""
    bad = []
    for name, dims in declared.items():
        got = inferred.get(name, (None, 0))[0]
        if got is None:
            continue
        if len(got) != len(dims) or any(d is not None and d != g for d, g in zip(dims, got)):
            bad.append(f"{printable(name, 60)!r} is stated as {'x'.join('?' if d is None else str(d) for d in dims)} "
                       f"but its inputs make it {'x'.join(map(str, got))}")
    if bad:
        raise TinydeployError(f"the model's stated shapes contradict its operators ({len(bad)} tensor"
                              f"{'s' * (len(bad) != 1)}): " + "; ".join(bad[:4])
                              + (f"; and {len(bad) - 4} more" if len(bad) > 4 else ""))


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:
        msg = str(e).strip().splitlines()
        text = msg[-1] if msg else type(e).__name__
        for noise in ("[ShapeInferenceError] ", "[TypeInferenceError] ", "Inference error(s): "):
            text = text.replace(noise, "")   # room for what onnx found, and where
        raise TinydeployError("onnx shape inference failed: " + printable(text, 300)) from None


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[tuple | None, int]]:
    """name -> (static shape or None, onnx elem type) for every typed value in the graph."""
    out = {}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        shape = None
        if tt.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
            shape = tuple(dims) if all(d >= 0 for d in dims) else None
        out[vi.name] = (shape, tt.elem_type)
    return out


def _negative_dims(g: onnx.GraphProto, name: str) -> str | None:
    """'1x2x-2x-2' when shape inference gave tensor `name` a negative dimension, else None."""
    for vi in list(g.value_info) + list(g.output):
        if vi.name == name and vi.type.HasField("tensor_type"):
            dims = vi.type.tensor_type.shape.dim
            if any(d.HasField("dim_value") and d.dim_value < 0 for d in dims):
                return "x".join(str(d.dim_value) if d.HasField("dim_value") else "?" for d in dims)
    return None


def _itemsize(elem_type: int) -> int:
    try:
        return max(1, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)
    except Exception:
        return 4


def _initializer_bytes(t: onnx.TensorProto) -> int:
    """Bytes of an initializer from its dims and type (reading raw_data would copy it)."""
    return math.prod(t.dims) * _itemsize(t.data_type)


def _fold_output_sizes(node: onnx.NodeProto, consts: dict, shapes: dict, opset: int) -> list[tuple[int, int] | None]:
    """(elements, bytes per element) of each output of a node about to be folded, or None where
    not known beforehand. Exact integers from shapes, so nothing is ever allocated to find out."""
    if node.op_type == "ConstantOfShape":
        dims = [int(d) for d in numpy_helper.to_array(consts[node.input[0]]).reshape(-1)]
        if any(d < 0 for d in dims):
            raise TinydeployError(f"ConstantOfShape {printable(node.name)!r} asks for the shape "
                                  f"{'x'.join(map(str, dims[:8]))}; negative dimensions: the model is malformed")
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        return [(math.prod(dims), _itemsize(value.data_type) if value is not None else 4)]
    out = [(math.prod(shapes[o][0]), _itemsize(shapes[o][1])) if o and shapes.get(o, (None, 0))[0] is not None
           else None for o in node.output]
    if None in out:  # not inferred in the whole graph (an input folded earlier in this sweep):
        one = _infer_one(node, consts, opset)   # infer this node alone, its small constants as data
        out = [s if s is not None else one.get(o) for s, o in zip(out, node.output)]
    return out


def _infer_one(node: onnx.NodeProto, consts: dict, opset: int) -> dict[str, tuple[int, int]]:
    """Output sizes of one node with constant inputs by onnx shape inference, giving the values of
    the small inputs (shapes, repeats, pads: what sizes depend on) and only the type of the rest."""
    inits, inputs = [], []
    for name in dict.fromkeys(i for i in node.input if i):
        t = consts[name]
        if math.prod(t.dims) <= 4096:
            inits.append(t)
        else:
            inputs.append(onnx.helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
    outs = [onnx.helper.make_empty_tensor_value_info(o) for o in node.output if o]
    m = onnx.helper.make_model(onnx.helper.make_graph([node], "one", inputs, outs, inits),
                               opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        shapes = _shapes(shape_inference.infer_shapes(m, data_prop=True))
    except Exception:
        return {}
    return {o: (math.prod(s), _itemsize(et)) for o, (s, et) in shapes.items() if s is not None and o in node.output}


def _fold_constants(model: onnx.ModelProto, opset: int, tally: limits.Tally, file_bytes: int) -> bool:
    """One sweep of constant folding. Returns True when something was folded. Each constant it
    makes counts against the weights budget (`tally`), checked before it is computed."""
    from onnx.reference import ReferenceEvaluator

    g = model.graph
    consts = {i.name: i for i in g.initializer}
    shapes = _shapes(model)
    kept, folded = [], False
    for node in g.node:
        if node.domain not in ("", "ai.onnx") or node.op_type in NO_FOLD:
            kept.append(node)
            continue
        values = None
        if node.op_type in ("Shape", "Size") and node.input[0] in shapes and shapes[node.input[0]][0] is not None:
            shape = shapes[node.input[0]][0]
            if node.op_type == "Size":
                values = [np.array(math.prod(shape), dtype=np.int64)]
            else:
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                start, end = attrs.get("start", 0), attrs.get("end", None)
                values = [np.array(shape[slice(start, end)], dtype=np.int64)]
        elif all((not i) or i in consts for i in node.input) and not any(
                a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            sizes = _fold_output_sizes(node, consts, shapes, opset)
            for size in sizes:
                if size is not None:
                    tally.add(size[0] * size[1], lambda n=size[0], b=size[1]: _fold_what(node, n, b, file_bytes))
            values = _evaluate(node, [consts[i] if i else None for i in node.input], opset, ReferenceEvaluator)
            for size, v in zip(sizes, values):   # sizes shape inference could not tell: counted now
                if size is None:
                    tally.add(v.nbytes, lambda n=v.size, b=v.itemsize: _fold_what(node, n, b, file_bytes))
        if values is None:
            kept.append(node)
            continue
        for name, v in zip(node.output, values):
            if name:
                g.initializer.append(numpy_helper.from_array(np.asarray(v), name))
                consts[name] = g.initializer[-1]   # the graph's copy: a large constant is held once
        folded = True
    if folded:
        del g.node[:]
        g.node.extend(kept)
    return folded


def _fold_what(node: onnx.NodeProto, elements: int, itemsize: int, file_bytes: int) -> str:
    return (f"node {printable(node.name)!r} ({node.op_type}) would make a constant of {elements} elements x "
            f"{itemsize} bytes = {elements * itemsize} bytes ({limits.human(elements * itemsize)}) from a "
            f"{limits.human(file_bytes)} model file")


def _evaluate(node: onnx.NodeProto, inputs: list, opset: int, evaluator_cls) -> list | None:
    g_inputs, feeds, names = [], {}, []
    for k, t in enumerate(inputs):
        if t is None:
            names.append("")
            continue
        nm = f"in{k}"
        arr = numpy_helper.to_array(t)
        names.append(nm)
        g_inputs.append(onnx.helper.make_tensor_value_info(nm, t.data_type, arr.shape))
        feeds[nm] = arr
    outs = [f"out{k}" for k in range(len(node.output))]
    n = onnx.helper.make_node(node.op_type, names, outs, domain=node.domain)
    n.attribute.extend(node.attribute)
    graph = onnx.helper.make_graph([n], "fold", g_inputs,
                                   [onnx.helper.make_empty_tensor_value_info(o) for o in outs])
    m = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        res = evaluator_cls(m).run(None, feeds)
    except Exception as e:
        raise TinydeployError(f"could not fold constant node {printable(node.name)!r} ({node.op_type}): "
                              f"{printable(str(e).splitlines()[0] if str(e) else type(e).__name__)[:200]}") from None
    return [np.asarray(r) for r in res]



def _drop_padding_only_ceil_windows(model: onnx.ModelProto) -> None:
    """ceil_mode=1 can add a last pooling window that starts in the right padding. The ONNX spec
    ("sliding windows that would start in the right padded region are ignored") and onnxruntime
    drop it, but onnx shape inference counts it. A pool whose extra windows are all of that kind
    computes exactly what it computes with ceil_mode=0, so it is rewritten to say so before
    shape inference."""
    cands = []
    for n in model.graph.node:
        if n.op_type in ("MaxPool", "AveragePool") and n.domain in ("", "ai.onnx"):
            a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
            if a.get("ceil_mode", 0) and a.get("auto_pad", b"NOTSET") in (b"NOTSET", b"") and "kernel_shape" in a:
                cands.append((n, a))
    if not cands:
        return
    try:
        shapes = _shapes(shape_inference.infer_shapes(model, data_prop=True))
    except Exception:
        return  # the strict inference that follows reports it
    rewritten = False
    for n, a in cands:
        x = shapes.get(n.input[0], (None, 0))[0]
        k = list(a["kernel_shape"])
        r = len(k)
        if x is None or len(x) != r + 2:
            continue
        s, d = list(a.get("strides", [1] * r)), list(a.get("dilations", [1] * r))
        p = list(a.get("pads", [0] * (2 * r)))
        drops, keeps = False, False
        for i in range(r):
            span = x[2 + i] + p[i] + p[i + r] - (k[i] - 1) * d[i] - 1
            if span < 0 or min(s[i], d[i]) < 1:
                keeps = True
            elif span % s[i]:   # ceil adds window number span // s + 1: where does it start?
                if (span // s[i] + 1) * s[i] >= x[2 + i] + p[i]:
                    drops = True
                else:
                    keeps = True
        if drops and not keeps:
            for attr in n.attribute:
                if attr.name == "ceil_mode":
                    attr.i = 0
            rewritten = True
    if rewritten:   # output shapes written by onnx shape inference count the window: re-derive them
        inputs = {i.name for i in model.graph.input}
        for vi in model.graph.output:
            if vi.name not in inputs and vi.type.HasField("tensor_type"):
                vi.type.tensor_type.ClearField("shape")


def import_model(path, input_shapes: dict[str, tuple[int, ...]] | None = None,
                 max_weights_bytes: "int | limits.Budget | None" = None) -> tuple[ir.Graph, onnx.ModelProto]:
    """Load `path` and return (typed graph, the normalised ONNX model it was made from).
    `max_weights_bytes`: the weights budget (see tinydeploy.limits; None: from this machine's
    memory): the model's constants, with every one constant folding makes, must fit in it."""
    budget = limits.budget(max_weights_bytes)
    model = load_model(path)
    # QOperator models (QLinearConv, com.microsoft QLinearAdd, ...) become QDQ graphs first:
    # the checker and shape inference know the standard operators they turn into.
    from tinydeploy.frontend.qoperator import rewrite_qoperator
    rewrite_qoperator(model)
    try:
        onnx.checker.check_model(model)
    except Exception as e:
        msg = str(e).strip().splitlines()
        raise TinydeployError("the ONNX checker rejected the model: " + printable(msg[0] if msg else "")[:300]) from None
    notes: list[str] = []
    model = _normalise_opset(model)
    declared = {} if input_shapes else _declared_shapes(model)
    _pin_input_shapes(model, input_shapes or {}, notes)
    _drop_padding_only_ceil_windows(model)
    model = _infer(model)
    _refuse_contradicted_shapes(declared, _shapes(model))
    file_bytes = Path(path).stat().st_size
    tally = limits.Tally(budget, sum(_initializer_bytes(t) for t in model.graph.initializer))
    start = tally.used
    for _ in range(16):
        if not _fold_constants(model, _opset(model), tally, file_bytes):
            break
        del model.graph.value_info[:]
        model = _infer(model)
    made = tally.used - start
    if made > max(EXPANSION_NOTE_BYTES, file_bytes):
        notes.append(f"constant folding made {limits.human(made)} of constants from a {limits.human(file_bytes)} "
                     f"model file (weights budget {limits.human(budget.bytes)}: {budget.how})")
    return _to_ir(model, notes), model


def _np_dtype(elem_type: int) -> np.dtype:
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except Exception:
        raise TinydeployError(f"tensor element type {elem_type} is not supported") from None


def _raise_if_unknown_ops(g: onnx.GraphProto, shapes: dict) -> None:
    """A tensor has no static shape. When an operator tinydeploy has no kernel for (custom domains,
    control flow, data-dependent outputs) left it so, report those operators, in the format of
    pipeline.check_supported, rather than the shape."""
    found: dict[str, list[str]] = {}
    culprit = False
    for k, n in enumerate(g.node):
        op = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}:{n.op_type}"
        if op in REGISTRY:
            continue
        found.setdefault(printable(op), []).append(printable(n.name or f"{n.op_type}_{k}", 40))
        culprit = culprit or any(o and shapes.get(o, (None, 0))[0] is None for o in n.output)
    if culprit:
        parts = [f"{op} x{len(names)} [" + ", ".join(names[:5])
                 + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "") + "]" for op, names in found.items()]
        raise TinydeployError("unsupported operators: " + "; ".join(parts))


def _to_ir(model: onnx.ModelProto, notes: list[str]) -> ir.Graph:
    g = model.graph
    shapes = _shapes(model)
    tensors: dict[str, ir.Tensor] = {}
    for init in g.initializer:
        arr = numpy_helper.to_array(init)
        tensors[init.name] = ir.Tensor(init.name, tuple(arr.shape), arr.dtype, data=arr)
    inputs = [i.name for i in g.input if i.name not in tensors]
    for node in g.node:
        for name in list(node.input) + list(node.output):
            if not name or name in tensors:
                continue
            shape, et = shapes.get(name, (None, 0))
            if shape is None or et == 0:
                _raise_if_unknown_ops(g, shapes)
                negative = _negative_dims(g, name)
                if negative:
                    raise TinydeployError(f"onnx shape inference gives tensor {printable(name)!r} (at node "
                                          f"{printable(node.name)!r}, {node.op_type}) the shape {negative}: the "
                                          "node's attributes do not fit the shapes of its inputs")
                raise TinydeployError(f"the shape of tensor {printable(name)!r} (at node {printable(node.name)!r}, "
                                      f"{node.op_type}) is not static after shape inference; pin the inputs "
                                      "with --input-shape or simplify the model")
            tensors[name] = ir.Tensor(name, tuple(shape), _np_dtype(et))
    for name in inputs + [o.name for o in g.output]:
        if name not in tensors:
            shape, et = shapes.get(name, (None, 0))
            if shape is None:
                raise TinydeployError(f"graph input/output {printable(name)!r} has no static shape")
            tensors[name] = ir.Tensor(name, tuple(shape), _np_dtype(et))
    nodes = []
    named = {n.name for n in g.node if n.name}
    for k, n in enumerate(g.node):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        attrs = {k2: (v.decode("utf-8", "replace") if isinstance(v, bytes) else v) for k2, v in attrs.items()}
        op = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}:{n.op_type}"
        name = n.name
        if not name:   # a name of its own, which no named node has (the verifier holds names unique)
            name, i = f"{n.op_type}_{k}", 1
            while name in named:
                name, i = f"{n.op_type}_{k}_{i}", i + 1
            named.add(name)
        nodes.append(ir.Node(op, name, list(n.input), list(n.output), attrs))
    return ir.Graph(tensors, nodes, inputs, [o.name for o in g.output], notes)
