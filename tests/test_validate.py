"""`tinydeploy validate`: the capture build hands over every layer's outputs (host file records;
the firmware's `capture T%` one layer at a time, CRC-checked), each is held against the
reference of the same tensor, and the first layer beyond the tolerance is named with its cause.

What is proved here (issue 15's acceptance, tests/README.md):
  * every layer of real models listed with its metrics, exit 0 (KWS and IC int8, a FP32 model
    with fused Conv+BatchNormalization+Relu compared at the Relu's output);
  * the tensors captured under QEMU Cortex-M4 (mps2-an386, nano33ble --emulate) and under
    qemu-aarch64 equal the host build's bit for bit (8-bit: same arithmetic everywhere; FP32:
    with the portable kernels on both sides, the same C);
  * a fault planted in one layer (TD_TEST_FAULT_STEP: its output moved by 2 LSB in the arena) is
    named exactly, as a kernel fault, on the host and under QEMU;
  * onnxruntime's fast session as the reference, on a uint8 layer whose u8 x s8 pairs saturate,
    under qemu-x86_64 -cpu Haswell (an AVX2 CPU without VNNI on every machine): the cause is
    named as saturation in the reference.
The whole matrix of the issue (eight MLPerf Tiny models, the uint8 models of `tinydeploy
quantize`, ResNet-18, every board) runs with TINYDEPLOY_ACCEPTANCE=1 (about 12 minutes)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import zlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinydeploy import flow, reference, runners, validate as val
from tinydeploy.errors import TinydeployError
from tinydeploy.runners import protocol
from util import REPO, make_model, mlperf_model, require, save

KWS8 = "kws_dscnn_int8.onnx"
FAULT_STEP = 5          # KWS int8: the third QConv (a 1x1 convolution on the DSP kernels under QEMU)


def td(*args, cwd, timeout=900):
    """The command line in a fresh process (the acceptance matrix; the Haswell test runs its own)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "tinydeploy", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout, env=env)


def cli(*args):
    """The command line in this process (no interpreter start-up): (exit code, stdout, stderr)."""
    from tinydeploy.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def capture(model, board, outdir, emulate=False, feeds=None, seed=0, extra=()):
    """The capture build of `model` for `board`, run once: (Capture, feeds)."""
    b = flow.build(model, board, outdir, quiet=True, extra_cflags=flow.CAPTURE_CFLAGS + list(extra), emulate=emulate,
                   reuse=True)
    specs = flow.io_specs(b.summary, "inputs")
    feeds = feeds or reference.random_inputs(specs, seed)
    out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
    with runners.select_runner(b.summary["board"], emulate) as r:
        cap = r.capture(b.exe if b.firmware is None else b.firmware, [feeds[n] for n, _, _ in specs], out_specs)
    return cap, feeds, b


