"""Issue 12: the faults an adversarial probe found, one test each (each failed before the fix).
Models tinydeploy must refuse up front with one line naming the node and the reason (the
verifier, tinydeploy/ops/verify.py), files and paths, inputs, and boards. The firmware's own
findings are in test_protocol.py (bounded counts, late bytes of a timed-out bulk load) and
test_harness_host.py (64-bit tick totals); the huge ConstantOfShape in
test_limits.py::test_issue_b_model_is_bounded_by_the_machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fakeboard import FakeBoard
from test_bad_input import assert_user_error, cli_inproc, cli_run, save, tiny
from tinydeploy import flow, reference
from tinydeploy.commands.common import json_safe
from util import REPO, make_model, mlperf_model

F = TensorProto.FLOAT


def vi(name, shape, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def const(name, a):
    return numpy_helper.from_array(np.asarray(a), name)


def kws_int8_with(tmp_path: Path, change, name="kws.onnx") -> Path:
    m = onnx.load(mlperf_model("kws_dscnn_int8.onnx"))
    change(m)
    return save(m, tmp_path / name)


def set_attr(node, name, value):
    for a in list(node.attribute):
        if a.name == name:
            node.attribute.remove(a)
    node.attribute.append(helper.make_attribute(name, value))


def convs(m):
    return [n for n in m.graph.node if n.op_type == "Conv"]


def one_line(r) -> str:
    """The error line of exit 2: one line, nothing from onnxruntime or numpy besides it."""
    return assert_user_error(r)


# ----------------------------------------------------------------------------------------------
# the verifier: what onnxruntime or the ONNX specification refuses never reaches code generation

@pytest.mark.parametrize("group", [3, 0, 1000])
def test_conv_group_is_checked_against_channels_and_weights(tmp_path, group):
    """High: group=3 on the 64-channel KWS convolution built with exit 0 and read out of bounds;
    group=0 was a ZeroDivisionError (exit 3), group=1000 C that did not compile."""
    p = kws_int8_with(tmp_path, lambda m: set_attr(convs(m)[2], "group", group))
    for cmd in (("build",), ("run",)) if group == 3 else (("build",),):
        msg = one_line(cli_run(tmp_path, *cmd, p.name))
        assert "the model is invalid" in msg and "Conv 'functional_1/activation_2/Relu" in msg, msg
        assert f"group {group}" in msg, msg


def _refused_by_onnxruntime(kind: str) -> tuple[onnx.ModelProto, list[str]]:
    w = const("w", np.ones((2, 2, 3, 3), np.float32))
    x = [vi("x", [1, 2, 4, 4])]
    if kind == "batch-0":
        return make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", [0, 2, 4])],
                          [vi("y", [0, 2, 4])]), ["'x'", "empty", "0x2x4"]
    if kind == "no-outputs":
        return make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], x, []), ["no outputs"]
    if kind == "kernel-shape":
        return make_model([helper.make_node("Conv", ["x", "w"], ["y"], name="conv_k", kernel_shape=[2, 2])], x,
                          [vi("y", [1, 2, 3, 3])], [w]), ["Conv 'conv_k'", "kernel_shape [2, 2] differs from the weights' [3, 3]"]
    if kind == "auto-pad":
        return make_model([helper.make_node("Conv", ["x", "w"], ["y"], name="conv_a", auto_pad="FOO")], x,
                          [vi("y", [1, 2, 2, 2])], [w]), ["Conv 'conv_a'", "auto_pad 'FOO'"]
    if kind == "kernel-larger":
        return make_model([helper.make_node("Conv", ["x", "w"], ["y"], name="conv_d", dilations=[3, 3])], x,
                          [vi("y", [1, 2, 1, 1])], [w]), ["conv_d"]
    if kind == "pool-pads":
        return make_model([helper.make_node("MaxPool", ["x"], ["y"], name="pool_p", kernel_shape=[2, 2],
                                            pads=[2, 2, 2, 2])], x, [vi("y", [1, 2, 7, 7])]), \
            ["MaxPool 'pool_p'", "smaller than the kernel"]
    if kind == "reflect-pad":
        return make_model([helper.make_node("Pad", ["x", "p"], ["y"], name="pad_r", mode="reflect")], x,
                          [vi("y", [1, 2, 12, 4])], [const("p", np.array([0, 0, 4, 0, 0, 0, 4, 0], np.int64))]), \
            ["Pad 'pad_r'", "reflect pads 4 and 4 on axis 2, which has 4 elements"]
    if kind == "duplicate-names":
        return make_model([helper.make_node("Relu", ["x"], ["a"], name="same"),
                           helper.make_node("Sigmoid", ["a"], ["y"], name="same")], x, [vi("y", [1, 2, 4, 4])]), \
            ["'same'", "unique"]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["batch-0", "no-outputs", "kernel-shape", "auto-pad", "kernel-larger", "pool-pads",
                                  "reflect-pad", "duplicate-names"])
def test_what_onnxruntime_refuses_is_refused_before_building(tmp_path, kind):
    """`run` used to exit 3 with onnxruntime's multi-line text after building these."""
    m, facts = _refused_by_onnxruntime(kind)
    save(m, tmp_path / "m.onnx")
    msg = assert_user_error(cli_run(tmp_path, "run", "m.onnx"), *facts)
    assert "refuses this model" not in msg, msg      # refused by tinydeploy, not by onnxruntime afterwards
    assert not (tmp_path / "build").exists()         # and nothing was made


