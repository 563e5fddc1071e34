"""`tinydeploy doctor`, `tinydeploy --version` and the pinned installs (constraints.txt). Nothing
here depends on the CPU: feature values are only checked for their shape."""
import importlib.metadata
import json
import platform
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement   # installed with the test extra (pytest needs it)
from packaging.utils import canonicalize_name

from tinydeploy import __version__, cli, doctor
from tinydeploy.targets import FEATURES

ROOT = Path(__file__).resolve().parents[1]
NOT_PINNED = {"pip", "setuptools", "wheel"}     # the installer's own packages, never in the freeze


def _installed(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pyproject_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]


def _constraint_lines():
    return [ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def test_doctor_json_has_the_keys_and_metadata_versions(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert {"tinydeploy", "python", "packages", "machine", "cpu_model", "cpu_features", "vnni",
            "onnxruntime_int8", "tools", "constraints"} <= set(r)
    assert r["tinydeploy"] == __version__
    assert r["python"] == platform.python_version()
    assert r["machine"] == platform.machine()
    assert list(r["packages"]) == ["onnx", "onnxruntime", "numpy", "jinja2", "platformio", "scons", "pyserial"]
    for name, version in r["packages"].items():
        assert version == _installed(name), name
    assert set(r["cpu_features"]) == set(FEATURES)
    assert all(isinstance(v, bool) for v in r["cpu_features"].values())
    assert set(r["tools"]) == set(doctor.TOOLS)
    for t in r["tools"].values():
        assert t is None or (t["path"] and isinstance(t["version"], str))
    assert set(r["constraints"]) == {"file", "pinned", "mismatches"}


def test_doctor_text_exits_0(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"onnxruntime {_installed('onnxruntime')}" in out
    assert "tools:" in out and "8-bit" in out


def test_version_mentions_the_reference_stack(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"tinydeploy {__version__}")
    assert f"onnxruntime {importlib.metadata.version('onnxruntime')}" in out
    assert f"numpy {importlib.metadata.version('numpy')}" in out
    assert "AVX2" in out or "NEON" in out
    assert len(out.splitlines()) <= 5


def test_int8_note_says_what_vnni_means():
    none = {n: False for n in FEATURES}
    assert "saturating 16-bit pairs" in doctor.int8_note("x86_64", none)
    assert "without VNNI" in doctor.int8_note("x86_64", none)
    assert "with VNNI" in doctor.int8_note("x86_64", {**none, "avx_vnni": True})
    assert "with VNNI" in doctor.int8_note("AMD64", {**none, "avx512_vnni": True})
    assert doctor.int8_note("aarch64", {**none, "neon": True}).startswith("not x86")


def test_environment_strings_are_printed_safely(monkeypatch):
    s = doctor.summary()
    s["cpu_model"] = "Evil\x1b[31m CPU\n"
    s["packages"] = {**s["packages"], "onnx": "1.0\x07"}
    text = "\n".join(doctor.format_version(s))
    assert "\x1b" not in text and "\x07" not in text and len(text.splitlines()) == 4
    monkeypatch.setattr(doctor, "tool_version", lambda name: {"path": "/bin/x\x1b", "version": "v\r1"})
    r = doctor.report()
    r["cpu_model"] = "Evil\x1b[31m CPU"
    text = "\n".join(doctor.format_report(r))
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", text)


def test_constraints_check_lists_differences(tmp_path):
    f = tmp_path / "constraints.txt"
    f.write_text("# a comment\n\nNumPy==0.0.1  # too old\nno-such-package-td==1.0\n"
                 f"onnxruntime=={_installed('onnxruntime')}\nwin-only==2 ; sys_platform == 'win32'\nfoo>=1\n")
    assert doctor.parse_constraints(f.read_text()) == {
        "numpy": "0.0.1", "no-such-package-td": "1.0", "onnxruntime": _installed("onnxruntime"), "win-only": "2"}
    c = doctor.check_constraints(f)
    got = {m["package"]: (m["pinned"], m["installed"]) for m in c["mismatches"]}
    assert got == {"numpy": ("0.0.1", _installed("numpy")), "no-such-package-td": ("1.0", None),
                   "win-only": ("2", None)}
    assert c["pinned"] == 4 and c["file"] == str(f)
    lines = doctor.format_report({**doctor.report(), "constraints": c})
    assert any(ln.startswith("warning: 3 of 4 packages differ") for ln in lines)
    assert any("no-such-package-td" in ln and "installed not installed" in ln for ln in lines)


def test_constraints_pin_every_direct_dependency_within_pyproject_ranges():
    pins = {}
    for line in _constraint_lines():
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"not an exact pin: {line}"
        assert canonicalize_name(req.name) not in pins, f"pinned twice: {line}"
        pins[canonicalize_name(req.name)] = specs[0].version
    assert "tinydeploy" not in pins and not (NOT_PINNED & set(pins))
    assert pins == doctor.parse_constraints((ROOT / "constraints.txt").read_text())
    for req in _pyproject_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {req}"
        assert any(s.operator == "<" for s in req.specifier), f"{req} has no upper bound"


def test_constraints_cover_every_installed_dependency():
    """The transitive closure of pyproject's requirements, as installed here, is all pinned."""
    pins = doctor.parse_constraints((ROOT / "constraints.txt").read_text())
    todo, seen = list(_pyproject_requirements()), set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        if name in NOT_PINNED or _installed(name) is None:
            continue
        assert name in pins, f"{name} (installed with tinydeploy) is not pinned in constraints.txt"
        todo += [Requirement(r) for r in importlib.metadata.requires(name) or []]
    assert {"onnx", "onnxruntime", "numpy", "protobuf", "markupsafe", "execnet"} <= seen


def test_ci_setup_installs_with_the_constraints():
    setup = (ROOT / ".ci" / "setup").read_text()
    install = [ln for ln in setup.splitlines() if "pip install" in ln]
    assert install and all("-c constraints.txt" in ln for ln in install)
    assert "constraints.txt" in (ROOT / ".ci" / "freeze").read_text()