def conv_bn_relu_model() -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu -> MaxPool -> Reshape -> Gemm: fused into one layer."""
    rng = np.random.default_rng(0)
    c = lambda name, a: numpy_helper.from_array(np.asarray(a, np.float32), name)   # noqa: E731
    inits = [c("w", rng.standard_normal((8, 3, 3, 3)) * 0.3), c("s", rng.uniform(0.5, 1.5, 8)),
             c("b", rng.standard_normal(8) * 0.1), c("m", rng.standard_normal(8) * 0.1), c("v", rng.uniform(0.5, 2, 8)),
             c("fw", rng.standard_normal((10, 8 * 4 * 4)) * 0.1), c("fb", rng.standard_normal(10) * 0.1),
             numpy_helper.from_array(np.array([1, -1], np.int64), "shape")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["conv"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("BatchNormalization", ["conv", "s", "b", "m", "v"], ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["relu"], name="relu"),
             helper.make_node("MaxPool", ["relu"], ["pool"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
             helper.make_node("Reshape", ["pool", "shape"], ["flat"], name="flat"),
             helper.make_node("Gemm", ["flat", "fw", "fb"], ["y"], transB=1, name="fc")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)


# ---- the metrics and the mapping ------------------------------------------------------------

def test_metrics():
    want = np.array([1.0, -2.0, 3.0, 0.0], np.float32)
    m = val.Stats().add(want.copy(), want, None).metrics()
    assert m["identical_fraction"] == 1.0 and m["max_abs_error"] == 0 and m["rel_l2"] == 0 and m["snr_db"] is None
    assert m["cosine"] == pytest.approx(1.0) and m["max_lsb"] is None
    got = want + np.array([0.0, 0.0, 0.1, 0.0], np.float32)
    m = val.Stats().add(got, want, None).metrics()
    assert m["identical_fraction"] == 0.75 and m["max_abs_error"] == pytest.approx(0.1, rel=1e-5)
    assert m["rel_l2"] == pytest.approx(0.1 / np.sqrt(14), rel=1e-5)
    assert m["snr_db"] == pytest.approx(10 * np.log10(14 / 0.01), rel=1e-5)
    assert m["mae"] == pytest.approx(0.025, rel=1e-5) and m["rmse"] == pytest.approx(0.05, rel=1e-5)
    assert not val.within(m, 1e-4) and val.within(m, 0.04)
    # 8-bit: errors in LSB, metrics in real units (scale, zero point)
    q = val.Stats().add(np.array([10, 12, -5], np.int8), np.array([10, 10, -4], np.int8), (0.5, 2)).metrics()
    assert q["max_lsb"] == 2 and q["max_abs_error"] == 1.0 and q["identical_fraction"] == pytest.approx(1 / 3)
    assert not val.within(q, 1e-4)
    assert val.within(val.Stats().add(np.array([3], np.uint8), np.array([4], np.uint8), (1.0, 0)).metrics(), 0)
    # a data set: the sums over every sample
    s = val.Stats().add(got, want, None).add(want, want, None)
    assert s.metrics()["identical_fraction"] == 7 / 8 and s.metrics()["max_abs_error"] == pytest.approx(0.1, rel=1e-5)


def test_layout_and_copies_map_back_to_onnx():
    """A tensor stored channels-last comes back in ONNX's layout; a copy made for a graph output
    is compared with that output; views are their input's bytes."""
    x = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    stored = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).reshape(-1)
    out = {"name": "t", "shape": [1, 2, 3, 4], "dtype": "float32", "layout": [0, 2, 3, 1]}
    assert np.array_equal(val.logical(stored, out), x)
    schedule = {"inputs": ["in"], "outputs": ["y_out0"], "steps": [
        {"step": 0, "op": "Conv", "onnx_op": "Conv+Relu", "name": "c", "inputs": ["in"], "code": True,
         "outputs": [dict(out, name="relu")]},
        {"step": 1, "op": "Reshape", "onnx_op": "Reshape", "name": "r", "inputs": ["relu"], "code": False,
         "outputs": [{"name": "flat", "shape": [1, 24], "dtype": "float32", "layout": None}]},
        {"step": 2, "op": "Copy", "onnx_op": "Copy", "name": "copy", "inputs": ["flat"], "code": True,
         "outputs": [{"name": "y_out0", "shape": [1, 24], "dtype": "float32", "layout": None}]}]}
    mine = val.target_tensors(schedule, {(0, 0): stored, (2, 0): x.reshape(-1)}, {"in": np.zeros(3, np.float32)})
    assert np.array_equal(mine["relu"], x) and np.array_equal(mine["flat"], x.reshape(1, 24))
    assert val.onnx_names(schedule, {"relu", "flat"}) == {"relu": "relu", "flat": "flat", "y_out0": "flat"}


# ---- the host: every layer, fusion, the fault, the data set -----------------------------------

def test_fp32_fused_layer_is_compared_at_the_relu(tmp_path):
    path = save(conv_bn_relu_model(), tmp_path)
    code, out, err = cli("validate", path, "--json", "-o", tmp_path / "b", "--profile", "--report", tmp_path / "v.html")
    assert code == 0, err
    res = json.loads(out)
    assert set(res) >= {"model", "board", "outputs_match", "first_divergent_layer", "layers"}
    assert res["outputs_match"] and res["first_divergent_layer"] is None
    by_name = {x["name"]: x for x in res["layers"]}
    conv = by_name["relu"]      # Conv+BatchNormalization+Relu: one layer, compared at the Relu's output
    assert conv["op"] == "Conv+BatchNormalization+Relu" and conv["shape"] == [1, 8, 8, 8]
    assert set(by_name) == {"relu", "pool", "y"}
    for x in res["layers"]:
        assert {"step", "op", "name", "shape", "max_abs_error", "max_lsb", "identical_fraction", "cosine", "rel_l2",
                "snr_db"} <= set(x)
        assert x["max_lsb"] is None and x["within_tolerance"] and x["cosine"] > 0.999999 and x["cost"] > 0
    assert res["profile"]["unit"] == "us"
    # --report: the same HTML as `report`, with the error columns
    page = (tmp_path / "v.html").read_text()
    assert "<th>max |err|</th>" in page and "<th>SNR dB</th>" in page and 'id="cost"' in page
    # the table
    from tinydeploy.commands.validate import print_table
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        print_table(res)
    assert "every layer is within the tolerance" in table.getvalue() and "relu" in table.getvalue()


