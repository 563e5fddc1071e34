"""What tinydeploy's results are held against, and how they are compared.

FP32: onnxruntime's default session, norm-wise relative error <= 1e-4. 8-bit: the oracle
(`run_oracle`: onnxruntime running the graph node by node, its DQ -> op -> Q meaning), every
element within 1 LSB; tinydeploy's exact integer reference (tinydeploy.exact) bit for bit; and,
for information only, onnxruntime's fast session, whose 8-bit kernels differ by CPU
(`fast_session_report`). docs/quantization.md defines the 8-bit arithmetic."""
from __future__ import annotations

import numpy as np

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError


def random_inputs(specs: list[tuple[str, tuple, np.dtype]], seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs that respect each input's dtype: standard normal for floats, the full range
    for 8-bit integers."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape, dt in specs:
        dt = np.dtype(dt)
        if dt.kind == "f":
            out[name] = rng.standard_normal(shape).astype(dt)
        else:
            info = np.iinfo(dt)
            out[name] = rng.integers(max(info.min, -128), min(info.max, 255) + 1, shape).astype(dt)
    return out


# Operators that make a model an 8-bit one: QDQ (Q/DQ around float operators) or QOperator
# (QLinear* and onnxruntime's contrib operators, rewritten to QDQ by tinydeploy.qoperator).
_QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}


def is_8bit(model) -> bool:
    """Whether an ONNX model (ModelProto) quantises anything (QDQ or QOperator form)."""
    from tinydeploy.frontend.qoperator import REWRITTEN
    return any(n.op_type in _QDQ_OPS or n.op_type in REWRITTEN for n in model.graph.node)


