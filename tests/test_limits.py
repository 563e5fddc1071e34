"""The weights budget (tinydeploy/limits.py): what a model may materialise is sized against this
machine's memory, refused in one line with the numbers and the way to raise it
(--max-weights-bytes / TINYDEPLOY_MAX_WEIGHTS_BYTES), and a model within it builds however small
its file: a 100 M-element ConstantOfShape weight builds for the host and matches onnxruntime.
The hostile 10^12-element constant is in test_bad_input.py (hostile model content)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinydeploy import cli, limits
from tinydeploy.codegen import cfmt
from tinydeploy.errors import TinydeployError
from test_bad_input import assert_user_error, cli_run, save
from util import check_model, make_model

F = TensorProto.FLOAT


def cos_matmul(k: int, n: int, fill: np.ndarray | None = None) -> onnx.ModelProto:
    """y = x[1,k] @ W[k,n], W a ConstantOfShape (as some exporters store a uniform FC weight)."""
    shape = numpy_helper.from_array(np.array([k, n], np.int64), "wshape")
    attrs = {"value": numpy_helper.from_array(fill, "v")} if fill is not None else {}
    return make_model([helper.make_node("ConstantOfShape", ["wshape"], ["w"], name="fc_weight", **attrs),
                       helper.make_node("MatMul", ["x", "w"], ["y"], name="fc")],
                      [helper.make_tensor_value_info("x", F, [1, k])],
                      [helper.make_tensor_value_info("y", F, [1, n])], [shape])


def stored_matmul(k: int, n: int) -> onnx.ModelProto:
    """The same with the weight stored in the file (nothing to fold)."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32), "w_stored")
    return make_model([helper.make_node("MatMul", ["x", "w_stored"], ["y"], name="fc")],
                      [helper.make_tensor_value_info("x", F, [1, k])],
                      [helper.make_tensor_value_info("y", F, [1, n])], [w])


# ----------------------------------------------------------------------------------------------
# sizes and the budget

@pytest.mark.parametrize("text,n", [("2G", 2 << 30), ("512M", 512 << 20), ("1.5g", 3 << 29), ("64KiB", 64 << 10),
                                    ("100000000", 100000000), ("3T", 3 << 40), (" 7 MB ", 7 << 20)])
def test_parse_size(text, n):
    assert limits.parse_size(text) == n


@pytest.mark.parametrize("text", ["10X", "", "-1", "0", "G", "1e9", "2 G B"])
def test_parse_size_refuses_with_the_flag_name(text):
    with pytest.raises(TinydeployError, match="--max-weights-bytes"):
        limits.parse_size(text)