@pytest.mark.models
def test_kws_int8_every_layer_bit_exact(tmp_path):
    code, out, err = cli("validate", mlperf_model(KWS8), "--json", "-o", tmp_path / "b")
    assert code == 0, err
    res = json.loads(out)
    assert res["outputs_match"] and len(res["layers"]) == 12
    for x in res["layers"]:
        assert x["max_lsb"] == 0 and x["exact_max_lsb"] == 0 and x["identical_fraction"] == 1.0, x
        assert x["local"]["kernel_max_lsb"] == 0 and x["max_abs_error"] == 0.0


def _fault_named(res: dict) -> None:
    first = res["first_divergent_layer"]
    assert first is not None and first["step"] == FAULT_STEP, first
    assert first["cause"] == "kernel" and first["max_lsb"] == 2 and "exact reference by 2 LSB" in first["why"]
    rows = {x["step"]: x for x in res["layers"]}
    assert all(rows[s]["max_lsb"] == 0 for s in rows if s < FAULT_STEP)
    after = [rows[s] for s in rows if s > FAULT_STEP and rows[s]["max_lsb"]]
    assert after and all(x["cause"] == "inherited" and x["origin"] == {"step": FAULT_STEP, "cause": "kernel"}
                         for x in after), after


@pytest.mark.models
def test_planted_fault_is_named_on_the_host(tmp_path):
    res = flow.validate(mlperf_model(KWS8), "host", outdir=tmp_path / "b", quiet=True,
                        extra_cflags=[f"-DTD_TEST_FAULT_STEP={FAULT_STEP}"])
    _fault_named(res)


def test_dataset_figures_and_accuracy(tmp_path):
    path = save(conv_bn_relu_model(), tmp_path)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 1, 3, 8, 8)).astype(np.float32)
    want = [int(np.argmax(reference.run_onnxruntime(path.read_bytes(), {"x": s})[0])) for s in x]
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "a.npz", x=x[:2], labels=np.array([want[0], (want[1] + 1) % 10]))
    np.savez(data / "b.npz", x=x[2], label=np.int64(want[2]))
    code, out, err = cli("validate", path, "--dataset", data, "--json", "-o", tmp_path / "b")
    assert code == 0, err
    res = json.loads(out)
    ds = res["dataset"]
    assert ds["samples"] == 3 and ds["outputs_match"] == 3 and ds["top1_agreement"] == 1.0
    assert ds["accuracy"] == {"target": pytest.approx(2 / 3), "reference": pytest.approx(2 / 3), "labelled": 3}
    assert ds["cosine"] > 0.999999 and ds["l2r"] < 1e-5 and ds["rmse"] < 1e-5 and ds["mae"] < 1e-5
    assert res["samples"] == 3 and all(x["within_tolerance"] for x in res["layers"])


def test_bad_input_is_one_line(tmp_path):
    """Refused before anything is built, in one line; a file the user owns is never overwritten."""
    path = save(conv_bn_relu_model(), tmp_path)
    (tmp_path / "mine.html").write_text("my notes")
    for args, says in [(["--dataset", tmp_path / "none"], "is not a folder"),
                       (["--inputs", tmp_path / "none.npz"], "cannot read inputs"),
                       (["--board", "nano33ble"], "add --emulate"),
                       (["--report", tmp_path / "mine.html"], "not a tinydeploy report")]:
        code, _, err = cli("validate", path, *args, "-o", tmp_path / "b")
        assert code == 2 and says in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "mine.html").read_text() == "my notes" and not (tmp_path / "b").exists()


