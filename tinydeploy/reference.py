"""onnxruntime as the reference, and comparing results with it."""
from __future__ import annotations

import numpy as np



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


def run_onnxruntime(model_bytes: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    try:
        sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    except Exception as e:
        if "IR version" not in str(e):
            raise
        # A newer onnx package stamps IR versions this onnxruntime does not know yet; the graph
        # itself is unaffected, so retry with the newest IR version onnxruntime accepts.
        import onnx
        m = onnx.load_model_from_string(model_bytes)
        m.ir_version = 10
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def compare(got: list[np.ndarray], want: list[np.ndarray], rtol: float) -> dict:
    """Errors of `got` against `want`. max_rel_error is norm-wise per output,
    max|got - want| / max|want|, so elements near zero do not dominate it."""
    max_abs, max_rel = 0.0, 0.0
    for a, b in zip(got, want):
        a64, b64 = a.astype(np.float64), np.asarray(b).astype(np.float64)
        if a64.shape != b64.shape:
            return {"outputs_match": False, "max_abs_error": float("inf"), "max_rel_error": float("inf")}
        if a64.size == 0:
            continue
        both_nan = np.isnan(a64) & np.isnan(b64)
        diff = np.where(both_nan, 0.0, np.abs(a64 - b64))
        if np.isnan(diff).any():
            return {"outputs_match": False, "max_abs_error": float("nan"), "max_rel_error": float("nan")}
        finite = np.isfinite(b64)
        same_inf = (~finite) & (a64 == b64)
        diff = np.where(same_inf, 0.0, diff)
        scale = np.max(np.abs(np.where(finite, b64, 0.0)), initial=0.0)
        e = float(diff.max(initial=0.0))
        max_abs = max(max_abs, e)
        max_rel = max(max_rel, e / scale if scale > 0 else (0.0 if e == 0 else float("inf")))
    return {"outputs_match": bool(max_rel <= rtol), "max_abs_error": max_abs, "max_rel_error": max_rel}


# ---- 8-bit outputs: compared in LSBs ----------------------------------------------------------

LSB_TOLERANCE = 1               # every element within 1 LSB of onnxruntime ...
MIN_IDENTICAL_FRACTION = 0.99   # ... and at least 99% of them identical


def compare_lsb(got: list[np.ndarray], want: list[np.ndarray]) -> dict:
    """Integer outputs against onnxruntime, in LSBs (units of the quantised value): outputs match
    when every |got - want| <= LSB_TOLERANCE and >= MIN_IDENTICAL_FRACTION of all elements are
    identical. max_rel_error is the norm-wise max|diff| / max|want|, for information."""
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
    return {"outputs_match": bool(max_abs <= LSB_TOLERANCE and frac >= MIN_IDENTICAL_FRACTION),
            "max_abs_error": float(max_abs), "max_rel_error": max_rel, "identical_fraction": frac}


def compare_outputs(got: list[np.ndarray], want: list[np.ndarray], rtol: float, lsb_scales=None) -> dict:
    """`compare` (relative, `tolerance` = rtol) when every output is floating point, unchanged;
    with integer outputs, those are compared by `compare_lsb` (`tolerance` = 1 with
    `tolerance_unit` "LSB") and any float outputs by `compare`, reported as float_*.
    `lsb_scales[i]`, when given, says float output i is a dequantised 8-bit tensor of that
    scale (a QDQ model's DequantizeLinear output): it is then compared in LSBs, as integers."""
    got, want = list(got), list(want)
    for i, s in enumerate(lsb_scales or []):
        if s and i < len(want) and np.asarray(want[i]).dtype.kind == "f" and np.shape(got[i]) == np.shape(want[i]):
            with np.errstate(invalid="ignore", over="ignore"):
                got[i] = np.rint(np.asarray(got[i], np.float64) / s).astype(np.int64)
                want[i] = np.rint(np.asarray(want[i], np.float64) / s).astype(np.int64)
    is_int = [np.asarray(b).dtype.kind in "iub" for b in want]
    if not any(is_int):
        return {**compare(got, want, rtol), "tolerance": rtol}
    res = compare_lsb([a for a, k in zip(got, is_int) if k], [b for b, k in zip(want, is_int) if k])
    res.update(tolerance=LSB_TOLERANCE, tolerance_unit="LSB", min_identical_fraction=MIN_IDENTICAL_FRACTION)
    if not all(is_int):
        f = compare([a for a, k in zip(got, is_int) if not k], [b for b, k in zip(want, is_int) if not k], rtol)
        res.update(outputs_match=res["outputs_match"] and f["outputs_match"], float_max_abs_error=f["max_abs_error"],
                   float_max_rel_error=f["max_rel_error"], float_tolerance=rtol)
    return res
