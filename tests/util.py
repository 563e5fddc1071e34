"""Shared test helpers: build a model with tinydeploy, run it, compare with onnxruntime."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from tinydeploy import flow, reference

REPO = Path(__file__).resolve().parents[1]
MLPERF = REPO.parent / "shared" / "models" / "mlperf_tiny"

# Compiler variants every generated project is checked with: warnings are errors in all of them.
SANITIZE = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
VARIANTS = {
    "gcc": ("gcc", []),
    "clang": ("clang", []),
    "gcc-asan-ubsan": ("gcc", SANITIZE),
}


def mlperf_model(name: str) -> Path:
    """Path of a shared MLPerf Tiny model; fails (never skips silently) when it is absent."""
    p = MLPERF / name
    if not p.is_file():
        pytest.fail(f"{p} is missing: the MLPerf Tiny models must be in ../shared/models/mlperf_tiny "
                    "beside the checkout")
    return p


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed; run .ci/run's install step (or apt-get install {tool})")
    return path


def save(model: onnx.ModelProto, tmp_path: Path, name: str = "model.onnx") -> Path:
    p = tmp_path / name
    onnx.save(model, p)
    return p


def _build_variant(path: Path, variant: str, tmp_path: Path, input_shapes):
    """Build for the host with one compiler variant: (build, input specs, output specs)."""
    cc, flags = VARIANTS[variant]
    require(cc)
    b = flow.build(path, "host", tmp_path / f"build-{variant}", input_shapes=input_shapes, quiet=True,
                   extra_cflags=flags, cc=cc)
    return b, flow.io_specs(b.summary, "inputs"), [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]


def check_model(model: onnx.ModelProto | Path, tmp_path: Path, feeds: dict | None = None, seed: int = 0,
                variants=("gcc", "clang", "gcc-asan-ubsan"), rtol: float = flow.FP32_RTOL,
                input_shapes=None) -> dict:
    """Build `model` with every compiler variant, run it on `feeds` (default: seeded random inputs)
    and assert each result matches onnxruntime within rtol. Returns the last comparison."""
    path = model if isinstance(model, Path) else save(model, tmp_path)
    res = None
    for v in variants:
        b, specs, out_specs = _build_variant(path, v, tmp_path, input_shapes)
        x = feeds if feeds is not None else reference.random_inputs(specs, seed)
        got, _ = flow.execute(b.exe, [x[n] for n, _, _ in specs], out_specs)
        want = reference.run_onnxruntime(path.read_bytes(), x)
        res = reference.compare(got, want, rtol)
        assert res["outputs_match"], f"{v}: {res} (rtol {rtol})"
    return res


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 13) -> onnx.ModelProto:
    """A model from onnx.helper pieces, stamped with an IR version onnxruntime accepts."""
    g = onnx.helper.make_graph(nodes, "test", inputs, outputs, list(initializers))
    return onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=8)


# ---- 8-bit models: comparison in LSBs (see reference.compare_lsb) ----------------------------

def check_model_lsb(model: onnx.ModelProto | Path, tmp_path: Path, feeds: dict | None = None, seeds=(0,),
                    variants=("gcc", "clang", "gcc-asan-ubsan"), max_lsb: int = 1,
                    min_identical: float = reference.MIN_IDENTICAL_FRACTION, input_shapes=None) -> list[dict]:
    """Like check_model, for models with integer outputs: build with every compiler variant, run
    on `feeds` (default: seeded random inputs, one run per seed) and assert every output element
    is within `max_lsb` of onnxruntime and at least `min_identical` of them are identical.
    Returns the comparisons of the last variant."""
    path = model if isinstance(model, Path) else save(model, tmp_path)
    results = []
    for v in variants:
        b, specs, out_specs = _build_variant(path, v, tmp_path, input_shapes)
        results = []
        for seed in seeds:
            x = feeds if feeds is not None else reference.random_inputs(specs, seed)
            got, _ = flow.execute(b.exe, [x[n] for n, _, _ in specs], out_specs)
            want = reference.run_onnxruntime(path.read_bytes(), x)
            res = reference.compare_lsb(got, want)
            assert res["max_abs_error"] <= max_lsb and res["identical_fraction"] >= min_identical, \
                f"{v}, seed {seed}: {res} (allowed {max_lsb} LSB, {min_identical:.0%} identical)"
            results.append(res)
    return results