def test_normal_build_has_no_capture(tmp_path):
    """The hooks cost nothing outside the capture build: model.c without TD_CAPTURE calls no hook."""
    from tinydeploy.pipeline import compile_model
    from tinydeploy.targets import boards
    c = compile_model(save(conv_bn_relu_model(), tmp_path), boards.get_board("host").make_target())
    for name, text in c.files.items():
        (tmp_path / name).write_text(text)
    assert "TD_LAYER_OUTPUT(0, 0, TD_FLOAT32," in c.files["model.c"]
    pre = lambda *flags: subprocess.run(["gcc", "-E", "-P", *flags, str(tmp_path / "model.c")], capture_output=True,  # noqa: E731
                                        text=True, check=True).stdout
    normal, captured = pre(), pre("-DTD_CAPTURE", "-DTD_PROFILE")
    assert "td_capture" not in normal and "td_profile" not in normal
    assert captured.count("td_capture((0), (0), (1),") == 1 and "td_test_fault" not in captured


def test_capture_build_with_clang_and_sanitizers(tmp_path):
    """The capture build (and its test-only fault) is clean C for gcc and clang at -Werror and under
    ASan/UBSan, and they hand over the same tensors (clang contracts a * b + c into FMAs by default:
    its float results may differ in the last bits)."""
    from util import SANITIZE
    path = save(conv_bn_relu_model(), tmp_path)
    caps = []
    for cc, flags in (("gcc", []), ("clang", ["-DTD_TEST_FAULT_STEP=99"]), ("gcc", SANITIZE)):
        require(cc)
        b = flow.build(path, "host", tmp_path / f"{cc}{len(flags)}", quiet=True, cc=cc,
                       extra_cflags=flow.CAPTURE_CFLAGS + flags)
        feeds = reference.random_inputs(flow.io_specs(b.summary, "inputs"), 0)
        out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
        caps.append(runners.select_runner("host").capture(b.exe, [feeds["x"]], out_specs, profile_runs=2))
    for cap, exact in zip(caps[1:], (False, True)):
        assert set(cap.tensors) == set(caps[0].tensors) == {(0, 0), (1, 0), (3, 0)}
        for k, v in caps[0].tensors.items():
            assert np.array_equal(v, cap.tensors[k]) if exact else np.allclose(v, cap.tensors[k], rtol=1e-5), k
        assert cap.cost_unit == "us" and set(cap.costs) == {0, 1, 3}


def test_over_ssh(tmp_path):
    """A Linux board over ssh (this machine, through a private sshd): the static capture build is
    copied, run, and its records come back with OUT.bin."""
    from test_deploy import Sshd
    sshd = Sshd(tmp_path)
    try:
        path = save(conv_bn_relu_model(), tmp_path)
        code, out, err = cli("validate", path, *sshd.args(), "--json", "-o", tmp_path / "b", "--profile")
    finally:
        sshd.stop()
    assert code == 0, err
    res = json.loads(out)
    assert res["where"].startswith("on ") and len(res["layers"]) == 3 and res["first_divergent_layer"] is None
    assert all(x["identical_fraction"] is not None and x["cost"] > 0 for x in res["layers"])


# ---- the capture protocol: CRC-checked, resent on request ---------------------------------------

class ScriptedBoard:
    """A serial-like stand-in for a capture build: answers `capture 1%` with one tensor whose first
    copy is corrupted (every copy with `always_bad`), sends it again on 'r', ends after '+' or 'x'."""

    END = b"m-layer-count-3-1234\r\nm-count-unit-[instructions]\r\nm-capture-done-%d\r\nm-results-[1,2]\r\n"

    def __init__(self, tensor: bytes, always_bad: bool = False):
        self.tensor, self.always_bad, self.out, self.got = tensor, always_bad, bytearray(), bytearray()

    def write(self, data: bytes) -> None:
        self.got += data
        head = f"m-layer-3-0-3-{len(self.tensor)}-{zlib.crc32(self.tensor):08x}\r\n".encode()
        bad = bytes([self.tensor[0] ^ 0xFF]) + self.tensor[1:]
        if data == b"capture 1%":
            self.out += head + bad
        elif data == b"r":
            self.out += head + (bad if self.always_bad else self.tensor)
        elif data == b"+":
            self.out += self.END % 1 + b"m-ready\r\n"
        elif data == b"x":
            self.out += self.END % 0 + b"e-[capture: stopped]\r\nm-ready\r\n"

    def read(self, n: int) -> bytes:
        data, self.out = bytes(self.out[:n]), self.out[n:]
        return data

    def close(self) -> None:
        pass