def test_everything_invalid_is_listed_at_once(tmp_path):
    w = const("w", np.ones((2, 2, 3, 3), np.float32))
    m = make_model([helper.make_node("Conv", ["x", "w"], ["c"], name="conv_bad", group=0),
                    helper.make_node("LRN", ["c"], ["l"], name="lrn_bad", size=0),
                    helper.make_node("Softmax", ["l"], ["y"], name="ok")],
                   [vi("x", [1, 2, 4, 4])], [vi("y", [1, 2, 2, 2])], [w])
    save(m, tmp_path / "m.onnx")
    assert_user_error(cli_run(tmp_path, "build", "m.onnx"), "(2 problems)", "Conv 'conv_bad': group 0 must be >= 1",
                      "LRN 'lrn_bad': size 0 must be an odd number")


def qdq(scale) -> onnx.ModelProto:
    return make_model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="quant"),
                       helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dequant")],
                      [vi("x", [1, 8])], [vi("y", [1, 8])],
                      [const("s", np.array(scale, np.float32)), const("z", np.array(0, np.int8))])


@pytest.mark.parametrize("scale,kind", [(0.0, "zero"), (float("nan"), "not a number"), (-0.5, "negative"),
                                        (1e-40, "denormal"), (float("inf"), "infinite")])
def test_qdq_scales_must_be_positive_finite_and_normal(tmp_path, scale, kind):
    save(qdq(scale), tmp_path / "q.onnx")
    assert_user_error(cli_run(tmp_path, "run", "q.onnx"), "QuantizeLinear 'quant'", kind, "DequantizeLinear 'dequant'")


def test_a_huge_scale_runs_in_float_and_matches(tmp_path):
    """A scale of 1e30 built silently and disagreed with onnxruntime (its requantisation ratio is
    outside what the fixed-point multiplier holds): the island now runs in float32."""
    def huge(m):
        t = next(t for t in m.graph.initializer if t.name == "scale__95")   # a depthwise layer's output scale
        t.CopyFrom(numpy_helper.from_array(np.array(numpy_helper.to_array(t) * 1e30, np.float32), t.name))
    p = kws_int8_with(tmp_path, huge)
    r = cli_run(tmp_path, "run", p.name, "--json", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["outputs_match"] is True


@pytest.mark.parametrize("case", ["pow-int64", "2^31-elements"])
def test_valid_onnx_the_c_cannot_hold_is_refused_with_the_reason(tmp_path, case):
    if case == "pow-int64":
        m = make_model([helper.make_node("Pow", ["x", "e"], ["y"], name="pow_i")], [vi("x", [1, 4])], [vi("y", [1, 4])],
                       [const("e", np.array(2, np.int64))])
        facts = ["Pow", "pow_i", "int64 constant input"]
    else:
        m = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", [2, 1024, 1024, 1024])],
                       [vi("y", [2, 1024, 1024, 1024])])
        facts = ["'x'", "2147483648 elements", "at most 2147483647"]
    save(m, tmp_path / "m.onnx")
    msg = assert_user_error(cli_run(tmp_path, "build", "m.onnx"), *facts)
    assert "tinydeploy bug" not in msg


# ----------------------------------------------------------------------------------------------
# malformed files: exit 2, not 3

def _matmul(w):
    return make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [vi("x", [1, 4])], [vi("y", [1, 4])], [w])


