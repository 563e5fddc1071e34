"""Shared test helpers: build a model with tinydeploy, run it, compare with onnxruntime."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from tinydeploy import flow, reference
from tinydeploy.runners.local import LocalRunner

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
        got, _ = LocalRunner().run(b.exe, [x[n] for n, _, _ in specs], out_specs)
        want = reference.run_onnxruntime(path.read_bytes(), x)
        res = reference.compare(got, want, rtol)
        assert res["outputs_match"], f"{v}: {res} (rtol {rtol})"
    return res


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 13) -> onnx.ModelProto:
    """A model from onnx.helper pieces, stamped with an IR version onnxruntime accepts."""
    g = onnx.helper.make_graph(nodes, "test", inputs, outputs, list(initializers))
    return onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=8)


# ---- 8-bit models: bit for bit against the exact reference, in LSBs against the oracle -------

def check_8bit(path: Path, feeds: dict, got: list, input_shapes=None, exact_required: bool = True,
               label: str = "", lsb_scales=None) -> dict:
    """The 8-bit verdict on one run (reference.check_outputs), asserted: the outputs equal
    tinydeploy's exact reference bit for bit (unless exact_required=False: float islands), are
    within 1 LSB of the oracle or differ only through rounding ties, and every layer, given the
    same inputs, agrees with the oracle except at rounding ties (reference.layerwise). None of it
    depends on the CPU: onnxruntime's fast session is not consulted."""
    res = reference.check_outputs(path, path.read_bytes(), feeds, got, flow.FP32_RTOL, lsb_scales, input_shapes)
    assert res.get("tolerance_unit") == "LSB" and "exact_reference" in res, res
    if exact_required:
        assert res["exact_reference"]["identical"], f"{label}: kernels differ from the exact reference: {res}"
    assert res["outputs_match"], f"{label}: {res}"
    lw = reference.layerwise(path, path.read_bytes(), feeds, input_shapes=input_shapes)
    assert lw["disagreements"] == 0, f"{label}: layers disagree with the oracle beyond rounding ties: " + str(
        [x for x in lw["layers"] if x["disagreements"]])
    res["layer_ties"] = lw["ties"]
    return res


def check_model_lsb(model: onnx.ModelProto | Path, tmp_path: Path, feeds: dict | None = None, seeds=(0,),
                    variants=("gcc", "clang", "gcc-asan-ubsan"), input_shapes=None,
                    exact_required: bool = True) -> list[dict]:
    """Like check_model, for 8-bit models: build with every compiler variant, run on `feeds`
    (default: seeded random inputs, one run per seed) and hold each result to check_8bit.
    Returns the verdicts of the last variant."""
    path = model if isinstance(model, Path) else save(model, tmp_path)
    results = []
    for v in variants:
        b, specs, out_specs = _build_variant(path, v, tmp_path, input_shapes)
        results = []
        for seed in seeds:
            x = feeds if feeds is not None else reference.random_inputs(specs, seed)
            got, _ = LocalRunner().run(b.exe, [x[n] for n, _, _ in specs], out_specs)
            results.append(check_8bit(path, x, got, input_shapes, exact_required, f"{v}, seed {seed}",
                                      b.summary.get("output_lsb")))
    return results


def assert_arena_tight(model, mem, board: str = "host"):
    """The arena of `model` on `board` (`mem`: the `memory` of `run --json`) lies between the
    activations' per-layer lower bound (planner.lower_bound, activations alone) and the worst
    step's live buffers with that step's kernel scratch (GEMM packing, im2col blocks: their size
    follows the ISA, so the bound is computed here, not pinned): placement adds no fragmentation
    above what one step needs."""
    from tinydeploy.pipeline import compile_model
    from tinydeploy.targets.boards import get_board
    c = compile_model(model, get_board(board).make_target(), board=board)
    need = max(sum(b.size for b in c.plan.buffers if b.start <= k <= b.end) for k in range(len(c.graph.nodes)))
    assert (mem["lower_bound_bytes"], mem["arena_bytes"]) == (c.plan.lower_bound, c.plan.arena_bytes)
    assert 0 < c.plan.lower_bound <= c.plan.arena_bytes <= need