def refused(e: Exception) -> TinydeployError:
    """onnxruntime refusing a model tinydeploy accepted (the verifier, tinydeploy/ops/verify.py,
    should have refused it first: please report it): one line, its own words, sanitised."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    status = text.rfind("Status Message:")
    text = text[status + len("Status Message:"):].strip() if status >= 0 else text
    return TinydeployError(f"onnxruntime, the reference, refuses this model: {printable(text, 300)} -- tinydeploy "
                           "should have refused it first; please report it with the model")


# Operators in a pre-opset-7 form (the schema the model's opset selects) that onnxruntime, the
# reference, has no kernel for (measured with onnxruntime 1.32: it answers NOT_IMPLEMENTED).
# tinydeploy itself converts them to opset 13 and builds them (the ONNX conformance cases hold
# them to their stored outputs); only a comparison with onnxruntime cannot be made.
_NO_REFERENCE_BEFORE_7 = {
    "Add": (1, 6), "Sub": (1, 6), "Mul": (1, 6), "Div": (1, 6), "Pow": (1,), "Sum": (1,), "Max": (1,),
    "Min": (1,), "Relu": (1,), "Sigmoid": (1,), "Tanh": (1,), "Exp": (1,), "Log": (1,), "Abs": (1,),
    "PRelu": (1, 6), "Clip": (1,), "Dropout": (1, 6), "Concat": (1,), "AveragePool": (1,), "Gemm": (1,),
    "BatchNormalization": (1, 6), "Pad": (1,),
}


def _old_forms_without_reference(model_bytes: bytes) -> None:
    """Says which pre-opset-7 forms onnxruntime cannot run, when that is why it refused the model."""
    import onnx
    try:
        model = onnx.load_model_from_string(model_bytes)
        v = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    except Exception:  # noqa: BLE001 - only an explanation; the caller reports the refusal itself
        return
    if not 0 < v < 7:
        return
    found: dict[str, int] = {}
    for n in model.graph.node:
        if n.domain in ("", "ai.onnx") and n.op_type in _NO_REFERENCE_BEFORE_7:
            try:
                since = onnx.defs.get_schema(n.op_type, v).since_version
            except Exception:
                continue
            if since in _NO_REFERENCE_BEFORE_7[n.op_type]:
                found.setdefault(n.op_type, since)
    if found:
        ops = ", ".join(f"{op} (version {since})" for op, since in sorted(found.items()))
        raise TinydeployError(f"model uses opset {v}, and onnxruntime, the reference, implements none of its "
                              f"{ops}: tinydeploy builds it, but cannot compare it; export the model with opset 7 "
                              "or later (13 or later is best)")


def _session(model_bytes: bytes, optimize: bool):
    import onnxruntime as ort
    ort.set_default_logger_severity(4)   # its errors come back as exceptions; nothing on stderr
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 4
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    except Exception as e:
        if "IR version" not in str(e):
            _old_forms_without_reference(model_bytes)
            raise refused(e) from None
    # A newer onnx package stamps IR versions this onnxruntime does not know yet; the graph
    # itself is unaffected, so retry with the newest IR version onnxruntime accepts.
    import onnx
    m = onnx.load_model_from_string(model_bytes)
    m.ir_version = 10
    try:
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise refused(e) from None


def run_session(sess, feeds: dict) -> list[np.ndarray]:
    try:
        return sess.run(None, feeds)
    except Exception as e:
        raise refused(e) from None


def run_onnxruntime(model_bytes: bytes, feeds: dict[str, np.ndarray], optimize: bool = True) -> list[np.ndarray]:
    """onnxruntime's CPU session, 1 thread. optimize=True is its default (fast) session, which
    fuses 8-bit QDQ groups into kernels whose results depend on the CPU (see run_oracle);
    optimize=False runs every node as written (ORT_DISABLE_ALL)."""
    return run_session(_session(model_bytes, optimize), feeds)


def oracle_bytes(model_bytes: bytes) -> tuple[bytes, bool]:
    """(the model the oracle runs, whether it is an 8-bit model). QOperator models become their
    QDQ form (tinydeploy.qoperator), which onnxruntime runs node by node; FP32 and QDQ models
    are returned as they are."""
    import onnx
    m = onnx.load_model_from_string(model_bytes)
    if not is_8bit(m):
        return model_bytes, False
    from tinydeploy.frontend.qoperator import rewrite_qoperator
    if rewrite_qoperator(m):
        return m.SerializeToString(), True
    return model_bytes, True


ORACLE_8BIT = ("onnxruntime with graph optimisations off (ORT_DISABLE_ALL): the graph's own "
               "DequantizeLinear -> float32 op -> QuantizeLinear meaning; QOperator models in their QDQ form")


def run_oracle(model_bytes: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """What the model means, independent of this CPU's fast paths. FP32 models: onnxruntime's
    default session. 8-bit models: every node as written (ORT_DISABLE_ALL), QOperator models in
    their QDQ form. onnxruntime's default session fuses 8-bit groups into kernels whose results
    differ by CPU (u8 x s8 products saturate in 16-bit pairs on x86 without VNNI; int8
    activations run through float32 on x86), so it is never the 8-bit reference."""
    data, q = oracle_bytes(model_bytes)
    return run_onnxruntime(data, feeds, optimize=not q)


def compare(got: list[np.ndarray], want: list[np.ndarray], rtol: float) -> dict:
    """Errors of `got` against `want`. max_rel_error is norm-wise per output,
    max|got - want| / max|want|, so elements near zero do not dominate it."""
    max_abs, max_rel, odd = 0.0, 0.0, 0
    for a, b in zip(got, want):
        a64, b64 = a.astype(np.float64), np.asarray(b).astype(np.float64)
        if a64.shape != b64.shape:
            return {"outputs_match": False, "max_abs_error": float("inf"), "max_rel_error": float("inf")}
        if a64.size == 0:
            continue
        # equal values (the same infinity included) and NaN against NaN agree; a NaN or an
        # infinity against anything else is an infinite error (never NaN: reports stay JSON)
        same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
        odd += int(np.count_nonzero(~same & ~(np.isfinite(a64) & np.isfinite(b64))))
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(same, 0.0, np.abs(a64 - b64))
        diff = np.where(np.isnan(diff), np.inf, diff)
        finite = np.isfinite(b64)
        scale = np.max(np.abs(np.where(finite, b64, 0.0)), initial=0.0)
        e = float(diff.max(initial=0.0))
        max_abs = max(max_abs, e)
        max_rel = max(max_rel, e / scale if scale > 0 else (0.0 if e == 0 else float("inf")))
    res = {"outputs_match": bool(max_rel <= rtol), "max_abs_error": max_abs, "max_rel_error": max_rel}
    if odd:   # the errors are infinite (null in JSON): say why
        res["note"] = (f"{odd} output element{'s are' if odd != 1 else ' is'} NaN or infinite in one result and "
                       "not the same in the other")
    return res


# ---- 8-bit outputs: compared in LSBs ----------------------------------------------------------

LSB_TOLERANCE = 1   # every element within 1 LSB of the oracle (identical elements are counted too)


def compare_lsb(got: list[np.ndarray], want: list[np.ndarray]) -> dict:
    """Integer outputs against a reference, in LSBs (units of the quantised value): outputs match
    when every |got - want| <= LSB_TOLERANCE. identical_fraction (elements equal) is reported,
    not judged: a 2-element output one LSB off is within the promise. max_rel_error is the
    norm-wise max|diff| / max|want|, for information."""
    max_abs, max_rel, same, total = 0, 0.0, 0, 0
    for a, b in zip(got, want):
        b = np.asarray(b)
        if a.shape != b.shape:
            return {"outputs_match": False, "max_abs_error": float("inf"), "max_rel_error": float("inf"),
                    "identical_fraction": 0.0}
        diff = np.abs(a.astype(np.int64) - b.astype(np.int64))
        e = int(diff.max(initial=0))
        max_abs = max(max_abs, e)
        scale = int(np.abs(b.astype(np.int64)).max(initial=0))
        max_rel = max(max_rel, e / scale if scale else (0.0 if e == 0 else float("inf")))
        same += int((diff == 0).sum())
        total += diff.size
    frac = same / total if total else 1.0
    return {"outputs_match": bool(max_abs <= LSB_TOLERANCE), "max_abs_error": float(max_abs),
            "max_rel_error": max_rel, "identical_fraction": frac}


def _in_lsb(got: list, want: list, lsb_scales) -> tuple[list, list]:
    """Float outputs that are dequantised 8-bit tensors (lsb_scales[i] set: a QDQ model's final
    DequantizeLinear) as integers in units of their scale."""
    got, want = list(got), list(want)
    for i, s in enumerate(lsb_scales or []):
        if s and i < len(want) and np.asarray(want[i]).dtype.kind == "f" and np.shape(got[i]) == np.shape(want[i]):
            with np.errstate(invalid="ignore", over="ignore"):
                got[i] = np.rint(np.asarray(got[i], np.float64) / s).astype(np.int64)
                want[i] = np.rint(np.asarray(want[i], np.float64) / s).astype(np.int64)
    return got, want


def compare_outputs(got: list[np.ndarray], want: list[np.ndarray], rtol: float, lsb_scales=None) -> dict:
    """`compare` (relative, `tolerance` = rtol) when every output is floating point, unchanged;
    with integer outputs, those are compared by `compare_lsb` (`tolerance` = 1 with
    `tolerance_unit` "LSB") and any float outputs by `compare`, reported as float_*.
    `lsb_scales[i]`, when given, says float output i is a dequantised 8-bit tensor of that
    scale (a QDQ model's DequantizeLinear output): it is then compared in LSBs, as integers."""
    got, want = _in_lsb(got, want, lsb_scales)
    is_int = [np.asarray(b).dtype.kind in "iub" for b in want]
    if not any(is_int):
        return {**compare(got, want, rtol), "tolerance": rtol}
    res = compare_lsb([a for a, k in zip(got, is_int) if k], [b for b, k in zip(want, is_int) if k])
    res.update(tolerance=LSB_TOLERANCE, tolerance_unit="LSB")
    if not all(is_int):
        f = compare([a for a, k in zip(got, is_int) if not k], [b for b, k in zip(want, is_int) if not k], rtol)
        res.update(outputs_match=res["outputs_match"] and f["outputs_match"], float_max_abs_error=f["max_abs_error"],
                   float_max_rel_error=f["max_rel_error"], float_tolerance=rtol)
    return res


def bit_exact(got: list[np.ndarray], want: list[np.ndarray]) -> dict:
    """{"identical": every output equal bit for bit, "max_lsb": largest integer difference (0
    for float outputs that are bit-identical)}: tinydeploy's kernels against its exact reference."""
    identical, max_lsb = True, 0
    for a, b in zip(got, want):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return {"identical": False, "max_lsb": None}
        if a.dtype.kind == "f" or b.dtype.kind == "f":
            same = np.array_equal(a.astype(np.float32).view(np.uint32), b.astype(np.float32).view(np.uint32))
            identical = identical and bool(same)
            continue
        d = int(np.abs(a.astype(np.int64) - b.astype(np.int64)).max(initial=0))
        identical = identical and d == 0
        max_lsb = max(max_lsb, d)
    return {"identical": identical, "max_lsb": max_lsb}


# ---- onnxruntime's fast session, as information -------------------------------------------------

def fast_session_note(max_lsb: float, kinds: set[str], machine: str | None = None, vnni: bool | None = None) -> str:
    """Why onnxruntime's default session differs from the graph's meaning, where the cause is
    known. kinds: the 8-bit products of the model's Conv/MatMul layers ("u8s8", "s8s8", ...)."""
    import platform
    from tinydeploy.targets import has_vnni
    machine = machine or platform.machine()
    x86 = machine in ("x86_64", "AMD64", "i686")
    vnni = has_vnni() if vnni is None else vnni
    if max_lsb == 0:
        return "identical to the graph's meaning on these inputs"
    why = []
    if x86 and not vnni and any(k.startswith("u8") for k in kinds):
        why.append("this CPU has no VNNI (AVX512-VNNI or AVX-VNNI): onnxruntime's fast u8 x s8 Conv/MatMul "
                   "kernels add pairs of products in saturating 16-bit lanes (its documentation recommends "
                   "reduce_range)")
    if x86 and any(k.startswith("s8") for k in kinds):
        why.append("on x86 onnxruntime's optimised session runs int8-activation (S8S8) Conv/MatMul in float32 "
                   "(DequantizeLinear -> float32 -> QuantizeLinear) with its own summation order, which moves "
                   "values within ~1e-5 of k + 1/2 by 1 LSB")
    if not why:
        why.append("onnxruntime's fused 8-bit kernels round differently from the graph's DQ -> op -> Q meaning "
                   "(float32 values at k + 1/2)")
    return "; ".join(why) + ". Information only: the oracle is the graph's own meaning"


def product_kinds(g) -> set[str]:
    """The 8-bit products (activation x weight types) of a lowered graph's QConv/QDense layers."""
    tag = {np.dtype(np.uint8): "u8", np.dtype(np.int8): "s8", np.dtype(np.int16): "s16"}
    return {tag.get(np.dtype(g.t(n.inputs[0]).dtype), "?") + tag.get(np.dtype(g.t(n.inputs[1]).dtype), "?")
            for n in g.nodes if n.op in ("QConv", "QDense")}


def _pairs_leave_int16(products: np.ndarray) -> np.ndarray:
    """Over the last axis: adjacent products added in pairs; True where a pair leaves int16."""
    if products.shape[-1] % 2:
        products = np.concatenate([products, np.zeros(products.shape[:-1] + (1,), products.dtype)], axis=-1)
    pairs = products[..., 0::2] + products[..., 1::2]
    return (np.abs(pairs) > 32767).any(axis=-1)


def saturating_pairs(node, g, x: np.ndarray) -> np.ndarray | None:
    """Where onnxruntime's fast u8 x s8 kernels on x86 without VNNI (AVX2's VPMADDUBSW) clip, for
    a QConv / QDense node of the lowered graph `g` on its 8-bit input `x`: each output element's
    products of the raw u8 input and s8 weights, in the kernels' im2col order (the input
    channels innermost, after the kernel taps, padding read as the zero point; a dense layer's K
    as it is), are added in adjacent pairs into 16-bit lanes that saturate. True where a pair
    leaves [-32768, 32767] (their result then differs from the exact sum). None for other layers
    (depthwise convolutions run in int32 there, so are not modelled either)."""
    from tinydeploy.quant import exact
    if node.op not in ("QConv", "QDense"):
        return None
    w = g.t(node.inputs[1]).data
    if np.dtype(x.dtype) != np.uint8 or np.dtype(w.dtype) != np.int8:
        return None
    shape = g.t(node.outputs[0]).shape
    w = w.astype(np.int64)
    if node.op == "QDense":
        xr = x.reshape(-1, w.shape[1]).astype(np.int64)
        return np.stack([_pairs_leave_int16(xr * w[n]) for n in range(w.shape[0])], axis=-1).reshape(shape)
    grp, (m_out, cg) = int(node.attrs.get("group", 1)), w.shape[:2]
    if grp > 1 and cg == 1:
        return None
    cols = exact.patches(node, g, x, list(w.shape[2:]), node.attrs["_q"]["zx"])      # [n, taps, C, P]
    mg = m_out // grp
    masks = []
    for m in range(m_out):
        gi = m // mg
        colg = cols[:, :, gi * cg:(gi + 1) * cg, :]
        k = colg.shape[1] * cg
        a = colg.transpose(0, 3, 1, 2).reshape(colg.shape[0], colg.shape[3], k)     # [n, P, taps x C]
        wm = w[m].reshape(cg, -1).T.reshape(k)                                      # taps outer, C inner
        masks.append(_pairs_leave_int16(a * wm))
    return np.stack(masks, axis=1).reshape(shape)


# ---- layer by layer: which differences are rounding ties ---------------------------------------

def expose(model_bytes: bytes, tensors: dict[str, tuple[np.dtype, tuple]], cut=()) -> bytes:
    """The model with every tensor in `tensors` (name -> (dtype, shape)) made a graph output, and
    every one in `cut` also made a graph input: its producer's result is renamed `<name>__td_layer`
    (the output), and the nodes that read it read the fed value instead. With every layer's
    result cut, one session evaluates each layer on the inputs it is given (run_tensors)."""
    import onnx
    from onnx import helper
    m = onnx.load_model_from_string(model_bytes)
    cutset = set(cut)
    for node in m.graph.node:
        for k, o in enumerate(node.output):
            if o in cutset:
                node.output[k] = o + "__td_layer"
    kept = [o for o in m.graph.output if o.name not in cutset and o.name not in tensors]
    del m.graph.output[:]
    m.graph.output.extend(kept)
    for name, (dtype, shape) in tensors.items():
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        if name in cutset:
            m.graph.input.append(helper.make_tensor_value_info(name, elem, list(shape)))
        m.graph.output.append(helper.make_tensor_value_info(name + "__td_layer" * (name in cutset), elem, list(shape)))
    del m.graph.value_info[:]
    return m.SerializeToString()


def produced_tensors(model_bytes: bytes) -> set[str]:
    """The names of the tensors the model's nodes produce."""
    import onnx
    m = onnx.load_model_from_string(model_bytes)
    return {o for n in m.graph.node for o in n.output if o}


def run_tensors(model_bytes: bytes, feeds: dict, tensors: dict[str, tuple[np.dtype, tuple]], optimize: bool,
                fed: dict | None = None) -> dict[str, np.ndarray]:
    """The values of `tensors` (name -> (dtype, shape); tensors the model's nodes produce) in one
    onnxruntime session on `feeds`. With `fed` (name -> value), each of those tensors the model
    produces is replaced by the value given wherever it is read (expose's cut), and its own
    result is that of its layer evaluated on the fed inputs: layer by layer, nothing carried."""
    fed = {t: v for t, v in (fed or {}).items() if t in tensors}
    sess = _session(expose(model_bytes, tensors, fed), optimize)
    given = {**feeds, **fed}
    outs = dict(zip([o.name for o in sess.get_outputs()],
                    run_session(sess, {i.name: given[i.name] for i in sess.get_inputs()})))
    return {t: np.asarray(outs[t + "__td_layer" * (t in fed)]) for t in tensors}


def tie_mask(d: np.ndarray, rounding_entry) -> np.ndarray:
    """The differences `d` (integers, mine - theirs) that are rounding ties: one LSB, where the
    exact value (`rounding_entry` = exact.Exact's (real, margin)) lies within the float32 error
    bound of k + 1/2."""
    if rounding_entry is None:
        return np.zeros(d.shape, bool)
    real, margin = (np.broadcast_to(a, d.shape) for a in rounding_entry)
    dist = np.abs(real - np.floor(real) - 0.5)
    return (d != 0) & (np.abs(d) == 1) & (dist <= margin + 1e-12)


def layerwise(model_path, model_bytes: bytes, feeds: dict, input_shapes=None, graph=None) -> dict:
    """Every 8-bit tensor of the model, from tinydeploy's exact reference, against the oracle
    evaluating the same layer on the same inputs (so differences do not accumulate). A
    difference of one LSB where the exact value lies within float32 rounding of k + 1/2
    (exact.Exact: `real`, `margin`) is a rounding tie: the oracle's float32 sums and
    tinydeploy's arithmetic land on either side of it, and a deep network may carry the flip to
    its outputs. Any other difference is a disagreement: a fault on one side."""
    from tinydeploy.quant import exact
    oracle, _ = oracle_bytes(model_bytes)
    g = graph if graph is not None else exact.lowered_graph(model_path, input_shapes)
    rounding: dict = {}
    vals = exact.evaluate(g, feeds, keep=True, rounding=rounding)
    produced = produced_tensors(oracle)
    order = {o: k for k, n in enumerate(g.nodes) for o in n.outputs}
    qtypes = (np.dtype(np.int8), np.dtype(np.uint8))
    cut = [t for t in sorted(produced & set(vals), key=lambda t: order.get(t, -1))
           if t in g.tensors and not g.t(t).is_const and np.dtype(g.t(t).dtype) in qtypes and t not in g.inputs]
    if not cut:
        return {"layers": [], "ties": 0, "disagreements": 0}
    outs = run_tensors(oracle, feeds, {t: (g.t(t).dtype, g.t(t).shape) for t in cut}, optimize=False,
                       fed={t: vals[t] for t in cut})
    layers, ties, bad = [], 0, 0
    for t in cut:
        d = vals[t].astype(np.int64) - outs[t].astype(np.int64)
        differ = d != 0
        n_tie = int(tie_mask(d, rounding.get(t)).sum()) if differ.any() else 0
        n_bad = int(differ.sum()) - n_tie
        node = g.nodes[order[t]] if t in order else None
        layers.append({"tensor": t, "op": node.op if node else "", "node": node.name if node else "",
                       "elements": int(d.size), "differ": int(differ.sum()), "ties": n_tie,
                       "disagreements": n_bad, "max_lsb": int(np.abs(d).max(initial=0))})
        ties += n_tie
        bad += n_bad
    res = {"layers": layers, "ties": ties, "disagreements": bad}
    first_tie = next((x for x in layers if x["ties"]), None)
    first_bad = next((x for x in layers if x["disagreements"]), None)
    if first_tie:
        res["first_tie"] = first_tie["node"]
    if first_bad:
        res["first_disagreement"] = first_bad["node"]
    return res


def check_outputs(model_path, model_bytes: bytes, feeds: dict, got: list, rtol: float, lsb_scales=None,
                  input_shapes=None) -> dict:
    """The verdict on `got` (tinydeploy's outputs for `feeds`).

    FP32 models: compare_outputs against onnxruntime's default session. 8-bit models:
      * `exact_reference`: `got` against tinydeploy's exact reference, bit for bit;
      * the outputs against the oracle, in LSBs: they match when every element is within 1 LSB;
      * where they are further apart, `layerwise` holds every layer against the oracle on the
        same inputs: the outputs still match when the kernels equal the exact reference and every
        per-layer difference is a rounding tie (one LSB, the exact value within float32 rounding
        of k + 1/2), which a deep network carries to its outputs; it names the first such layer;
      * `onnxruntime_fast`: the default session, for information only."""
    oracle, q = oracle_bytes(model_bytes)
    want = run_onnxruntime(oracle, feeds, optimize=not q)
    res = compare_outputs(got, want, rtol, lsb_scales)
    if not q:
        return res
    from tinydeploy.quant import exact
    res["reference"] = ORACLE_8BIT
    g = exact.lowered_graph(model_path, input_shapes)
    ex = exact.run_model(model_path, feeds, graph=g)
    res["exact_reference"] = bit_exact(got, ex)
    if not res["outputs_match"] and res.get("max_abs_error", 0) != float("inf"):
        lw = layerwise(model_path, model_bytes, feeds, graph=g)
        res["layerwise"] = {k: v for k, v in lw.items() if k != "layers"}
        if lw["disagreements"] == 0 and lw["ties"] and res["exact_reference"]["identical"] \
                and res.get("float_max_rel_error", 0) <= rtol:
            res["outputs_match"] = True
            res["note"] = (f"the outputs are up to {res['max_abs_error']:g} LSB from the oracle, all of it carried "
                           f"from {lw['ties']} rounding tie(s): every layer, given the same inputs, agrees with the "
                           f"oracle except at values within float32 rounding of k + 1/2 (first at "
                           f"{printable(lw['first_tie'], 80)!r})")
    fast = run_onnxruntime(model_bytes, feeds, optimize=True)
    fc = compare_outputs(fast, want, rtol, lsb_scales)
    lsb = fc["max_abs_error"]
    res["onnxruntime_fast"] = {"max_lsb": lsb, "identical_fraction": fc.get("identical_fraction"),
                               "note": fast_session_note(lsb, product_kinds(g))}
    return res
