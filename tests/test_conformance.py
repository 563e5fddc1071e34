"""Conformance against the ONNX backend test data shipped inside the installed onnx package.

Every case under onnx/backend/test/data/{pytorch-converted,pytorch-operator,simple}/<case>/
(model.onnx + test_data_set_*/input_*.pb, output_*.pb) is classified, then built for the host
and run:

* unsupported -- the case is not run, and is reported as skipped with the reason. A case is
  unsupported when, after import (tinydeploy.frontend.importer.import_model), tinydeploy.ops.
  unsupported_nodes or tinydeploy.pipeline.check_supported reject an operator or a graph
  input/output dtype; when the onnx checker rejects the model; or when import stops and the
  model uses an operator that has no kernel at all (e.g. sequence operators). Any other import
  error is a failure, not "unsupported": it is the kind of bug this test exists to find.
* supported -- built once with gcc (-Werror, the host target's flags) and run on every test
  data set of the case. It must pass, unless it is listed in tests/conformance_known_failures.txt
  (`<suite>/<case>: <reason>`, reviewed by hand); a listed case is reported as xfail, and a
  listed case that passes (or is no longer supported) fails the test, so the list cannot rot.

Tolerance: our outputs are compared with the expected output_*.pb files (which onnxruntime also
reproduces) by tinydeploy.reference.compare, norm-wise per output: max|got - want| / max|want|
must be <= RTOL = 1e-4 (the same tolerance `tinydeploy run` uses against onnxruntime). Output
shapes must match exactly; NaN must match NaN and infinities must match exactly.

The summary line (`conformance: N passed, K known failures, U unsupported of T cases`, followed by
the unsupported cases grouped by reason) is printed at the end of every pytest run by the
marked block in tests/conftest.py, also under pytest-xdist.
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tinydeploy import flow, reference
from tinydeploy.errors import TinydeployError
from tinydeploy.frontend.importer import import_model, load_model
from tinydeploy.ops import REGISTRY, unsupported_nodes
from tinydeploy.pipeline import RUNTIME_DTYPES, check_supported
from tinydeploy.runners.local import LocalRunner

RTOL = 1e-4
SUITES = ("pytorch-converted", "pytorch-operator", "simple")
DATA = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data"
KNOWN_FAILURES_FILE = Path(__file__).resolve().parent / "conformance_known_failures.txt"
PROPERTY = "conformance_case"         # user property names read by the conftest summary block
REASON_PROPERTY = "conformance_reason"


def all_cases() -> list[str]:
    out = []
    for suite in SUITES:
        d = DATA / suite
        if d.is_dir():
            out += [f"{suite}/{c}" for c in sorted(os.listdir(d)) if (d / c / "model.onnx").is_file()]
    return out


def parse_known_failures(text: str) -> tuple["OrderedDict[str, str]", list[str]]:
    """`<suite>/<case>: <reason>` per line; '#' starts a comment. Returns (entries, problems)."""
    entries: "OrderedDict[str, str]" = OrderedDict()
    problems = []
    for k, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([\w.-]+/[\w.-]+)\s*:\s*(\S.*)", line)
        if not m:
            problems.append(f"line {k}: not '<suite>/<case>: <reason>': {line!r}")
            continue
        if m.group(1) in entries:
            problems.append(f"line {k}: {m.group(1)} is listed twice")
        entries[m.group(1)] = m.group(2).strip()
    return entries, problems


CASES = all_cases()
KNOWN_FAILURES, KNOWN_FAILURES_PROBLEMS = parse_known_failures(
    KNOWN_FAILURES_FILE.read_text() if KNOWN_FAILURES_FILE.is_file() else "")


def _node_key(op: str, why: str) -> str:
    return op if why == "no kernel" else f"{op} ({why})"


def classify(model_path: Path):
    """(graph, None) when every operator and dtype is supported, else (None, reason).
    Import errors that are not about unsupported operators are raised, not classified."""
    try:
        g, _ = import_model(model_path)
    except TinydeployError as e:
        msg = str(e)
        if msg.startswith("the ONNX checker rejected the model"):
            return None, msg
        raw = load_model(model_path)
        no_kernel = sorted({n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}:{n.op_type}"
                            for n in raw.graph.node} - set(REGISTRY))
        if no_kernel:
            return None, ", ".join(no_kernel) + " (no kernel; import already stops at: " + msg[:160] + ")"
        raise
    keys = sorted({_node_key(n.op, why) for n, why in unsupported_nodes(g)})
    keys += sorted({f"graph input/output of type {np.dtype(g.t(n).dtype).name}" for n in g.inputs + g.outputs
                    if np.dtype(g.t(n).dtype) not in RUNTIME_DTYPES})
    try:
        check_supported(g)
    except TinydeployError as e:
        return None, "; ".join(keys) or str(e)
    assert not keys, f"check_supported accepted a graph that unsupported_nodes rejects: {keys}"
    return g, None


def _load_pbs(folder: Path, kind: str) -> list[onnx.TensorProto]:
    files = sorted(folder.glob(f"{kind}_*.pb"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    return [onnx.load_tensor(str(p)) for p in files]


def _feeds(tensors: list[onnx.TensorProto], specs) -> list[np.ndarray]:
    """Input arrays in the order of the built model's inputs (by name when the .pb files are
    named after the inputs, else by position), checked against the built shapes and dtypes."""
    names = [n for n, _, _ in specs]
    assert len(tensors) == len(specs), f"{len(tensors)} input files for {len(specs)} model inputs {names}"
    by_name = {t.name: t for t in tensors}
    if all(t.name for t in tensors) and set(by_name) == set(names):
        tensors = [by_name[n] for n in names]
    out = []
    for t, (name, shape, dt) in zip(tensors, specs):
        a = numpy_helper.to_array(t)
        assert tuple(a.shape) == tuple(shape) and a.dtype == dt, (
            f"input {name!r}: the test data is {a.dtype.name} {list(a.shape)}, the built model expects "
            f"{np.dtype(dt).name} {list(shape)}")
        out.append(a)
    return out


def run_case(case: str, g, tmp_path: Path) -> None:
    """Build once (gcc, -Werror) and check every test data set; raises on any mismatch."""
    d = DATA / case
    b = flow.build(d / "model.onnx", "host", tmp_path / "build", quiet=True, cc="gcc")
    specs = flow.io_specs(b.summary, "inputs")
    out_specs = [(s, dt) for _, s, dt in flow.io_specs(b.summary, "outputs")]
    sets = sorted(p for p in d.glob("test_data_set_*") if p.is_dir())
    assert sets, f"{case} has no test_data_set_* folder"
    for ds in sets:
        feeds = _feeds(_load_pbs(ds, "input"), specs)
        want = [numpy_helper.to_array(t) for t in _load_pbs(ds, "output")]
        assert len(want) == len(out_specs), f"{len(want)} expected outputs, the model has {len(out_specs)}"
        got, _ = LocalRunner().run(b.exe, feeds, out_specs)
        res = reference.compare(got, want, RTOL)
        assert res["outputs_match"], (
            f"{ds.name}: max_rel_error {res['max_rel_error']:.3g} > {RTOL} (max_abs_error "
            f"{res['max_abs_error']:.3g}); got shapes {[list(a.shape) for a in got]}, "
            f"want {[list(np.shape(a)) for a in want]}")


@pytest.mark.parametrize("case", CASES)
def test_case(case, tmp_path, record_property):
    record_property(PROPERTY, case)
    listed = KNOWN_FAILURES.get(case)
    try:
        g, reason = classify(DATA / case / "model.onnx")
        if reason is None:
            run_case(case, g, tmp_path)
    except (AssertionError, TinydeployError) as e:
        if listed is None:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        pytest.xfail(f"known failure: {listed} [{first[:200]}]")
    if reason is not None:
        if listed is not None:
            pytest.fail(f"{case} is listed in {KNOWN_FAILURES_FILE.name} but is unsupported now "
                        f"({reason}); remove it from the list")
        key = reason.split(" (no kernel; import", 1)[0] + (" (no kernel)" if " (no kernel; import" in reason else "")
        record_property(REASON_PROPERTY, key)
        pytest.skip(f"unsupported: {reason}")
    if listed is not None:
        pytest.fail(f"{case} passes now: remove it from {KNOWN_FAILURES_FILE.name}")


def test_known_failures_list_is_valid():
    assert not KNOWN_FAILURES_PROBLEMS, "\n".join(KNOWN_FAILURES_PROBLEMS)
    unknown = [c for c in KNOWN_FAILURES if c not in CASES]
    assert not unknown, f"{KNOWN_FAILURES_FILE.name} lists cases that do not exist: {unknown}"


def test_backend_data_is_present():
    """Fail, never skip silently, when the onnx package ships no backend test data."""
    assert len(CASES) >= 100, f"only {len(CASES)} backend test cases under {DATA}"


def format_summary(results: list[tuple[str, str, str]]) -> list[str]:
    """results: (case, outcome, reason) with outcome passed / known failure / unsupported / failed."""
    if not results:
        return []
    count = {k: 0 for k in ("passed", "known failure", "unsupported", "failed")}
    groups: "OrderedDict[str, list[str]]" = OrderedDict()
    for case, outcome, reason in sorted(results):
        count[outcome] = count.get(outcome, 0) + 1
        if outcome == "unsupported":
            groups.setdefault(reason or "?", []).append(case.split("/", 1)[1])
    line = (f"conformance: {count['passed']} passed, {count['known failure']} known failures, "
            f"{count['unsupported']} unsupported of {len(results)} cases")
    if count["failed"]:
        line += f" ({count['failed']} FAILED)"
    lines = [line]
    if groups:
        lines.append("unsupported cases by reason:")
        for reason, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            shown = ", ".join(names[:4]) + (f", +{len(names) - 4} more" if len(names) > 4 else "")
            lines.append(f"  {len(names):3d}  {reason[:150]}: {shown}")
    return lines
