"""What the firmware harness does for a model's MLPerf Tiny profile (firmware_templates/mcu/profiles.json),
and the same arithmetic in numpy, so the host can say what the board will print.

The profiles are data: the open MLCommons runner (mlcommons/tiny, benchmark/runner) expects
dequantised `%0.3f` results, uint8 images with 128 subtracted on the device (IC, VWW), float32 AD
windows quantised on the device with one result, the MSE, and 921600 baud for AD. The harness
(firmware_templates/mcu/harness.c) reads the switches from harness_config.h, which
`harness_settings` fills; `printed_results` computes the line the board prints, float32 step by
float32 step, as the C does it."""
from __future__ import annotations

import json
import re
from functools import lru_cache

import numpy as np

from tinydeploy.codegen import kernels as kreg
from tinydeploy.errors import TinydeployError

PROFILES_JSON = kreg.TEMPLATES / "mcu" / "profiles.json"
RESULTS = {"dequantised", "mse"}
DB_INPUTS = {"int8", "float32"}


@lru_cache(maxsize=1)
def _profiles() -> dict:
    return json.loads(PROFILES_JSON.read_text())


def model_id(model_name: str) -> str:
    """The MLPerf Tiny model id the runner expects (kws01, ...), from the file name."""
    stem = re.split(r"[_.-]", model_name.lower())[0]
    return _profiles()["file_prefixes"].get(stem, re.sub(r"[^a-z0-9_]", "", stem)[:16] or "model")


def profile(model_name: str) -> dict:
    """The profile's switches, defaults filled in (profiles.json)."""
    p = dict(_profiles()["defaults"])
    p.update(_profiles()["profiles"].get(model_id(model_name), {}))
    if p["results"] not in RESULTS or p["db_input"] not in DB_INPUTS:
        raise TinydeployError(f"{PROFILES_JSON}: profile {model_id(model_name)!r}: results must be one of "
                              f"{sorted(RESULTS)}, db_input one of {sorted(DB_INPUTS)}")
    return p


def _per_tensor(t) -> tuple[float, int] | None:
    q = t.quant
    if q is None or np.asarray(q.scale).size != 1 or np.asarray(q.zero_point).size != 1:
        return None
    return float(np.float32(np.asarray(q.scale).reshape(-1)[0])), int(np.asarray(q.zero_point).reshape(-1)[0])


_RANGE = {np.dtype(np.int8): (-128, 127), np.dtype(np.uint8): (0, 255)}


def harness_settings(c, board, machine=None) -> dict:
    """The values harness_config.h holds for compiled model `c` on `board` (built to run on
    `machine`, itself or its QEMU stand-in): profile switches, per-output dequantisation, the
    input's quantisation for float32 loads, the serial rate and the clock of the timestamps."""
    machine = machine or board
    g = c.graph
    p = profile(c.model)
    outs = []
    for name in g.outputs:
        t = g.t(name)
        dq = _per_tensor(t) if np.dtype(t.dtype) in _RANGE else None
        outs.append({"dtype": np.dtype(t.dtype).name, "scale": dq[0] if dq else None, "zero_point": dq[1] if dq else 0,
                     "elements": t.size})
    s = {"model_id": model_id(c.model), "profile": p, "outputs": outs,
         "db_subtract_128": bool(p["db_subtract_128"]) and c.inputs_int8,
         "db_float32": p["db_input"] == "float32", "results": p["results"],
         "baud": int(p.get("baud") or board.serial_baud),
         # QEMU -icount shift=0 runs one instruction per virtual ns; the timestamps the runner
         # reads (m-lap-us-N) count microseconds of the emulated board's own clock instead
         "us_clock_hz": int(board.clock_hz or machine.clock_hz or 25_000_000),
         "input": None}
    if s["db_float32"] or s["results"] == "mse":
        what = f"profile {s['model_id']} ({PROFILES_JSON.name})"
        if len(g.inputs) != 1 or np.dtype(g.t(g.inputs[0]).dtype) not in _RANGE or _per_tensor(g.t(g.inputs[0])) is None:
            raise TinydeployError(f"{what} loads float32 windows, but the model does not have one 8-bit input "
                                  "with a per-tensor scale and zero point to quantise them with")
        t = g.t(g.inputs[0])
        scale, zp = _per_tensor(t)
        lo, hi = _RANGE[np.dtype(t.dtype)]
        s["input"] = {"scale": scale, "zero_point": zp, "lo": lo, "hi": hi, "elements": t.size}
    if s["results"] == "mse" and (outs[0]["scale"] is None or outs[0]["elements"] != s["input"]["elements"]):
        raise TinydeployError(f"profile {s['model_id']}: results mse needs output 0 to be 8-bit with a per-tensor "
                              "scale and as many elements as the input")
    return s


