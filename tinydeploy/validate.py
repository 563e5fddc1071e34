"""Which layer differs, by how much, and why: every layer output a capture build hands over
(runners.capture.Capture) held against the reference of the same tensor.

The mapping back to ONNX: a tinydeploy tensor keeps the ONNX name of the tensor it holds. A fused
layer writes the last fused node's output (a Conv+BatchNormalization+Relu is compared at the
Relu's output), an integer operator of an 8-bit island writes its QuantizeLinear's output, a view
(Reshape, a Transpose of size-1 dimensions) is its input's bytes, a copy made for a graph output
holds that output. A tensor stored in another layout than ONNX's (`layout` in the schedule) is
permuted back before it is compared.

References (`reference`):
  * "oracle" (the default): FP32 tensors against onnxruntime's default session; 8-bit tensors
    against the oracle (onnxruntime running the graph node by node, ORT_DISABLE_ALL) and, bit
    for bit, against tinydeploy's exact integer reference (quant/exact.py).
  * "onnxruntime": onnxruntime's default session for every tensor (for 8-bit models its fused
    kernels, which differ by CPU): to see where and why it departs. The verdict on the outputs
    stays the oracle's either way (reference.check_outputs, as `run`).

Each tensor is compared twice: end to end (the metrics of the table: errors carried from earlier
layers included) and layer by layer (the reference evaluating the same layer on the inputs the
target gave it, so nothing is carried). The second says why a tensor differs:
  kernel     the target differs from the exact reference on its own inputs (8-bit): a fault in
             this layer's code or its build;
  differs    given the same inputs, the layer differs from the reference beyond its rounding;
  saturation the reference saturates: its u8 x s8 products, added in pairs, leave int16 there
             (onnxruntime's fast kernels on x86 without VNNI; reference.saturating_pairs);
  tie        rounding ties only: one LSB where the exact value lies within float32 rounding of
             k + 1/2 (exact.Exact: real, margin), which either side may round either way;
  inherited  the layer agrees with the reference on its inputs, and an input is already off.
The first layer whose end-to-end error exceeds the tolerance (8-bit: 1 LSB; float: a norm-wise
relative error of 1e-4) is the first divergent layer."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tinydeploy import reference
from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError

QTYPES = ("int8", "uint8")
REFERENCES = ("oracle", "onnxruntime")


def _inverse(perm: list[int]) -> list[int]:
    return [perm.index(k) for k in range(len(perm))]


def logical(a: np.ndarray, out: dict) -> np.ndarray:
    """A captured tensor (flat, as stored) as the ONNX tensor: its shape, and its layout when it
    was stored permuted (`layout`: the permutation from ONNX's dimensions to the stored ones)."""
    shape, perm = tuple(out["shape"]), out.get("layout")
    if a.dtype != np.dtype(out["dtype"]) or a.size != int(np.prod(shape, dtype=np.int64)):
        raise TinydeployError(f"captured tensor {printable(out['name'], 60)!r} is {a.dtype.name} x {a.size}, "
                              f"the schedule says {out['dtype']} {'x'.join(map(str, shape))}")
    if perm:
        return a.reshape([shape[p] for p in perm]).transpose(_inverse(perm))
    return a.reshape(shape)


def target_tensors(schedule: dict, tensors: dict, feeds: dict) -> dict[str, np.ndarray]:
    """Every runtime tensor the capture shows, by tinydeploy name, as ONNX holds it: the graph
    inputs (as fed), each layer's captured outputs, and views (the same bytes as their input)."""
    vals = {n: np.asarray(feeds[n]) for n in schedule["inputs"] if n in feeds}
    for st in schedule["steps"]:
        for i, o in enumerate(st["outputs"]):
            if st["code"]:
                if (st["step"], i) in tensors:
                    vals[o["name"]] = logical(tensors[(st["step"], i)], o)
            elif st["inputs"] and st["inputs"][0] in vals and vals[st["inputs"][0]].size == np.prod(o["shape"]):
                vals[o["name"]] = vals[st["inputs"][0]].reshape(o["shape"])
    return vals


def onnx_names(schedule: dict, produced: set[str]) -> dict[str, str]:
    """tinydeploy tensor name -> the ONNX tensor it holds, for those the model's nodes produce:
    the same name, or for a copy made for a graph output (passes/outputs.py), the output's."""
    out = {}
    for st in schedule["steps"]:
        for o in st["outputs"]:
            if o["name"] in produced:
                out[o["name"]] = o["name"]
            elif st["op"] == "Copy" and st["inputs"] and st["inputs"][0] in produced:
                out[o["name"]] = st["inputs"][0]
    return out


# ---- metrics ---------------------------------------------------------------------------------

@dataclass
class Stats:
    """Sums over one tensor (or the same tensor over a data set), from which the metrics follow."""
    n: int = 0
    same: int = 0
    sum_d2: float = 0.0
    sum_r2: float = 0.0
    sum_g2: float = 0.0
    dot: float = 0.0
    sum_abs: float = 0.0
    max_abs: float = 0.0
    max_ref: float = 0.0
    max_lsb: int | None = None
    nan: bool = False

    def add(self, got: np.ndarray, want: np.ndarray, q: tuple | None) -> "Stats":
        """q = (scale, zero point) for 8-bit tensors: errors in LSB and in real units."""
        got, want = np.asarray(got), np.asarray(want)
        if q is not None:
            gi, wi = got.astype(np.int64), want.astype(np.int64)
            lsb = int(np.abs(gi - wi).max(initial=0))
            self.max_lsb = lsb if self.max_lsb is None else max(self.max_lsb, lsb)
            scale, zp = q
            g64, w64 = (gi - (zp or 0)) * (scale or 1.0), (wi - (zp or 0)) * (scale or 1.0)
            self.same += int((gi == wi).sum())
        else:
            g64, w64 = got.astype(np.float64), want.astype(np.float64)
            both_nan = np.isnan(g64) & np.isnan(w64)
            self.same += int(((g64 == w64) | both_nan).sum())
            self.nan |= bool((np.isnan(g64) ^ np.isnan(w64)).any())
            g64, w64 = np.where(both_nan, 0.0, g64), np.where(both_nan, 0.0, w64)
        d = g64 - w64
        with np.errstate(invalid="ignore", over="ignore"):
            self.n += d.size
            self.sum_d2 += float(np.sum(d * d))
            self.sum_r2 += float(np.sum(w64 * w64))
            self.sum_g2 += float(np.sum(g64 * g64))
            self.dot += float(np.sum(g64 * w64))
            self.sum_abs += float(np.sum(np.abs(d)))
            self.max_abs = max(self.max_abs, float(np.abs(d).max(initial=0.0)))
            self.max_ref = max(self.max_ref, float(np.abs(w64).max(initial=0.0)))
        return self

    def metrics(self) -> dict:
        """max_abs_error (real units), max_lsb (8-bit, else None), identical_fraction, cosine,
        rel_l2 (||d|| / ||ref||), snr_db (None when there is no error), mae, rmse, max_rel_error
        (norm-wise max|d| / max|ref|). NaN where a side is NaN and the other is not."""
        bad = self.nan or not math.isfinite(self.sum_d2)
        nan = float("nan")
        rl2 = math.sqrt(self.sum_d2 / self.sum_r2) if self.sum_r2 > 0 else (0.0 if self.sum_d2 == 0 else None)
        cos = (self.dot / math.sqrt(self.sum_g2 * self.sum_r2) if self.sum_g2 > 0 and self.sum_r2 > 0
               else (1.0 if self.sum_g2 == 0 and self.sum_r2 == 0 else 0.0))
        snr = None if self.sum_d2 == 0 or self.sum_r2 == 0 else 10.0 * math.log10(self.sum_r2 / self.sum_d2)
        rel = self.max_abs / self.max_ref if self.max_ref > 0 else (0.0 if self.max_abs == 0 else None)
        m = {"max_abs_error": self.max_abs, "max_lsb": self.max_lsb,
             "identical_fraction": self.same / self.n if self.n else 1.0, "cosine": cos, "rel_l2": rl2,
             "snr_db": snr, "mae": self.sum_abs / self.n if self.n else 0.0,
             "rmse": math.sqrt(self.sum_d2 / self.n) if self.n else 0.0, "max_rel_error": rel}
        if bad:
            m.update(max_abs_error=nan, cosine=nan, rel_l2=nan, max_rel_error=nan, mae=nan, rmse=nan)
        return m


def within(m: dict, rtol: float) -> bool:
    """An 8-bit tensor within reference.LSB_TOLERANCE LSB; a float one within rtol, norm-wise."""
    if m["max_lsb"] is not None:
        return m["max_lsb"] <= reference.LSB_TOLERANCE
    rel = m["max_rel_error"]
    return rel is not None and not math.isnan(rel) and rel <= rtol


# ---- one inference -----------------------------------------------------------------------------

@dataclass
class References:
    """The reference values of one input: end to end, layer by layer (on the target's own
    inputs), and for 8-bit models the exact reference's (end to end, on the target's inputs, and
    the rounding facts there)."""
    e2e: dict
    local: dict
    exact: dict = field(default_factory=dict)
    exact_local: dict = field(default_factory=dict)
    rounding: dict = field(default_factory=dict)
    graph: object = None          # the exact reference's graph (8-bit models)


def references(model_path, model_bytes: bytes, schedule: dict, feeds: dict, mine: dict, names: dict,
               which: str = "oracle", input_shapes=None, graph=None) -> References:
    """`mine`: target_tensors; `names`: onnx_names."""
    if which not in REFERENCES:
        raise TinydeployError(f"--reference must be one of {', '.join(REFERENCES)}, not {printable(which, 30)!r}")
    oracle, q = reference.oracle_bytes(model_bytes)
    ref_bytes, optimize = (oracle, not q) if which == "oracle" else (model_bytes, True)
    produced = reference.produced_tensors(ref_bytes)
    by_onnx = {}
    for t, o in names.items():
        if o in produced and t in mine:
            by_onnx.setdefault(o, mine[t])
    spec = {o: (v.dtype, v.shape) for o, v in by_onnx.items()}
    e2e = reference.run_tensors(ref_bytes, feeds, spec, optimize) if spec else {}
    local = reference.run_tensors(ref_bytes, feeds, spec, optimize, fed=by_onnx) if spec else {}
    refs = References(e2e, local)
    if q:
        from tinydeploy.quant import exact
        g = graph if graph is not None else exact.lowered_graph(model_path, input_shapes)
        refs.graph = g
        refs.exact = exact.evaluate(g, feeds, keep=True)
        refs.exact_local = {}
        over = {t: v for t, v in mine.items() if t in g.tensors and not g.t(t).is_const and t not in g.inputs}
        exact.evaluate(g, feeds, keep=True, rounding=refs.rounding, override=over, local=refs.exact_local)
    return refs


def _qparams(out: dict) -> tuple | None:
    return (out["scale"], out["zero_point"]) if out["dtype"] in QTYPES else None


def _local(t: str, onnx_name: str | None, got: np.ndarray, refs: References, which: str, mine: dict,
           rtol: float) -> dict:
    """The layer on the target's own inputs: its difference from the reference there, split into
    rounding ties and disagreements (8-bit), whether the target's kernel equals the exact
    reference there, and whether the reference saturates where they disagree."""
    out = {}
    q = got.dtype.name in QTYPES
    if onnx_name is not None and onnx_name in refs.local:
        want = refs.local[onnx_name]
        if q:
            d = got.astype(np.int64) - want.astype(np.int64)
            ties = reference.tie_mask(d, refs.rounding.get(t))
            differ = d != 0
            out.update(max_lsb=int(np.abs(d).max(initial=0)), ties=int(ties.sum()),
                       disagreements=int((differ & ~ties).sum()))
            bad = differ & ~ties
            if bad.any() and which == "onnxruntime" and refs.graph is not None:
                node = refs.graph.producer(t)
                x = mine.get(node.inputs[0]) if node is not None and node.inputs else None
                mask = reference.saturating_pairs(node, refs.graph, x) if x is not None else None
                if mask is not None:
                    out["saturating"] = int((bad & mask).sum())
        else:
            m = Stats().add(got, want, None).metrics()
            out.update(max_rel_error=m["max_rel_error"], disagreements=0 if within(m, rtol) else int(
                (got != want).sum()), ties=0)
    if q and t in refs.exact_local:
        out["kernel_max_lsb"] = int(np.abs(got.astype(np.int64) - refs.exact_local[t].astype(np.int64)).max(initial=0))
    return out


def _cause(local: dict, inputs_off: list) -> tuple[str | None, str | None]:
    """(cause, why) of a tensor's difference from its reference (module docstring)."""
    if local.get("kernel_max_lsb"):
        return "kernel", (f"the target's kernel differs from tinydeploy's exact reference by {local['kernel_max_lsb']} "
                          "LSB on the same inputs: a fault in this layer's code or its build")
    if local.get("disagreements"):
        n, sat = local["disagreements"], local.get("saturating", 0)
        if sat and sat == n:
            return "saturation", (f"saturation in the reference: at all {n} differing elements its u8 x s8 products, "
                                  "added in pairs, leave int16 (onnxruntime's fast kernels on x86 without VNNI add "
                                  "them in saturating 16-bit lanes); tinydeploy's sums are exact")
        if "max_lsb" in local:
            return "differs", (f"given the same inputs the reference computes {n} element(s) differently, up to "
                               f"{local['max_lsb']} LSB, beyond rounding ties"
                               + (f" ({sat} where its u8 x s8 pairs saturate)" if sat else ""))
        return "differs", (f"given the same inputs the layer differs from the reference by a relative "
                           f"{local.get('max_rel_error', float('nan')):.3g}")
    off = [x for x in inputs_off if x[1]]
    if off:
        name, amount, unit, origin = max(off, key=lambda x: x[1])
        start = f" (it starts at step {origin[0]}: {origin[1]})" if origin else ""
        return "inherited", (f"an input is already off by {amount:g} {unit} ({printable(name, 60)!r}){start}; given the "
                             "same inputs the layer agrees with the reference"
                             + (f" but for {local['ties']} rounding tie(s)" if local.get("ties") else ""))
    if local.get("ties"):
        return "tie", (f"{local['ties']} rounding tie(s): the exact value lies within float32 rounding of k + 1/2, "
                       "and either side may round it either way")
    return None, None


def analyse(schedule: dict, cap_tensors: dict, feeds: dict, refs: References, names: dict, which: str,
            rtol: float, stats: dict | None = None) -> list[dict]:
    """The rows of the per-layer table for one inference (and, with `stats`, each tensor's sums
    added to stats[(step, index)] for a data set)."""
    mine = target_tensors(schedule, cap_tensors, feeds)
    rows, err, origin = [], {}, {}
    for n in schedule["inputs"]:
        err[n] = (0, "LSB")
    for st in schedule["steps"]:
        if not st["code"]:
            for o in st["outputs"]:       # a view: its input's error and origin
                src = st["inputs"][0] if st["inputs"] else None
                if src in err:
                    err[o["name"]], origin[o["name"]] = err[src], origin.get(src)
            continue
        for i, o in enumerate(st["outputs"]):
            t = o["name"]
            got = mine.get(t)
            oname = names.get(t)
            row = {"step": st["step"], "index": i, "op": st["onnx_op"], "kernel_op": st["op"], "node": st["name"],
                   "name": oname, "tensor": t, "shape": o["shape"], "dtype": o["dtype"]}
            if got is None:
                row.update(captured=False, within_tolerance=None)
                rows.append(row)
                continue
            q = _qparams(o)
            want = refs.e2e.get(oname) if oname else None
            if want is None and q is not None and t in refs.exact:
                want = refs.exact[t]                 # no ONNX counterpart: the exact reference's
                row["compared_with"] = "exact reference"
            if want is None:
                row.update(captured=True, within_tolerance=None, note="no ONNX tensor to compare with")
                rows.append(row)
                continue
            s = Stats().add(got, want, q)
            if stats is not None:
                stats.setdefault((st["step"], i), Stats()).add(got, want, q)
            m = s.metrics()
            row.update(m)
            row["captured"] = True
            if q is not None and t in refs.exact:
                row["exact_max_lsb"] = int(np.abs(got.astype(np.int64) - refs.exact[t].astype(np.int64)).max(initial=0))
            local = _local(t, oname, got, refs, which, mine, rtol)
            row["local"] = local
            row["within_tolerance"] = within(m, rtol)
            off = [(i_, *err[i_], origin.get(i_)) for i_ in st["inputs"] if i_ in err]
            # why it differs: any 8-bit difference (ties included); float ones beyond the tolerance
            differs = bool(m["max_lsb"] or local.get("kernel_max_lsb")) if q is not None else not row["within_tolerance"]
            cause, why = _cause(local, off) if differs else (None, None)
            row["cause"], row["why"] = cause, why
            amount = m["max_lsb"] if q is not None else (m["max_rel_error"] or 0.0)
            err[t] = (amount, "LSB" if q is not None else "relative")
            if cause in ("kernel", "differs", "saturation", "tie"):
                origin[t] = (st["step"], cause)
            elif cause == "inherited":
                origin[t] = next((origin.get(x[0]) for x in off if x[1] and origin.get(x[0])), None)
            if origin.get(t):
                row["origin"] = {"step": origin[t][0], "cause": origin[t][1]}
            rows.append(row)
    return rows


def first_divergent(rows: list[dict]) -> dict | None:
    """The first row beyond the tolerance: {step, op, name, tensor, cause, why}."""
    for r in rows:
        if r.get("within_tolerance") is False:
            return {k: r.get(k) for k in ("step", "op", "name", "tensor", "node", "cause", "why", "origin",
                                          "max_abs_error", "max_lsb")}
    return None


def aggregate(rows: list[dict], stats: dict, rtol: float) -> list[dict]:
    """Data-set rows: one sample's rows (the first that diverges, else the first) with their
    metrics and verdict those of the sums over every sample; the causes are that sample's."""
    out = []
    for r in rows:
        r = dict(r)
        s = stats.get((r["step"], r["index"]))
        if s is not None:
            r.update(s.metrics())
            r["within_tolerance"] = within(r, rtol)
        out.append(r)
    return out


def top1(a: np.ndarray) -> int | None:
    """The class of a classifier's first output (its largest element); None for a single value."""
    a = np.asarray(a).reshape(-1)
    return int(np.argmax(a)) if a.size > 1 else None


class Tally:
    """A data set's figures on the model's first output, X-CUBE-AI's validate figures: L2r, MAE,
    RMSE and cosine of the deployed model against the reference over every sample, top-1
    agreement between them, and with labels the top-1 accuracy of each."""

    def __init__(self):
        self.stats, self.n, self.divergent = Stats(), 0, 0
        self.agree = self.labelled = self.correct = self.ref_correct = 0

    def add(self, got: np.ndarray, want: np.ndarray, label: int | None, divergent: bool = False) -> None:
        self.stats.add(got, want, (1.0, 0) if np.asarray(got).dtype.kind in "iu" else None)
        mine, theirs = top1(got), top1(want)
        self.n += 1
        self.divergent += bool(divergent)
        self.agree += mine is not None and mine == theirs
        if label is not None and mine is not None:
            self.labelled += 1
            self.correct += mine == label
            self.ref_correct += theirs == label

    def figures(self) -> dict:
        m = self.stats.metrics()
        return {"samples": self.n, "divergent": self.divergent, "l2r": m["rel_l2"], "mae": m["mae"],
                "rmse": m["rmse"], "cosine": m["cosine"], "top1_agreement": self.agree / self.n if self.n else None,
                "accuracy": ({"target": self.correct / self.labelled, "reference": self.ref_correct / self.labelled,
                              "labelled": self.labelled} if self.labelled else None)}