def test_initializer_data_longer_than_its_dims(tmp_path):
    w = const("w", np.ones((4, 4), np.float32))
    w.raw_data = w.raw_data + bytes(16)
    save(_matmul(w), tmp_path / "m.onnx")
    assert_user_error(cli_run(tmp_path, "build", "m.onnx"), "'w'", "80 bytes", "4x4 need 64")


def test_stated_shapes_that_contradict_the_operators(tmp_path):
    """Found by the long fuzz run (a Conv's pads changed; the model's value_info kept the old
    shape): tinydeploy re-derived the shapes and built, onnxruntime then failed planning its
    buffers by the stated ones (exit 3 before the fix)."""
    w = const("w", np.ones((2, 2, 1, 1), np.float32))
    m = make_model([helper.make_node("Conv", ["x", "w"], ["c"], name="conv0", pads=[0, 0, 0, 2]),
                    helper.make_node("Relu", ["c"], ["y"], name="relu0")],
                   [vi("x", [1, 2, 4, 4])], [vi("y", [1, 2, 4, 6])], [w])
    m.graph.value_info.append(vi("c", [1, 2, 4, 4]))
    save(m, tmp_path / "m.onnx")
    msg = assert_user_error(cli_run(tmp_path, "run", "m.onnx"), "'c' is stated as 1x2x4x4", "1x2x4x6")
    assert "refuses this model" not in msg, msg


def test_old_opset_forms_onnxruntime_has_no_kernel_for(tmp_path):
    """Found by the long fuzz run (opset set to 1): the converter took Add-1 to opset 13 and built
    it, onnxruntime, the reference, then answered NOT_IMPLEMENTED (exit 3 before the fix)."""
    m = make_model([helper.make_node("Add", ["x", "x"], ["y"], name="add0")], [vi("x", [1, 4])], [vi("y", [1, 4])],
                   opset=1)
    m.ir_version = 3
    save(m, tmp_path / "m.onnx")
    msg = assert_user_error(cli_run(tmp_path, "run", "m.onnx"), "opset 1", "Add (version 1)", "opset 7 or later")
    assert "refuses this model" not in msg, msg


def test_lrn_size_zero(tmp_path):
    save(make_model([helper.make_node("LRN", ["x"], ["y"], name="lrn0", size=0)], [vi("x", [1, 2, 4, 4])],
                    [vi("y", [1, 2, 4, 4])]), tmp_path / "m.onnx")
    assert_user_error(cli_run(tmp_path, "build", "m.onnx"), "LRN 'lrn0'", "size 0")


@pytest.mark.parametrize("offset,location,fact", [("abc", "w.bin", "offset 'abc'"), ("-5", "w.bin", "offset '-5'"),
                                                  ("0", "w\0.bin", "no file name"), ("0", "", "no file name")])
def test_bad_external_data_entries(tmp_path, offset, location, fact):
    m = _matmul(const("w", np.ones((4, 4), np.float32)))
    t = m.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", offset), ("length", "64")):
        e = t.external_data.add()
        e.key, e.value = k, v
    save(m, tmp_path / "m.onnx")
    (tmp_path / "w.bin").write_bytes(bytes(64))
    assert_user_error(cli_run(tmp_path, "build", "m.onnx"), "'w'", fact)


@pytest.mark.parametrize("case", ["dangling", "loop", "file/sub", "/proc/x", "long"])
def test_output_folders_that_cannot_be_made(tmp_path, case):
    tiny(tmp_path)
    (tmp_path / "dangling").symlink_to("nowhere")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "file").write_text("mine\n")
    out = "a" * 300 if case == "long" else case
    facts = {"dangling": ["leads nowhere"], "loop": ["leads nowhere", "symbolic links"], "file/sub": ["Not a directory"],
             "/proc/x": ["cannot create output folder"], "long": ["File name too long"]}[case]
    assert_user_error(cli_run(tmp_path, "build", "model.onnx", "-o", out), *facts)
    assert (tmp_path / "file").read_text() == "mine\n"


def test_model_paths_that_cannot_be_read(tmp_path):
    os.mkfifo(tmp_path / "fifo.onnx")
    assert_user_error(cli_run(tmp_path, "build", "fifo.onnx", timeout=60), "'fifo.onnx'", "not a file (a FIFO)")
    assert_user_error(cli_run(tmp_path, "build", "b" * 300 + ".onnx"), "File name too long")


# ----------------------------------------------------------------------------------------------
# results: identical infinities agree, and JSON stays JSON

