"""`tinydeploy quantize`: static 8-bit quantisation by onnxruntime's quantiser, fed by a
calibration reader over .npz/.npy files, followed by an accuracy report against the FP32 model.

onnxruntime does the quantisation and calibration (MinMax, Entropy, Percentile); this module
only reads calibration data safely, holds some of it out, and measures what quantisation cost.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.inputfiles import regular_size

METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}


def _input_specs(model_path: Path, max_weights_bytes=None) -> list[tuple[str, tuple, np.dtype]]:
    from tinydeploy.frontend.importer import import_model
    g, _ = import_model(model_path, max_weights_bytes=max_weights_bytes)
    return [(n, g.t(n).shape, np.dtype(g.t(n).dtype)) for n in g.inputs]


def load_calibration(data, specs) -> list[dict[str, np.ndarray]]:
    """Samples from a .npz (arrays named like the inputs), a .npy (single-input models) or a
    folder of them (sorted by name). An array may hold one sample (the input's shape) or many
    (a leading sample axis). Shapes and dtypes are checked against the model."""
    path = Path(data)
    if os.path.isdir(path):
        files = sorted(p for p in path.iterdir() if p.suffix in (".npz", ".npy"))
        if not files:
            raise TinydeployError(f"calibration folder {printable(str(path))!r} has no .npz or .npy files")
    else:
        files = [path]
    samples = []
    for f in files:
        regular_size(f, "calibration file")   # a FIFO or a device is refused, not waited on
        try:
            loaded = np.load(f, allow_pickle=False)
            arrays = dict(loaded.items()) if hasattr(loaded, "items") else None
        except Exception as e:
            raise TinydeployError(f"cannot read calibration file {printable(f.name)!r}: {printable(str(e), 100)}") from None
        if arrays is None:
            if len(specs) != 1:
                raise TinydeployError(f"{printable(f.name)}: a .npy file can only feed a single-input model; "
                                      "use an .npz with one array per input")
            arrays = {specs[0][0]: loaded}
        per_input = {}
        for name, shape, dtype in specs:
            if name not in arrays:
                raise TinydeployError(f"calibration file {printable(f.name)!r} has no array for input "
                                      f"{printable(name)!r} (expected {np.dtype(dtype).name} {'x'.join(map(str, shape))})")
            a = arrays[name]
            if a.dtype != dtype:
                raise TinydeployError(f"calibration input {printable(name)!r} in {printable(f.name)!r} is "
                                      f"{a.dtype.name}; expected {np.dtype(dtype).name} {'x'.join(map(str, shape))}")
            if tuple(a.shape) == tuple(shape):
                a = a[None]
            elif tuple(a.shape[1:]) != tuple(shape):
                raise TinydeployError(f"calibration input {printable(name)!r} in {printable(f.name)!r} has shape "
                                      f"{'x'.join(map(str, a.shape))}; expected {'x'.join(map(str, shape))} "
                                      f"or Nx{'x'.join(map(str, shape))}")
            per_input[name] = a
        counts = {len(a) for a in per_input.values()}
        if len(counts) != 1:
            raise TinydeployError(f"{printable(f.name)}: inputs hold different numbers of samples ({sorted(counts)})")
        for i in range(counts.pop()):
            samples.append({n: np.ascontiguousarray(a[i]) for n, a in per_input.items()})
    return samples


def _ort_session(path):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def accuracy_report(fp32: Path, quant: Path, samples: list[dict]) -> dict:
    """Quantised vs FP32 on held-out samples: top-1 agreement for classifier-shaped outputs
    ([1, classes] unlike any input's shape), max and mean absolute error of every output."""
    a, b = _ort_session(fp32), _ort_session(quant)
    agree, total, max_abs, sum_abs, count, scale = 0, 0, 0.0, 0.0, 0, 0.0
    classifier = None
    for s in samples:
        ya, yb = a.run(None, s), b.run(None, s)
        for u, v in zip(ya, yb):
            u, v = u.astype(np.float64), v.astype(np.float64)
            d = np.abs(u - v)
            max_abs, sum_abs, count = max(max_abs, float(d.max(initial=0))), sum_abs + float(d.sum()), count + d.size
            scale = max(scale, float(np.abs(u).max(initial=0)))
        if classifier is None:   # [1, classes], and not an autoencoder giving back its input's shape
            classifier = (ya[0].ndim == 2 and ya[0].shape[0] == 1 and ya[0].shape[1] > 1
                          and all(ya[0].shape != v.shape for v in s.values()))
        if classifier:
            agree += int(np.argmax(ya[0]) == np.argmax(yb[0]))
            total += 1
    out = {"samples": len(samples), "max_abs_error": max_abs, "mean_abs_error": sum_abs / max(count, 1),
           "fp32_output_scale": scale}
    if classifier:
        out["top1_agreement"] = agree / max(total, 1)
    return out


def quantize(model, calibration, output, activations: str = "uint8", weights: str = "int8",
             per_channel: bool = False, method: str = "minmax", fmt: str = "qdq", holdout: float = 0.2,
             quiet: bool = False, max_weights_bytes=None, reduce_range: bool = False) -> dict:
    """reduce_range: onnxruntime's 7-bit weights (int8 in [-64, 64]), which let x86 without VNNI
    multiply by vpmaddubsw exactly (schedule/q8.py ubs_exact)."""
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quant_pre_process, quantize_static)
    model, output = Path(model), Path(output)
    if output.exists() and not output.is_file():
        raise TinydeployError(f"output {printable(str(output))!r} exists and is not a file")
    specs = _input_specs(model, max_weights_bytes)
    for name, _, dt in specs:
        if dt != np.float32:
            raise TinydeployError(f"input {printable(name)!r} is {dt.name}: only FP32 models can be quantised")
    samples = load_calibration(calibration, specs)
    n_hold = int(len(samples) * holdout) if len(samples) >= 5 else 0
    calib, held = samples[:len(samples) - n_hold] or samples, samples[len(samples) - n_hold:] or samples
    log = (lambda m: None) if quiet else (lambda m: print(f"[tinydeploy] {m}", file=sys.stderr, flush=True))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calib)

        def get_next(self):
            return next(self.it, None)

    qtype = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}
    if activations not in qtype or weights not in qtype:
        raise TinydeployError("activations and weights must be uint8 or int8")
    log(f"calibrating on {len(calib)} samples ({method}), holding out {len(held) if n_hold else 0}")
    with tempfile.TemporaryDirectory(prefix="tinydeploy-q-") as tmp:
        pre = Path(tmp) / "pre.onnx"
        try:
            quant_pre_process(str(model), str(pre), skip_symbolic_shape=True)
        except Exception:
            pre = model   # pre-processing is an optimisation; quantise the model as it is
        try:
            quantize_static(str(pre), str(output), Reader(),
                            quant_format=QuantFormat.QDQ if fmt == "qdq" else QuantFormat.QOperator,
                            per_channel=per_channel, reduce_range=reduce_range, activation_type=qtype[activations], weight_type=qtype[weights],
                            calibrate_method=getattr(CalibrationMethod, METHODS[method]))
        except TinydeployError:
            raise
        except Exception as e:
            raise TinydeployError(f"onnxruntime's quantiser failed: {printable(str(e).splitlines()[0] if str(e) else type(e).__name__, 200)}") from None
    report = accuracy_report(model, output, held)
    report.update(model=model.name, output=str(output), format=fmt, activations=activations, weights=weights,
                  per_channel=per_channel, reduce_range=reduce_range, method=method, calibration_samples=len(calib),
                  held_out=bool(n_hold))
    return report


def print_report(r: dict) -> None:
    print(f"{printable(r['model'])} -> {printable(r['output'])}: {r['format']}, activations {r['activations']}, "
          f"weights {r['weights']}{' per channel' if r['per_channel'] else ''}"
          f"{' reduce-range (7-bit)' if r.get('reduce_range') else ''}, {r['method']} calibration "
          f"on {r['calibration_samples']} samples")
    where = "held-out" if r["held_out"] else "calibration (too few samples to hold any out)"
    line = f"accuracy vs FP32 on {r['samples']} {where} samples: max abs error {r['max_abs_error']:.4g}, " \
           f"mean abs error {r['mean_abs_error']:.4g} (FP32 outputs up to {r['fp32_output_scale']:.4g})"
    if "top1_agreement" in r:
        line += f", top-1 agreement {100 * r['top1_agreement']:.1f}%"
    print(line)
