"""LiteRT (TensorFlow Lite; its default XNNPACK CPU delegate), timed here in-process on a model's
.tflite twin: a peer of `tinydeploy bench` next to onnxruntime, on the same inputs, in the same
run. The package is an optional extra (`pip install 'tinydeploy[litert]'`: ai-edge-litert); a
twin is the same network as a TensorFlow Lite flatbuffer, given with --tflite or found beside the
ONNX file (`M.tflite`, or `tflite/M.tflite` as in the MLPerf Tiny folder)."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.runners.harness import runs_within

MISSING = ("LiteRT is not installed (the optional extra: pip install 'tinydeploy[litert]', which installs "
           "ai-edge-litert)")


def find_twin(model: Path, given: Path | None = None) -> Path | None:
    """The .tflite twin of `model`: `given` (a file, or a folder holding <model name>.tflite),
    else M.tflite or tflite/M.tflite beside the model; None when there is none."""
    model = Path(model)
    name = model.stem + ".tflite"
    if given is not None:
        given = Path(given)
        twin = given / name if given.is_dir() else given
        if not twin.is_file():
            raise TinydeployError(f"--tflite: {printable(str(twin))} does not exist or is not a file")
        return twin
    for twin in (model.with_suffix(".tflite"), model.parent / "tflite" / name):
        if twin.is_file():
            return twin
    return None


def interpreter_class():
    """LiteRT's Interpreter, or a clear error when the package is missing."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        raise TinydeployError(MISSING) from None
    return Interpreter


def median_ms(twin: Path, feeds: dict, budget_s: float, threads: int = 1) -> tuple[float, int]:
    """Median latency (ms) of LiteRT's invoke() on `twin` with the ONNX model's inputs `feeds`
    ({name: array}), over as many runs as fit in about budget_s, and their number."""
    Interpreter = interpreter_class()
    try:
        it = Interpreter(model_path=str(twin), num_threads=threads)
        it.allocate_tensors()
    except Exception as e:    # LiteRT raises ValueError/RuntimeError on a bad flatbuffer
        raise TinydeployError(f"LiteRT cannot load {printable(Path(twin).name)}: {printable(str(e), 160)}") from None
    details = it.get_input_details()
    arrays = list(feeds.values())
    if len(details) != len(arrays):
        raise TinydeployError(f"{printable(Path(twin).name)} takes {len(details)} inputs, the ONNX model {len(arrays)}")
    for i, d in enumerate(details):
        x = feeds.get(d["name"], arrays[i])
        if tuple(d["shape"]) != x.shape or np.dtype(d["dtype"]) != x.dtype:
            raise TinydeployError(f"{printable(Path(twin).name)}: input {printable(d['name'])!r} is "
                                  f"{np.dtype(d['dtype']).name} {'x'.join(map(str, d['shape']))}, the ONNX model's "
                                  f"{x.dtype.name} {'x'.join(map(str, x.shape))}: not the same network")
        it.set_tensor(d["index"], x)
    it.invoke()
    t0 = time.perf_counter()
    it.invoke()
    runs = runs_within(budget_s, time.perf_counter() - t0)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        it.invoke()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000.0, runs
