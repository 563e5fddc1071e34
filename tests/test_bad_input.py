"""Bad input never produces a traceback: through the real CLI (a subprocess, cwd = tmp_path) every
user mistake or hostile model ends with exit code 2 and one `tinydeploy: error: ...` line that
names the key facts. Hostile names must build with gcc and clang -Werror, match onnxruntime and
never reach the generated C raw.

stderr rule (`assert_user_error`): exactly one non-empty line starts with `tinydeploy: error:`,
it is the last line, and any other non-empty line is a `[tinydeploy] ...` progress line (builds
print "compiling X for host" before the model is read). No 'Traceback', no 'internal error'.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinydeploy import cli, flow, reference
from tinydeploy.runners.local import LocalRunner
from util import REPO, check_model, make_model

PROGRESS = "[tinydeploy] "
ERROR = "tinydeploy: error:"


# ----------------------------------------------------------------------------------------------
# helpers

def tiny(tmp_path: Path, name: str = "model.onnx", shape=(1, 3, 4), in_name: str = "x") -> Path:
    """x -> Relu -> y, saved as tmp_path/name."""
    m = make_model([helper.make_node("Relu", [in_name], ["y"], name="relu")],
                   [helper.make_tensor_value_info(in_name, TensorProto.FLOAT, list(shape))],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))])
    p = tmp_path / name
    onnx.save(m, p)
    return p


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def cli_run(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TINYDEPLOY_DEBUG"}
    # the checkout under test, whatever `pip install -e` currently points at
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-m", "tinydeploy", *map(str, args)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_user_error(r, *facts: str) -> str:
    """exit 2, one `tinydeploy: error:` line (the last one), only progress lines besides it,
    no traceback; the message contains every fact. Returns the message."""
    out, err = r.stdout, r.stderr
    assert "Traceback" not in out + err, err
    assert "internal error" not in err, err
    assert r.returncode == 2, f"exit {r.returncode}\nstdout: {out}\nstderr: {err}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(ERROR)]
    assert len(errors) == 1, err
    assert lines[-1] == errors[0], err
    others = [ln for ln in lines[:-1] if not ln.startswith(PROGRESS)]
    assert not others, f"unexpected stderr lines {others!r}"
    msg = errors[0]
    for f in facts:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


class _InProc:
    def __init__(self, code, out, err):
        self.returncode, self.stdout, self.stderr = code, out, err


def cli_inproc(capsys, monkeypatch, tmp_path: Path, *args: str) -> _InProc:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TINYDEPLOY_DEBUG", raising=False)
    capsys.readouterr()
    code = cli.main([str(a) for a in args])
    cap = capsys.readouterr()
    return _InProc(code, cap.out, cap.err)


def test_testing_the_checkout():
    """In-process cases must exercise this checkout, not whatever `pip install -e` points at
    (run pytest as `python -m pytest` from the repository root)."""
    assert Path(cli.__file__).resolve().is_relative_to(REPO), cli.__file__


# ----------------------------------------------------------------------------------------------
# 1. unsupported operators: one message, every op type, counts, node names

def test_unsupported_ops_listed_with_counts_and_names(tmp_path):
    k = numpy_helper.from_array(np.array([3], dtype=np.int64), "k")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu_ok"),
        helper.make_node("TopK", ["r", "k"], ["v1", "i1"], name="topk_first", axis=1),
        helper.make_node("TopK", ["v1", "k"], ["v2", "i2"], name="topk_second", axis=1),
        helper.make_node("NonMaxSuppression", ["boxes", "scores"], ["sel"], name="nms_one"),
    ]
    m = make_model(nodes,
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8]),
                    helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 8, 4]),
                    helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 1, 8])],
                   [helper.make_tensor_value_info("v2", TensorProto.FLOAT, [1, 3]),
                    helper.make_tensor_value_info("sel", TensorProto.INT64, ["n", 3])], [k])
    p = save(m, tmp_path / "unsup.onnx")
    for cmd in ("build", "run"):
        msg = assert_user_error(cli_run(tmp_path, cmd, p.name), "unsupported operators",
                                "TopK x2", "topk_first", "topk_second", "NonMaxSuppression x1", "nms_one")
        assert "Relu" not in msg and "relu_ok" not in msg, msg


# ----------------------------------------------------------------------------------------------
# 2. files that are not ONNX models

def _bad_file(tmp_path: Path, kind: str) -> tuple[str, list[str]]:
    """Creates the bad input; returns (argument, facts the message must contain)."""
    if kind == "truncated":
        m = make_model([helper.make_node("Gemm", ["x", "w"], ["y"], name="fc")],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                       [numpy_helper.from_array(np.ones((64, 64), np.float32), "w")])
        data = m.SerializeToString()
        (tmp_path / "trunc.onnx").write_bytes(data[: len(data) // 2])
        return "trunc.onnx", ["trunc.onnx"]
    if kind == "garbage":
        (tmp_path / "garbage.onnx").write_bytes(np.random.default_rng(1234).bytes(4096))
        return "garbage.onnx", ["garbage.onnx"]
    if kind == "empty":
        (tmp_path / "empty.onnx").write_bytes(b"")
        return "empty.onnx", ["empty.onnx", "empty"]
    if kind == "text":
        (tmp_path / "notes.onnx").write_text("hello, this is not a model\nsecond line\n")
        return "notes.onnx", ["notes.onnx"]
    if kind == "directory":
        (tmp_path / "dir.onnx").mkdir()
        return "dir.onnx", ["dir.onnx", "not a file"]
    if kind == "missing":
        return "missing.onnx", ["missing.onnx", "does not exist"]
    raise AssertionError(kind)


FILE_KINDS = ["truncated", "garbage", "empty", "text", "directory", "missing"]


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_bad_model_file_cli(tmp_path, kind):
    arg, facts = _bad_file(tmp_path, kind)
    for cmd in (["build", arg], ["run", arg], ["inspect", arg]):
        assert_user_error(cli_run(tmp_path, *cmd), *facts)


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_bad_model_file_in_process(tmp_path, capsys, monkeypatch, kind):
    arg, facts = _bad_file(tmp_path, kind)
    assert_user_error(cli_inproc(capsys, monkeypatch, tmp_path, "build", arg), *facts)


# ----------------------------------------------------------------------------------------------
# 3. symbolic dimensions and --input-shape

def _symbolic(tmp_path: Path, dims, name="sym.onnx") -> Path:
    m = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    return save(m, tmp_path / name)


def test_symbolic_non_batch_dim_needs_input_shape(tmp_path):
    p = _symbolic(tmp_path, ["N", 3, "W"])
    assert_user_error(cli_run(tmp_path, "build", p.name), "'x'", "'W'", "--input-shape")
    r = cli_run(tmp_path, "run", p.name, "--input-shape", "x=2x3x5")
    assert r.returncode == 0, r.stderr
    assert "outputs match" in r.stdout and "Traceback" not in r.stderr


def test_symbolic_batch_dim_defaults_to_one(tmp_path):
    p = _symbolic(tmp_path, ["batch", 3, 4])
    r = cli_run(tmp_path, "build", p.name)
    assert r.returncode == 0, r.stderr
    assert re.search(r"note: .*'x'.*'batch'.* 1", r.stdout), r.stdout
    marker = json.loads((tmp_path / "build" / "sym-host" / ".tinydeploy.json").read_text())
    assert marker["summary"]["inputs"] == [["x", [1, 3, 4], "float32"]]
    r = cli_run(tmp_path, "run", p.name)
    assert r.returncode == 0 and "outputs match" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("spec,facts", [
    ("x=1xAx3", ["'x=1xAx3'", "NAME=DxDx"]),
    ("x=", ["'x='", "NAME=DxDx"]),
    ("=1x2", ["'=1x2'", "NAME=DxDx"]),
    ("x=1x0x4", ["'x=1x0x4'", "positive"]),
    ("x=1x3", ["'x'", "2 dimensions", "3"]),          # wrong rank
    ("nope=1x3x4", ["'nope'", "'x'"]),                # unknown input name
    ("x=1x5x4", ["x=1x5x4", "conflicts", "3"]),       # the model fixes dim 1 to 3
])
def test_malformed_input_shape(tmp_path, spec, facts):
    p = _symbolic(tmp_path, ["N", 3, "W"])
    assert_user_error(cli_run(tmp_path, "build", p.name, "--input-shape", spec), *facts)
    assert_user_error(cli_run(tmp_path, "inspect", p.name, "--input-shape", spec), *facts)


@pytest.mark.parametrize("spec", ["x=1xAx3", "nope=1x3x4", "x=1x3"])
def test_malformed_input_shape_in_process(tmp_path, capsys, monkeypatch, spec):
    p = _symbolic(tmp_path, ["N", 3, "W"])
    assert_user_error(cli_inproc(capsys, monkeypatch, tmp_path, "build", p.name, "--input-shape", spec), "x")


# ----------------------------------------------------------------------------------------------
# 4. external data

def _matmul_model(w: np.ndarray) -> onnx.ModelProto:
    return make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, w.shape[0]])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, w.shape[1]])],
                      [numpy_helper.from_array(w, "w")])


def _external(tmp_path: Path, location: str, length: int = 64, offset: int = 0) -> Path:
    """models/ext.onnx whose initializer w (4x4 float) claims to live in `location`."""
    m = _matmul_model(np.zeros((4, 4), np.float32))
    t = m.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return save(m, tmp_path / "models" / "ext.onnx")


def _secret(tmp_path: Path) -> Path:
    """A file outside the model folder. It is a FIFO: opening it for reading would block, so a
    tinydeploy that read it would hit the subprocess timeout instead of refusing."""
    p = tmp_path / "secret.bin"
    os.mkfifo(p)
    return p


@pytest.mark.parametrize("how", ["dotdot", "nested-dotdot", "absolute", "symlink"])
def test_external_data_outside_model_folder_refused(tmp_path, how):
    secret = _secret(tmp_path)
    (tmp_path / "models").mkdir()
    if how == "dotdot":
        loc = "../secret.bin"
    elif how == "nested-dotdot":
        (tmp_path / "models" / "sub").mkdir()
        loc = "sub/../../secret.bin"
    elif how == "absolute":
        loc = str(secret)
    else:
        (tmp_path / "models" / "link.bin").symlink_to(secret)
        loc = "link.bin"
    p = _external(tmp_path, loc)
    for cmd in ("build", "inspect"):
        assert_user_error(cli_run(tmp_path, cmd, "models/ext.onnx", timeout=60), "'w'", "outside", "refusing")
    assert secret.is_fifo()


def test_external_data_missing_file(tmp_path):
    _external(tmp_path, "weights.bin")
    assert_user_error(cli_run(tmp_path, "build", "models/ext.onnx"), "'weights.bin'", "'w'", "missing")


def test_external_data_too_short(tmp_path):
    p = _external(tmp_path, "weights.bin", length=64, offset=16)
    (p.parent / "weights.bin").write_bytes(b"\0" * 70)   # needs 16 + 64 = 80
    assert_user_error(cli_run(tmp_path, "build", "models/ext.onnx"), "'w'", "'weights.bin'", "truncated")


def test_external_data_inside_folder_builds_and_matches(tmp_path):
    w = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    folder = tmp_path / "m"
    folder.mkdir()
    p = folder / "ext.onnx"
    onnx.save_model(_matmul_model(w), p, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.weights", size_threshold=0)
    assert (folder / "ext.weights").stat().st_size == w.nbytes
    assert onnx.load_model(p, load_external_data=False).graph.initializer[0].data_location == TensorProto.EXTERNAL
    # util.check_model hands onnxruntime the model's bytes, which cannot carry external data:
    # compare here against a session that loads the file itself.
    import onnxruntime as ort
    b = flow.build(p, "host", tmp_path / "out", quiet=True)
    x = reference.random_inputs(flow.io_specs(b.summary, "inputs"), 0)
    got, _ = LocalRunner().run(b.exe, [x["x"]], [((1, 8), np.dtype(np.float32))])
    want = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, x)
    assert reference.compare(got, want, flow.FP32_RTOL)["outputs_match"]
    np.testing.assert_allclose(got[0], x["x"] @ w, rtol=1e-5, atol=1e-5)
    r = cli_run(tmp_path, "run", "m/ext.onnx")        # the CLI's own onnxruntime comparison
    assert r.returncode == 0 and "outputs match" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------------------------------------------
# 5. hostile names

HOSTILE = [
    "close*/ int evil; /*",
    "/* open comment",
    "new\nline int evil;",
    "carriage\rreturn",
    "quote\"'\"*/",
    "backslash at end\\\nint evil;",
    "trigraph ??/\nint evil;",
    "\n#include \"/etc/passwd\"\n",
    "".join(chr(c) for c in range(1, 32)) + "".join(chr(c) for c in range(127, 256)),
    "L" * 10000,
    "non-ascii \u65e5\u672c\u8a9e \u00f1 \U0001f642 \u202e",
]


def _hostile_model() -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    nodes, inits = [], []
    w = numpy_helper.from_array(rng.standard_normal((4, 2, 3, 3)).astype(np.float32), "w " + HOSTILE[0])
    inits.append(w)
    cur = HOSTILE[0]
    nodes.append(helper.make_node("Conv", [cur, w.name], ["conv " + HOSTILE[1]], name="conv " + HOSTILE[2], pads=[1, 1, 1, 1]))
    cur = "conv " + HOSTILE[1]
    ops = ["Relu", "Add", "Mul", "Sigmoid", "Add", "Mul", "Relu", "Add", "Mul", "Add", "Sub"]
    for i, h in enumerate(HOSTILE):
        op = ops[i % len(ops)]
        out = f"t{i} {h}"
        if op in ("Add", "Mul", "Sub"):
            c = numpy_helper.from_array(rng.standard_normal((4, 1, 1)).astype(np.float32), f"c{i} {h}")
            inits.append(c)
            nodes.append(helper.make_node(op, [cur, c.name], [out], name=h))
        else:
            nodes.append(helper.make_node(op, [cur], [out], name=f"n{i} {h}"))
        cur = out
    nodes.append(helper.make_node("Relu", [cur], [HOSTILE[-3]], name="last"))
    return make_model(nodes, [helper.make_tensor_value_info(HOSTILE[0], TensorProto.FLOAT, [1, 2, 5, 5])],
                      [helper.make_tensor_value_info(HOSTILE[-3], TensorProto.FLOAT, [1, 4, 5, 5])], inits)


def _generated_texts(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())
            if p.suffix in (".c", ".h") or p.name == "Makefile"}


def _assert_no_injection(texts: dict[str, str], hostile: list[str]) -> None:
    assert texts
    for fname, text in texts.items():
        assert text.isascii(), fname
        for h in hostile:
            assert h not in text, f"{fname} contains the raw name {h[:40]!r}"
        for ln in text.splitlines():
            for h in hostile:
                assert h not in ln
            assert not ln.rstrip(" \t").endswith("\\"), f"{fname}: line continuation {ln[:80]!r}"
            assert "??" not in ln, f"{fname}: trigraph in {ln[:80]!r}"
            assert "\r" not in ln
            if "int evil;" in ln:   # only ever inside a comment
                assert "/*" in ln or ln.lstrip().startswith("*"), f"{fname}: {ln[:80]!r}"
            s = ln.lstrip()
            if s.startswith("#include"):
                assert s in ('#include "model.h"', '#include "td_kernels.h"', '#include "td_runtime.h"',
                             '#include "td_weights.h"') or \
                    re.fullmatch(r"#include <[a-z]+\.h>", s), f"{fname}: {s!r}"
        # every comment opener is closed on its own terms: comments never nest or leak
        stripped = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        assert "*/" not in stripped and "/*" not in stripped, fname


def test_hostile_names_build_with_gcc_and_clang_and_match(tmp_path):
    m = _hostile_model()
    onnx.checker.check_model(m)
    check_model(m, tmp_path, variants=("gcc", "clang", "gcc-asan-ubsan"))
    for v in ("gcc", "clang", "gcc-asan-ubsan"):
        texts = _generated_texts(tmp_path / f"build-{v}")
        _assert_no_injection(texts, HOSTILE)
        # the names did reach the C, neutralised
        assert '"close*_/ int evil; /_*"' in texts["model.h"]
        assert '"c7 \\x0a#include "/etc/passwd"\\x0a"' in texts["td_weights.h"]


def test_hostile_names_through_cli(tmp_path):
    save(_hostile_model(), tmp_path / "hostile.onnx")
    r = cli_run(tmp_path, "run", "hostile.onnx")
    assert r.returncode == 0 and "outputs match" in r.stdout, r.stdout + r.stderr
    _assert_no_injection(_generated_texts(tmp_path / "build" / "hostile-host"), HOSTILE)


@pytest.mark.parametrize("fname", [
    "my model v2.onnx",
    "m\u00f3d\u00e8l \u65e5\u672c.onnx",
    "-rf model.onnx",
    "--help.onnx",
    "..hidden.onnx",
    "new\nline ??! \x1b[31m.onnx",
])
def test_model_file_names_give_sane_default_outdir(tmp_path, fname):
    tiny(tmp_path, fname)
    r = cli_run(tmp_path, "build", "./" + fname)
    assert r.returncode == 0, r.stderr
    made = [p for p in (tmp_path / "build").iterdir()]
    assert len(made) == 1, made
    out = made[0]
    assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*-host", out.name), out.name
    assert (out / "model_run").is_file()
    # the terminal sees no raw control characters from the file name
    for ln in (r.stdout + r.stderr).splitlines():
        assert ln.isprintable(), repr(ln)
    if fname.startswith("new"):
        _assert_no_injection(_generated_texts(out), [fname, "\n" + fname.split("\n")[1]])


# ----------------------------------------------------------------------------------------------
# 6. output folder safety

def test_refuses_non_empty_user_folder_and_force(tmp_path):
    tiny(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("my notes\n")
    assert_user_error(cli_run(tmp_path, "build", "model.onnx", "-o", "out"), "'out'", "not empty", "--force")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "my notes\n"
    assert_user_error(cli_run(tmp_path, "run", "model.onnx", "-o", "out"), "not empty")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]

    r = cli_run(tmp_path, "build", "model.onnx", "-o", "out", "--force")
    assert r.returncode == 0, r.stderr
    assert (out / "notes.txt").read_text() == "my notes\n"
    assert (out / "model.c").is_file() and (out / "model_run").is_file()


def test_rebuild_into_own_folder_without_force(tmp_path):
    tiny(tmp_path)
    for _ in range(2):
        r = cli_run(tmp_path, "build", "model.onnx")
        assert r.returncode == 0, r.stderr
    for _ in range(2):
        r = cli_run(tmp_path, "build", "model.onnx", "-o", "mine")
        assert r.returncode == 0, r.stderr
    r = cli_run(tmp_path, "run", "model.onnx", "-o", "mine")
    assert r.returncode == 0, r.stderr


def test_outdir_that_is_a_file_is_refused(tmp_path):
    tiny(tmp_path)
    (tmp_path / "out.txt").write_text("keep me\n")
    for extra in ([], ["--force"]):
        assert_user_error(cli_run(tmp_path, "build", "model.onnx", "-o", "out.txt", *extra), "'out.txt'",
                          "not a folder")
    assert (tmp_path / "out.txt").read_text() == "keep me\n"


# ----------------------------------------------------------------------------------------------
# 7. hostile model content

def _content_model(kind: str) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    if kind == "huge-constant":
        shape = numpy_helper.from_array(np.array([1000000, 1000000], np.int64), "shape")
        return make_model([helper.make_node("ConstantOfShape", ["shape"], ["c"], name="cos_huge"),
                           helper.make_node("Add", ["x", "c"], ["y"], name="add")],
                          [helper.make_tensor_value_info("x", f, [1, 1])],
                          [helper.make_tensor_value_info("y", f, [1000000, 1000000])], [shape])
    if kind == "empty-graph":
        return make_model([], [], [])
    if kind == "no-graph":
        return onnx.ModelProto(ir_version=8, opset_import=[helper.make_opsetid("", 13)])
    if kind == "bad-reshape":
        shape = numpy_helper.from_array(np.array([4, 4], np.int64), "shape")
        return make_model([helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape_bad")],
                          [helper.make_tensor_value_info("x", f, [1, 6])],
                          [helper.make_tensor_value_info("y", f, [4, 4])], [shape])
    if kind == "opset-99":
        return make_model([helper.make_node("Relu", ["x"], ["y"])],
                          [helper.make_tensor_value_info("x", f, [1, 4])],
                          [helper.make_tensor_value_info("y", f, [1, 4])], opset=99)
    if kind == "custom-domain":
        w = numpy_helper.from_array(np.ones((4, 2, 3, 3), np.float32), "w")
        g = helper.make_graph([helper.make_node("FusedConv", ["x", "w"], ["y"], name="fused_one",
                                                domain="com.microsoft", activation="Relu")], "g",
                              [helper.make_tensor_value_info("x", f, [1, 2, 8, 8])],
                              [helper.make_tensor_value_info("y", f, ["n", "c", "h", "w"])], [w])
        return helper.make_model(g, ir_version=8, opset_imports=[helper.make_opsetid("", 13),
                                                                 helper.make_opsetid("com.microsoft", 1)])
    if kind == "if":
        then_g = helper.make_graph([helper.make_node("Relu", ["x"], ["a"])], "then", [],
                                   [helper.make_tensor_value_info("a", f, [1, 4])])
        else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["b"])], "else", [],
                                   [helper.make_tensor_value_info("b", f, [1, 4])])
        return make_model([helper.make_node("If", ["cond"], ["y"], name="branch_one",
                                            then_branch=then_g, else_branch=else_g)],
                          [helper.make_tensor_value_info("x", f, [1, 4]),
                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", f, [1, 4])])
    if kind == "loop":
        body = helper.make_graph(
            [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
             helper.make_node("Add", ["acc_in", "acc_in"], ["acc_out"])], "body",
            [helper.make_tensor_value_info("i", TensorProto.INT64, []),
             helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
             helper.make_tensor_value_info("acc_in", f, [1, 4])],
            [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("acc_out", f, [1, 4])])
        trip = numpy_helper.from_array(np.array(3, np.int64), "trip")
        return make_model([helper.make_node("Loop", ["trip", "", "x"], ["y"], name="loop_one", body=body)],
                          [helper.make_tensor_value_info("x", f, [1, 4])],
                          [helper.make_tensor_value_info("y", f, [1, 4])], [trip])
    raise AssertionError(kind)


@pytest.mark.parametrize("kind,facts", [
    # refused from its shape, before anything is allocated, with the numbers and how to raise the budget
    ("huge-constant", ["'cos_huge' (ConstantOfShape)", "1000000000000 elements x 4 bytes = 4000000000000 bytes",
                       "over the weights budget of", "--max-weights-bytes 4T", "TINYDEPLOY_MAX_WEIGHTS_BYTES=4T"]),
    ("empty-graph", ["content.onnx", "empty graph"]),
    ("no-graph", ["content.onnx", "no graph"]),
    ("bad-reshape", ["Reshape"]),
    ("opset-99", ["99"]),
    ("custom-domain", ["unsupported operators", "com.microsoft:FusedConv x1", "fused_one"]),
    ("if", ["unsupported operators", "If x1", "branch_one"]),
    ("loop", ["unsupported operators", "Loop x1", "loop_one"]),
])
def test_hostile_model_content(tmp_path, kind, facts):
    save(_content_model(kind), tmp_path / "content.onnx")
    # `inspect` reports unsupported operators in its table (exit 0); malformed models are errors
    for cmd in ("build", "run") if "unsupported operators" in facts else ("build", "run", "inspect"):
        assert_user_error(cli_run(tmp_path, cmd, "content.onnx", timeout=60), *facts)


# ----------------------------------------------------------------------------------------------
# 8. run --inputs

def test_run_inputs_wrong_shape_dtype_name(tmp_path):
    tiny(tmp_path)
    x = np.zeros((1, 3, 4), np.float32)
    cases = {
        "shape.npz": ({"x": np.zeros((2, 2), np.float32)}, ["'x'", "float32 1x3x4", "2x2"]),
        "dtype.npz": ({"x": x.astype(np.float64)}, ["'x'", "float32 1x3x4", "float64"]),
        "name.npz": ({"not_x": x}, ["'x'", "float32 1x3x4", "not_x"]),
        "object.npz": ({"x": np.array([{"a": 1}], dtype=object)}, ["object.npz"]),
    }
    for fname, (arrays, _) in cases.items():
        np.savez(tmp_path / fname, **arrays)
    np.save(tmp_path / "single.npy", np.zeros((3, 4), np.float32))
    cases["single.npy"] = (None, ["'x'", "float32 1x3x4", "3x4"])
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 definitely not a zip")
    cases["junk.npz"] = (None, ["junk.npz"])
    cases["absent.npz"] = (None, ["absent.npz"])
    for fname, (_, facts) in cases.items():
        assert_user_error(cli_run(tmp_path, "run", "model.onnx", "--inputs", fname), *facts)
    np.savez(tmp_path / "good.npz", x=x)
    r = cli_run(tmp_path, "run", "model.onnx", "--inputs", "good.npz")
    assert r.returncode == 0 and "outputs match" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------------------------------------------
# 9. boards

def test_unknown_board_lists_known_boards(tmp_path, capsys, monkeypatch):
    tiny(tmp_path)
    for cmd in ("build", "run"):
        assert_user_error(cli_run(tmp_path, cmd, "model.onnx", "--board", "no_such_board"),
                          "'no_such_board'", "known boards", "host")
    assert_user_error(cli_inproc(capsys, monkeypatch, tmp_path, "build", "model.onnx", "--board", "x\n\x1b[2J"),
                      "known boards", "host", "\\x0a")
    assert not (tmp_path / "build").exists()