def test_identical_infinities_match_and_json_has_no_nan(tmp_path):
    """x / 0 gives the same +-inf in both: `run` said they differ and printed a numpy warning."""
    m = make_model([helper.make_node("Div", ["x", "z"], ["y"], name="div")], [vi("x", [1, 4])], [vi("y", [1, 4])],
                   [const("z", np.zeros((1, 4), np.float32))])
    save(m, tmp_path / "m.onnx")
    r = cli_run(tmp_path, "run", "m.onnx", "--json")
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr
    res = json.loads(r.stdout)
    assert res["outputs_match"] is True and res["max_abs_error"] == 0.0
    inf, nan = float("inf"), float("nan")
    c = reference.compare([np.array([inf, -inf, nan, 1.0], np.float32)], [np.array([inf, -inf, nan, 1.0])], 1e-4)
    assert c == {"outputs_match": True, "max_abs_error": 0.0, "max_rel_error": 0.0}
    for got in ([inf, 1.0], [nan, 1.0], [-inf, 1.0]):
        c = reference.compare([np.array(got, np.float32)], [np.array([1.0, 1.0])], 1e-4)
        assert c["outputs_match"] is False and c["max_abs_error"] == inf and c["max_rel_error"] == inf
        assert c["note"] == "1 output element is NaN or infinite in one result and not the same in the other"
    text = json.dumps(json_safe({"a": inf, "b": [nan, 1.5], "c": {"d": -inf}}), allow_nan=False)
    assert json.loads(text) == {"a": None, "b": [None, 1.5], "c": {"d": None}}


def test_internal_error_line_is_sanitised(tmp_path, capsys, monkeypatch):
    tiny(tmp_path)

    def boom(*a, **k):
        raise RuntimeError("model text \x1b[2J\nsecond line\r")
    monkeypatch.setattr(flow, "run", boom)
    r = cli_inproc(capsys, monkeypatch, tmp_path, "run", "model.onnx")
    assert r.returncode == 3
    assert r.stderr.count("\n") == 1 and "\x1b" not in r.stderr and "\r" not in r.stderr, repr(r.stderr)
    assert "model text \\x1b[2J\\x0asecond line\\x0d" in r.stderr


# ----------------------------------------------------------------------------------------------
# files: links, ownership, temporary folders

def test_a_symlink_planted_in_an_output_folder_is_not_followed(tmp_path):
    tiny(tmp_path)
    assert cli_run(tmp_path, "build", "model.onnx", "-o", "out").returncode == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("outside the folder\n")
    (tmp_path / "out" / "model.c").unlink()
    (tmp_path / "out" / "model.c").symlink_to(victim)
    tiny(tmp_path, shape=(1, 3, 5))                      # a different model: model.c changes
    r = cli_run(tmp_path, "build", "model.onnx", "-o", "out")
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "outside the folder\n"
    assert not (tmp_path / "out" / "model.c").is_symlink() and "td_run" in (tmp_path / "out" / "model.c").read_text()


@pytest.mark.parametrize("marker", ["{}", '{"tool": "tinydeploy"}', '{"tool": "tinydeploy", "files": {}}'])
def test_a_marker_file_alone_does_not_make_a_folder_tinydeploys(tmp_path, marker):
    tiny(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".tinydeploy.json").write_text(marker)
    (out / "main.c").write_text("/* mine */\n")
    msg = assert_user_error(cli_run(tmp_path, "build", "model.onnx", "-o", "out"))
    assert "--force" in msg
    assert (out / "main.c").read_text() == "/* mine */\n"


