import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


# ---- conformance summary (tests/test_conformance.py) -- begin ----------------------------------
# Collects each conformance case's outcome from its report (also under pytest-xdist, where the
# reports reach the controlling process) and prints the counts at the end of the run.
_conformance_results = {}


_fuzz_lines = []


def pytest_runtest_logreport(report):
    props = dict(report.user_properties)
    for key in ("fuzz_summary", "fuzz_corpus"):
        if report.when == "call" and key in props:
            _fuzz_lines.append(props[key])
    case = props.get("conformance_case")
    if case is None:
        return
    if report.failed:
        _conformance_results[case] = (case, "failed", "")
    elif report.when == "call":
        if report.passed:
            outcome = "passed"
        elif hasattr(report, "wasxfail"):
            outcome = "known failure"
        else:
            outcome = "unsupported"
        _conformance_results[case] = (case, outcome, props.get("conformance_reason", ""))


def pytest_terminal_summary(terminalreporter):
    if _fuzz_lines:   # tests/test_fuzz.py: the mutation fuzzer's outcome counts
        terminalreporter.section("fuzz")
        for line in _fuzz_lines:
            terminalreporter.write_line(line)
    if not _conformance_results:
        return
    from test_conformance import format_summary
    terminalreporter.section("conformance")
    for line in format_summary(list(_conformance_results.values())):
        terminalreporter.write_line(line)
# ---- conformance summary -- end -----------------------------------------------------------------


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def resnets(tmp_path_factory):
    """ResNet-18 and ResNet-50 v1.5 built by models/make_models.py (seeded, deterministic)."""
    import onnx
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import make_models
    out = tmp_path_factory.mktemp("resnets")
    paths = {}
    for name in ("resnet18", "resnet50"):
        paths[name] = out / f"{name}.onnx"
        onnx.save(make_models.build(name, seed=0), paths[name])
    return paths