def image_settings(c, board, machine=None) -> dict:
    """harness_settings for what a firmware holds: one compiled model (pipeline.Compiled), or the
    library form's image of one or more (pipeline.Image). An image of several models selects one
    at run time, so the switches that are macros cannot follow a profile per model: results print
    as stored (no dequantisation), db loads take bytes; only the uint8-image switch is kept per
    model, as a bit mask over the selected model (`db_subtract_mask`)."""
    models = getattr(c, "models", None)
    if models is None:
        return harness_settings(c, board, machine)
    if len(models) == 1:
        return harness_settings(models[0], board, machine)
    per = [harness_settings(m, board, machine) for m in models]
    mask = sum(1 << k for k, h in enumerate(per) if h["db_subtract_128"])
    return dict(per[0], model_id="+".join(h["model_id"] for h in per), dequantise=False, outputs=[],
                db_subtract_128=bool(mask), db_subtract_mask=mask, db_float32=False, results="dequantised",
                input=None, baud=int(board.serial_baud))


# ---- the harness's arithmetic, in numpy ---------------------------------------------------------

def quantise(x, scale: float, zero_point: int, lo: int, hi: int) -> np.ndarray:
    """QuantizeLinear as docs/quantization.md defines it: clamp(rne(f32(x / s)) + zp, lo, hi);
    NaN gives zp. What the harness does to a float32 db load."""
    x = np.asarray(x, np.float32)
    v = np.rint(x / np.float32(scale))
    v = np.where(np.isnan(v), 0, v)
    return np.clip(np.clip(v, -1e9, 1e9).astype(np.int64) + zero_point, lo, hi)


def dequantise(q, scale: float, zero_point: int) -> np.ndarray:
    """DequantizeLinear: f32(f32(q - zp) * s)."""
    return (np.asarray(q, np.int64) - zero_point).astype(np.float32) * np.float32(scale)


def format_f32(v) -> str:
    """The harness's put_f32 (printf("%0.3f") without printf), float32 operation by operation."""
    v = np.float32(v)
    if v != v:
        return "nan"
    sign = ""
    if v < 0:
        sign, v = "-", np.float32(-v)
    if v > np.float32(3.4028235e38):
        return sign + "inf"
    if v >= np.float32(4.0e9):
        e = 0
        while v >= np.float32(10.0):
            v = np.float32(v / np.float32(10.0))
            e += 1
        frac = int(np.float32(v * np.float32(1000.0) + np.float32(0.5)))
        if frac >= 10000:
            frac //= 10
            e += 1
        return f"{sign}{frac // 1000}.{frac // 100 % 10}{frac // 10 % 10}{frac % 10}e+{e}"
    ip = int(v)
    frac = int(np.float32(np.float32(v - np.float32(ip)) * np.float32(1000.0) + np.float32(0.5)))
    if frac >= 1000:
        ip, frac = ip + 1, frac - 1000
    return f"{sign}{ip}.{frac:03d}"


def result_values(settings: dict, outputs, float_input=None) -> list[np.float32]:
    """The float32 values the harness prints in m-results-[...] for these raw outputs. With
    results mse, `float_input` is the float32 window that was loaded (None: the dequantised
    8-bit input, which is what a binary load gives the harness)."""
    if settings["results"] == "mse":
        o = settings["outputs"][0]
        y = dequantise(np.asarray(outputs[0]).reshape(-1), o["scale"], o["zero_point"])
        x = np.asarray(float_input, np.float32).reshape(-1)
        acc = np.float32(0.0)
        for d in (y - x).astype(np.float32):          # float32, index order, as the C loop
            acc = np.float32(acc + np.float32(d * d))
        return [np.float32(acc / np.float32(len(y)))]
    vals = []
    for o, arr in zip(settings["outputs"], outputs):
        a = np.asarray(arr).reshape(-1)
        if o["scale"] is not None:
            vals += list(dequantise(a, o["scale"], o["zero_point"]))
        elif o["dtype"] == "float32":
            vals += list(a.astype(np.float32))
        else:
            vals += [np.float32(v) for v in a]        # integers without a scale: printed as they are
    return vals


def printed_results(settings: dict, outputs, float_input=None) -> str:
    """The m-results-[...] line the board prints after an inference with these outputs."""
    vals = result_values(settings, outputs, float_input)
    raw = settings["results"] != "mse"
    parts = []
    for o, arr in (zip(settings["outputs"], outputs) if raw else []):
        a = np.asarray(arr).reshape(-1)
        if o["scale"] is None and o["dtype"] != "float32":
            parts += [str(int(v)) for v in a]
        else:
            parts += [format_f32(v) for v in vals[len(parts):len(parts) + a.size]]
    if not raw:
        parts = [format_f32(vals[0])]
    return "m-results-[" + ",".join(parts) + "]"