def test_budget_from_meminfo_cgroup_and_fallback(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemFree:         100000 kB\nMemAvailable:    2400000 kB\n")
    monkeypatch.setattr(limits, "MEMINFO", str(meminfo))
    monkeypatch.setattr(limits, "CGROUP_FILES", ())
    monkeypatch.delenv(limits.ENV, raising=False)
    b = limits.budget()
    assert b.bytes == 2400000 * 1024 // limits.BUILD_BYTES_PER_WEIGHT_BYTE
    assert "MemAvailable 2.3 GiB" in b.how and f"/ {limits.BUILD_BYTES_PER_WEIGHT_BYTE} bytes" in b.how
    # a cgroup limit with less room left than MemAvailable says (a container) wins
    (tmp_path / "max").write_text(f"{1 << 30}\n")
    (tmp_path / "current").write_text(f"{256 << 20}\n")
    monkeypatch.setattr(limits, "CGROUP_FILES", ((str(tmp_path / "max"), str(tmp_path / "current")),))
    b = limits.budget()
    assert b.bytes == (768 << 20) // limits.BUILD_BYTES_PER_WEIGHT_BYTE and "cgroup" in b.how
    (tmp_path / "max").write_text("max\n")           # no limit set: MemAvailable again
    assert limits.budget().bytes == 2400000 * 1024 // limits.BUILD_BYTES_PER_WEIGHT_BYTE
    # no MemAvailable line (or no /proc): half the physical memory, never zero
    monkeypatch.setattr(limits, "MEMINFO", str(tmp_path / "absent"))
    b = limits.budget()
    assert b.bytes > 0 and "no MemAvailable" in b.how
    # the environment variable, then an explicit number (the flag), override the machine
    monkeypatch.setenv(limits.ENV, "3M")
    assert limits.budget() == limits.Budget(3 << 20, f"set by {limits.ENV}")
    assert limits.budget(5 << 20) == limits.Budget(5 << 20, f"set by {limits.FLAG}")


# ----------------------------------------------------------------------------------------------
# the flag and the variable, through the CLI

def test_small_limit_refuses_folded_constant_naming_node_numbers_and_flag(tmp_path):
    save(cos_matmul(1000, 1000), tmp_path / "cos.onnx")      # 1 M floats, 4 MB, from a ~200-byte file
    size = (tmp_path / "cos.onnx").stat().st_size
    for cmd in ("build", "run", "inspect"):
        assert_user_error(cli_run(tmp_path, cmd, "cos.onnx", "--max-weights-bytes", "1M"),
                          "'fc_weight' (ConstantOfShape)", "1000000 elements x 4 bytes = 4000000 bytes",
                          f"from a {size} B model file", "weights budget of 1.0 MiB (1048576 bytes; set by "
                          "--max-weights-bytes)", "--max-weights-bytes 4M", "TINYDEPLOY_MAX_WEIGHTS_BYTES=4M")
    r = cli_run(tmp_path, "run", "cos.onnx", "--max-weights-bytes", "4M")
    assert r.returncode == 0 and "outputs match" in r.stdout, r.stdout + r.stderr


def test_small_limit_refuses_stored_weights_the_c_would_hold(tmp_path):
    save(stored_matmul(1000, 1000), tmp_path / "fc.onnx")     # nothing folds: the C check refuses
    assert_user_error(cli_run(tmp_path, "build", "fc.onnx", "--max-weights-bytes", "2M"),
                      "the C would hold 1 weight tensor, ",   # w_stored, re-laid (padded to the ISA's panels)
                      " bytes (largest '",
                      "weights budget of 2.0 MiB", "--max-weights-bytes 4M")
    r = cli_run(tmp_path, "build", "fc.onnx", "--max-weights-bytes", "8M")
    assert r.returncode == 0, r.stderr


def test_environment_variable_and_flag_precedence(tmp_path, monkeypatch):
    save(cos_matmul(1000, 1000), tmp_path / "cos.onnx")
    monkeypatch.setenv(limits.ENV, "1K")
    assert_user_error(cli_run(tmp_path, "inspect", "cos.onnx"), "weights budget of 1.0 KiB (1024 bytes; set by "
                      "TINYDEPLOY_MAX_WEIGHTS_BYTES)", "--max-weights-bytes 4M")
    r = cli_run(tmp_path, "inspect", "cos.onnx", "--max-weights-bytes", "64M")   # the flag wins
    assert r.returncode == 0 and "MatMul" in r.stdout, r.stderr
    monkeypatch.setenv(limits.ENV, "lots")
    assert_user_error(cli_run(tmp_path, "inspect", "cos.onnx"), "TINYDEPLOY_MAX_WEIGHTS_BYTES 'lots' is not a size")
    assert_user_error(cli_run(tmp_path, "build", "cos.onnx", "--max-weights-bytes", "0"),
                      "--max-weights-bytes must be at least 1 byte")


def test_issue_b_model_is_bounded_by_the_machine(tmp_path, monkeypatch, capsys):
    """A ~200-byte model asking for 2^26 floats (256 MiB, ~1 GB of C): on a machine with 4 GiB
    available it is refused, with the budget's derivation; expansion itself is not the fault."""
    save(cos_matmul(1 << 13, 1 << 13), tmp_path / "b.onnx")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable: {4 << 20} kB\n")
    monkeypatch.setattr(limits, "MEMINFO", str(meminfo))
    monkeypatch.setattr(limits, "CGROUP_FILES", ())
    monkeypatch.delenv(limits.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["inspect", "b.onnx"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("tinydeploy: error:"), err
    for fact in ("'fc_weight' (ConstantOfShape)", "67108864 elements x 4 bytes = 268435456 bytes (256.0 MiB)",
                 f"this machine: MemAvailable 4.0 GiB / {limits.BUILD_BYTES_PER_WEIGHT_BYTE} bytes of build memory "
                 "per weight byte",
                 "--max-weights-bytes 257M"):   # with the 16-byte shape
        assert fact in err, (fact, err)


# ----------------------------------------------------------------------------------------------
# large weights: the byte string, and a 100 M-element constant end to end

def _string_body_reference(data: bytes, per_line: int) -> str:
    """The blob's text byte by byte: what cfmt.c_string_body must produce, faster."""
    lines = ['  "' + "".join(cfmt._ESC[b] for b in data[i:i + per_line]) + '"' for i in range(0, len(data), per_line)]
    return "\n".join(lines)


def test_string_body_matches_byte_by_byte_escaping(monkeypatch):
    monkeypatch.setattr(cfmt, "_CHUNK_LINES", 3)             # many chunks, and chunk boundaries inside
    rng = np.random.default_rng(0)
    cases = [b"", b"\0", bytes(range(256)) * 3, b'"?\\??/' * 40, bytes(97)]
    cases += [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (1, 31, 32, 33, 95, 96, 97, 1000)]
    for data in cases:
        for per_line in (1, 7, 32):
            assert cfmt.c_string_body(data, per_line) == _string_body_reference(data, per_line)
            assert cfmt.c_string_body(bytearray(data), per_line) == _string_body_reference(data, per_line)


@pytest.mark.slow
def test_100m_element_constant_of_shape_builds_for_host_and_matches(tmp_path, monkeypatch):
    """Issue A: VGG-16's fc6, 25088 x 4096 = 102.8 M floats (411 MB), stored as a ConstantOfShape
    of a ~200-byte file. The fill's four bytes are printable ASCII ("AAA<", 0.0118), so the C is
    ~1.2 characters per weight byte (zero bytes would be 4.2): a ~1 minute, ~3 GB test instead of
    ~7 GB; the escaping of every byte value is checked above. The budget is set explicitly: the
    default, sized for the worst case (zero weights), needs ~10 GB free for this model, which a
    shared CI machine may not have at that moment; test_budget_from_meminfo_cgroup_and_fallback
    checks the default's derivation."""
    monkeypatch.setenv(limits.ENV, "1G")
    fill = np.frombuffer(b"AAA<", np.float32).copy()
    path = save(cos_matmul(25088, 4096, fill), tmp_path / "fc6.onnx")
    assert path.stat().st_size < 300
    x = {"x": np.random.default_rng(0).standard_normal((1, 25088)).astype(np.float32)}
    res = check_model(path, tmp_path, feeds=x, variants=("gcc",))
    assert res["outputs_match"]
    from tinydeploy.build import MARKER
    import json
    summary = json.loads((tmp_path / "build-gcc" / MARKER).read_text())["summary"]
    assert summary["weights_bytes"] == 25088 * 4096 * 4
    assert any(n.startswith("constant folding made 392.0 MiB of constants from a") for n in summary["notes"]), summary