def test_build_quantize_leaves_no_temporary_folders(tmp_path):
    w = const("w", np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32))
    m = make_model([helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])],
                   [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])], [w])
    save(m, tmp_path / "f.onnx")
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(1).standard_normal((8, 1, 3, 8, 8)).astype(np.float32))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    for args, code in ((["--calibration", "cal.npz"], 0), (["--calibration", "missing.npz"], 2)):
        r = subprocess.run([sys.executable, "-m", "tinydeploy", "build", "f.onnx", "--quantize", "int8", *args,
                            "-o", "q"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == code, r.stderr
        # (onnxruntime 1.32 itself keeps a file $TMPDIR/.ses, made when it is imported)
        assert [p.name for p in tmp.iterdir() if p.is_dir() or "tinydeploy" in p.name] == [], r.stderr


# ----------------------------------------------------------------------------------------------
# --inputs: regular files only, bounded, clear about types and byte order

def test_inputs_from_a_fifo_do_not_block(tmp_path):
    tiny(tmp_path)
    os.mkfifo(tmp_path / "in.npz")
    t = time.monotonic()
    assert_user_error(cli_run(tmp_path, "run", "model.onnx", "--inputs", "in.npz", timeout=120), "'in.npz'", "FIFO")
    assert time.monotonic() - t < 100


def test_unused_arrays_of_an_npz_are_never_read(tmp_path):
    """1 MB of compressed zeros that expand to 1 GB, beside the one array the model needs."""
    tiny(tmp_path)
    x = np.random.default_rng(0).standard_normal((1, 3, 4)).astype(np.float32)
    np.savez_compressed(tmp_path / "in.npz", x=x, junk=np.zeros((1 << 28,), np.float32))
    assert (tmp_path / "in.npz").stat().st_size < 2 << 20
    tracemalloc.start()
    try:
        got = flow.load_inputs(tmp_path / "in.npz", [("x", (1, 3, 4), np.dtype(np.float32))])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(got["x"], x) and peak < 8 << 20, peak
    r = cli_run(tmp_path, "run", "model.onnx", "--inputs", "in.npz")
    assert r.returncode == 0 and "outputs match" in r.stdout, r.stderr


def test_an_array_bigger_than_the_input_is_refused_from_its_header(tmp_path):
    tiny(tmp_path)
    np.savez_compressed(tmp_path / "in.npz", x=np.zeros((1 << 26,), np.float32))
    assert_user_error(cli_run(tmp_path, "run", "model.onnx", "--inputs", "in.npz"), "expected float32 1x3x4",
                      "got float32 67108864")


def test_big_endian_inputs_are_named_as_such(tmp_path):
    tiny(tmp_path)
    np.save(tmp_path / "be.npy", np.zeros((1, 3, 4), ">f4"))
    assert_user_error(cli_run(tmp_path, "run", "model.onnx", "--inputs", "be.npy"), "expected float32 1x3x4",
                      "got big-endian float32 (>f4", "little-endian")


# ----------------------------------------------------------------------------------------------
# boards: every wait bounded by --timeout, bad replies are the board's fault

def _add_model(tmp_path: Path) -> Path:
    v = lambda n: vi(n, [1, 8])  # noqa: E731
    return save(make_model([helper.make_node("Add", ["a", "b"], ["y"], name="add")], [v("a"), v("b")], [v("y")]),
                tmp_path / "add.onnx")


def _measure(tmp_path, url, *extra, timeout=600):
    return cli_run(tmp_path, "measure", "--board", "mps2-an386", "--port", url, "add.onnx", "-o", "fw", *extra,
                   timeout=timeout)


@pytest.mark.parametrize("option,value", [("--timeout", "inf"), ("--timeout", "nan"), ("--timeout", "-1"),
                                          ("--timeout", "0"), ("--runs", "-3"), ("--runs", "0")])
def test_measure_options_are_validated(tmp_path, option, value):
    _add_model(tmp_path)
    assert_user_error(_measure(tmp_path, "loop://", option, value), option, repr(value))
    assert not (tmp_path / "fw").exists()


def test_measure_timeout_bounds_the_inference_and_a_dropped_connection_is_said(tmp_path):
    """`measure --timeout 3` waited a fixed 600 s for infer; a connection the board dropped was
    reported as "no complete reply within 600 s" after 2 s."""
    _add_model(tmp_path)
    with FakeBoard(32, "silent-infer") as fb:
        t = time.monotonic()
        msg = assert_user_error(_measure(tmp_path, fb.url, "--timeout", "3", timeout=300), "infer 1 0%", "within 3 s")
        assert any(s.startswith("infer") for s in fb.seen), fb.seen
    assert time.monotonic() - t < 240, msg
    with FakeBoard(32, "drop-on-infer") as fb:
        msg = assert_user_error(_measure(tmp_path, fb.url, "--timeout", "200", timeout=600), "connection to the board was lost")
        assert "within" not in msg


@pytest.mark.parametrize("fault,facts", [("bad-results", ["m-results-[abc,1.0]", "'abc' is not a number"]),
                                         ("bad-raw", ["m-raw-zzzz", "hexadecimal"]),
                                         ("zero-hz", ["hz-0", "0 Hz"])])
def test_malformed_board_replies_are_the_boards_fault(tmp_path, fault, facts):
    _add_model(tmp_path)
    with FakeBoard(32, fault) as fb:
        assert_user_error(_measure(tmp_path, fb.url, "--timeout", "20"), "the board answered", "malformed", *facts)