def test_crc_mismatch_asks_for_the_tensor_again():
    tensor = bytes(range(250)) + b"\n\r%" * 10        # line ends and '%' inside: binary, not lines
    board = ScriptedBoard(tensor)
    got = protocol.Device(board, timeout=5).capture(True)
    assert got["tensors"] == {(3, 0): (3, tensor)} and got["counts"] == {3: 1234} and got["unit"] == "instructions"
    assert bytes(board.got) == b"capture 1%r+"
    # a link that corrupts every copy: the host gives up after CAPTURE_RESENDS more, in one clear error
    board = ScriptedBoard(tensor, always_bad=True)
    with pytest.raises(TinydeployError, match="failed its CRC-32 4 times in a row"):
        protocol.Device(board, timeout=5).capture(True)
    assert bytes(board.got) == b"capture 1%rrrx"


def test_firmware_resends_and_stops_on_request(tmp_path):
    """The device side under QEMU: 'r' sends the same tensor again (line and bytes), 'x' stops
    sending while the inference completes, and the board keeps serving."""
    require("qemu-system-arm")
    from tinydeploy.runners.mcu import input_data
    from tinydeploy.runners.qemu_system import Emulator
    path = save(conv_bn_relu_model(), tmp_path)
    b = flow.build(path, "mps2-an386", tmp_path / "fw", quiet=True, extra_cflags=flow.CAPTURE_CFLAGS)
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    with Emulator(b.firmware.elf, b.firmware.machine) as emu:
        dev = emu.boot(timeout=60, boot_timeout=120)
        dev.load(input_data(b.firmware.memory, [x]))
        dev.write(b"capture 1%")
        head = dev.readline(60)
        n = int(head.split("-")[5])
        first = dev.read_exact(n, 60)
        dev.write(b"r")
        assert dev.readline(60) == head and dev.read_exact(n, 60) == first
        dev.write(b"+")
        head2 = dev.readline(60)
        assert head2.startswith("m-layer-")
        dev.read_exact(int(head2.split("-")[5]), 60)
        dev.write(b"x")
        _, lines = dev.expect(r"^m-ready$", 60)
        assert "m-capture-done-1" in lines and any(ln.startswith("e-[capture: stopped") for ln in lines), lines
        assert any(ln.startswith("m-layer-count-") for ln in lines)
        assert dev.name() == "tinydeploy mps2-an386"
        got = dev.capture(True)                   # and a whole capture afterwards
        assert len(got["tensors"]) == 3 and got["unit"] == "instructions"
        dev.quit()


# ---- QEMU Cortex-M4 and qemu-aarch64: the same tensors as the host's ---------------------------

@pytest.mark.models
def test_cortex_m4_tensors_equal_the_hosts_and_the_fault_is_named(tmp_path, monkeypatch, capsys):
    require("qemu-system-arm")
    path = mlperf_model(KWS8)
    host, feeds, _ = capture(path, "host", tmp_path / "host")
    m4, _, b = capture(path, "mps2-an386", tmp_path / "m4", feeds=feeds)
    nano, _, _ = capture(path, "nano33ble", tmp_path / "nano", emulate=True, feeds=feeds)
    assert set(host.tensors) == set(m4.tensors) == set(nano.tensors) and len(host.tensors) == 12
    for k, v in host.tensors.items():
        assert np.array_equal(v, m4.tensors[k]) and np.array_equal(v, nano.tensors[k]), k
    # per-layer instructions: exact, and they add up to the normal build's inference (each count
    # includes the few instructions of its hooks' calls)
    assert m4.cost_unit == "instructions" and set(m4.costs) == {k[0] for k in m4.tensors}
    run = flow.run(path, "mps2-an386", outdir=tmp_path / "run", quiet=True)
    total, layers = run["latency"]["instructions"], sum(m4.costs.values())
    assert 0 <= layers - total <= 16 * len(m4.costs), (layers, total)
    # bench --layers on a microcontroller board: the same counts, from the same capture build
    monkeypatch.chdir(tmp_path)
    from tinydeploy.commands.bench import bench_layers_mcu
    (tmp_path / "build").mkdir()
    (tmp_path / "m4").rename(tmp_path / "build" / "kws_dscnn_int8-mps2-an386-validate")
    rows = bench_layers_mcu([str(path)], "mps2-an386", as_json=True)[0]["layers"]
    assert {x["step"]: x["instructions"] for x in rows} == m4.costs
    capsys.readouterr()
    # the fault, under QEMU
    res = flow.validate(path, "mps2-an386", outdir=tmp_path / "fault", quiet=True,
                        extra_cflags=[f"-DTD_TEST_FAULT_STEP={FAULT_STEP}"], profile=True)
    _fault_named(res)
    assert res["profile"]["unit"] == "instructions" and res["layers"][0]["cost"] > 0


@pytest.mark.models
def test_aarch64_tensors_equal_the_hosts_with_the_same_kernels(tmp_path, monkeypatch):
    """FP32 under qemu-aarch64: with the portable kernels on both sides (the same C) the tensors
    are the host's bit for bit; with each board's fast kernels, every layer within the tolerance."""
    require("qemu-aarch64")
    require("aarch64-linux-gnu-gcc")
    path = mlperf_model("kws_dscnn_fp32.onnx")
    monkeypatch.setenv("TINYDEPLOY_ALGO", "ref")
    host, feeds, _ = capture(path, "host", tmp_path / "host")
    arm, _, _ = capture(path, "rpi4", tmp_path / "rpi4", emulate=True, feeds=feeds)
    assert set(host.tensors) == set(arm.tensors)
    for k, v in host.tensors.items():
        assert np.array_equal(v.view(np.uint32), arm.tensors[k].view(np.uint32)), k
    monkeypatch.delenv("TINYDEPLOY_ALGO")
    res = flow.validate(path, "rpi4", emulate=True, outdir=tmp_path / "fast", quiet=True)
    assert res["outputs_match"] and res["emulated"] and res["first_divergent_layer"] is None
    assert all(x["within_tolerance"] for x in res["layers"])


# ---- the reference saturates: named, on an AVX2 CPU without VNNI on every machine --------------

def saturating_model() -> onnx.ModelProto:
    """A uint8 3x3 convolution whose u8 x s8 products, added in pairs, leave int16."""
    rng = np.random.default_rng(0)
    w = rng.choice(np.array([-128, -127, 127, 100, -100], np.int8), (4, 8, 3, 3)).astype(np.int8)
    c = numpy_helper.from_array
    inits = [c(np.float32(0.02), "xs"), c(np.uint8(0), "xz"), c(w, "w"), c(np.float32(0.01), "ws"), c(np.int8(0), "wz"),
             c(np.float32(2.0), "ys"), c(np.uint8(128), "yz")]
    nodes = [helper.make_node("DequantizeLinear", ["x", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"]),
             helper.make_node("Conv", ["xd", "wd"], ["y"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["yq"])]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 8, 6, 6])],
                      [helper.make_tensor_value_info("yq", TensorProto.UINT8, [1, 4, 6, 6])], inits)


def test_saturating_pairs_model():
    """reference.saturating_pairs: where pairs leave int16 (the model of onnxruntime's AVX2 kernels)."""
    from tinydeploy.quant import exact
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        g = exact.lowered_graph(save(saturating_model(), Path(tmp)))
    node = g.nodes[0]
    assert node.op == "QConv"
    high = np.full((1, 8, 6, 6), 250, np.uint8)
    assert reference.saturating_pairs(node, g, high).all()            # 250 x 127 x 2 > 32767
    assert not reference.saturating_pairs(node, g, np.full((1, 8, 6, 6), 60, np.uint8)).any()
    assert reference.saturating_pairs(g.nodes[0], g, high.astype(np.int8)) is None   # not u8 x s8


@pytest.mark.slow
def test_saturation_in_onnxruntime_is_named_on_an_avx2_cpu(tmp_path):
    require("qemu-x86_64")
    path = save(saturating_model(), tmp_path, "sat.onnx")
    x = np.random.default_rng(1).integers(200, 256, (1, 8, 6, 6)).astype(np.uint8)
    np.savez(tmp_path / "x.npz", x=x)
    # the capture build natively first (the emulated run reuses it): only Python, numpy and
    # onnxruntime need the emulated CPU
    flow.build(path, "host", tmp_path / "b", quiet=True, extra_cflags=flow.CAPTURE_CFLAGS, reuse=True)
    python = os.path.realpath(sys.executable)
    r = subprocess.run(["qemu-x86_64", "-cpu", "Haswell", python, "-m", "tinydeploy", "validate", str(path),
                        "--inputs", str(tmp_path / "x.npz"), "--reference", "onnxruntime", "--json",
                        "-o", str(tmp_path / "b")], capture_output=True, text=True, cwd=tmp_path, timeout=1200,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr[-2000:]       # the verdict stays the oracle's: the outputs match
    res = json.loads(r.stdout)
    first = res["first_divergent_layer"]
    assert first["step"] == 0 and first["cause"] == "saturation", first
    assert "saturation in the reference" in first["why"] and first["max_lsb"] > 1
    assert res["layers"][0]["exact_max_lsb"] == 0    # tinydeploy: bit for bit with the exact reference


# ---- the whole matrix of the issue (TINYDEPLOY_ACCEPTANCE=1) -------------------------------------

ACCEPTANCE = os.environ.get("TINYDEPLOY_ACCEPTANCE") == "1"
MODELS8 = ["ad_autoencoder_int8", "ic_resnet8_int8", "kws_dscnn_int8", "vww_mobilenetv1_int8"]
MODELS32 = [m.replace("int8", "fp32") for m in MODELS8]
MATRIX = ([(m, "host", ()) for m in MODELS8 + MODELS32] + [(m, "mps2-an386", ()) for m in MODELS8]
          + [(m, "nano33ble", ("--emulate",)) for m in MODELS8] + [(m, "rpi4", ("--emulate",)) for m in MODELS32])


def _every_layer_matches(res: dict) -> None:
    """validate --json's verdict: the outputs match, every layer is listed with its metrics, and
    8-bit layers are bit for bit with the exact reference (kernel and carried differences alike)."""
    assert res["outputs_match"] and res["layers"]
    for x in res["layers"]:
        assert x["captured"] and x["cosine"] is not None and x["identical_fraction"] is not None, x
        if x["max_lsb"] is not None:
            assert x["exact_max_lsb"] == 0 and x["local"]["kernel_max_lsb"] == 0, x


@pytest.mark.skipif(not ACCEPTANCE, reason="the issue's whole matrix: TINYDEPLOY_ACCEPTANCE=1 (about 12 minutes)")
@pytest.mark.models
@pytest.mark.parametrize("model,board,extra", MATRIX, ids=[f"{m}-{b}" for m, b, _ in MATRIX])
def test_acceptance_matrix(model, board, extra, tmp_path, monkeypatch):
    path = mlperf_model(model + ".onnx")
    r = td("validate", path, "--board", board, *extra, "--json", "-o", tmp_path / "b", cwd=tmp_path, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    _every_layer_matches(res)
    if board == "host":
        return
    # the target's tensors against the host build's, bit for bit (FP32: the same portable C)
    if "fp32" in model:
        monkeypatch.setenv("TINYDEPLOY_ALGO", "ref")
    host, feeds, _ = capture(path, "host", tmp_path / "host")
    there, _, _ = capture(path, board, tmp_path / "there", emulate=bool(extra), feeds=feeds)
    assert set(host.tensors) == set(there.tensors)
    for k, v in host.tensors.items():
        assert np.array_equal(v.view(np.uint8), there.tensors[k].view(np.uint8)), k


@pytest.mark.skipif(not ACCEPTANCE, reason="the issue's whole matrix: TINYDEPLOY_ACCEPTANCE=1")
@pytest.mark.models
@pytest.mark.parametrize("fmt", ["qdq", "qoperator"])
@pytest.mark.parametrize("model", ["kws_dscnn", "ic_resnet8", "vww_mobilenetv1", "ad_autoencoder"])
def test_acceptance_uint8_models_of_quantize(model, fmt, tmp_path):
    """The uint8 models `tinydeploy quantize` makes of the FP32 MLPerf Tiny models, on the host."""
    sys.path.insert(0, str(REPO / "models"))
    import make_calibration
    fp32 = mlperf_model(model + "_fp32.onnx")
    np.savez(tmp_path / "cal.npz", **make_calibration.make(str(fp32), n=10, seed=0,
                                                           image_range=model in ("ic_resnet8", "vww_mobilenetv1")))
    q = tmp_path / f"{model}_u8_{fmt}.onnx"
    r = td("quantize", fp32, "--calibration", tmp_path / "cal.npz", "-o", q, "--format", fmt, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    r = td("validate", q, "--board", "host", "--json", "-o", tmp_path / "b", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    _every_layer_matches(json.loads(r.stdout))


@pytest.mark.skipif(not ACCEPTANCE, reason="the issue's whole matrix: TINYDEPLOY_ACCEPTANCE=1")
def test_acceptance_resnet18_on_the_host(resnets, tmp_path):
    r = td("validate", resnets["resnet18"], "--board", "host", "--json", "-o", tmp_path / "b", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    _every_layer_matches(json.loads(r.stdout))
