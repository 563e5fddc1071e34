"""The firmware's serial protocol (EnergyRunner performance mode + tinydeploy extensions), against
the real firmware under QEMU over socket://, and the host Device class's timeout logic over loop://.
Every error answers e-[...] and the device keeps serving."""
from __future__ import annotations

import socket
import struct
import time
import zlib

import numpy as np
import onnx
import pytest

from tinydeploy.runners import qemu_system as emulator
from tinydeploy import firmware as fwlib
from tinydeploy.runners import protocol
from tinydeploy.errors import TinydeployError
from tinydeploy.pipeline import compile_model
from tinydeploy.runners.protocol import Device
from tinydeploy.targets import get_target
from test_mcu import no_qemu_left_behind, toolchain  # noqa: F401  (fixtures)
from util import make_model, save

N = 8                     # two float32 inputs of N values: a 64-byte input buffer
IN_BYTES = 2 * N * 4


@pytest.fixture(scope="module")
def firmware(toolchain, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("proto")
    vi = lambda name: onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [1, N])  # noqa: E731
    model = make_model([onnx.helper.make_node("Add", ["a", "b"], ["y"])], [vi("a"), vi("b")], [vi("y")])
    c = compile_model(save(model, tmp, "add.onnx"), get_target("cortex-m4"), board="mps2-an386")
    return fwlib.build_firmware(c, "mps2-an386", tmp / "fw")


@pytest.fixture
def emu(firmware):
    with emulator.Emulator(firmware.elf, firmware.machine) as e:
        yield e


@pytest.fixture
def dev(emu):
    d = emu.device(timeout=60)
    d.wait_boot(timeout=120)
    return d


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal(N).astype(np.float32) for _ in range(2))
    return a, b, a.tobytes() + b.tobytes()


def errors(lines):
    return [ln for ln in lines if ln.startswith("e-[")]


def still_serving(dev):
    assert dev.name() == "tinydeploy mps2-an386"


# ---- every command --------------------------------------------------------------------------

def test_every_command(dev, emu):
    assert dev.name() == "tinydeploy mps2-an386"
    assert dev.profile() == {"profile": "ULPMark for tinyML Firmware V0.0.1", "model": "add"}
    t0 = dev.timestamp_us()
    assert dev.timestamp_us() > t0
    a, b, data = inputs()

    # EnergyRunner-style hex load, 31 bytes per chunk
    assert dev.command(f"db load {IN_BYTES}") == [f"m-[Expecting {IN_BYTES} bytes]"]
    lines = dev.command("db " + data[:31].hex())
    assert "m-load-done" not in lines
    lines = dev.command("db " + data[31:].hex())
    assert lines == ["m-load-done"]
    dump = dev.command("db print")
    assert bytes.fromhex("".join(ln[len("m-buffer-"):] for ln in dump)) == data

    lines = dev.command("infer 2 1")
    assert lines[:3] == ["m-warmup-start-1", "m-warmup-done", "m-infer-start-2"]
    assert lines[3].startswith("m-lap-us-") and lines[4].startswith("m-lap-us-") and lines[5] == "m-infer-done"
    assert int(lines[4][9:]) >= int(lines[3][9:])
    got = [float(x) for x in lines[6][len("m-results-["):-1].split(",")]
    assert got == pytest.approx(a + b, abs=6e-4)
    assert dev.results() == got
    raw = dev.outputs()
    assert np.array_equal(np.frombuffer(raw, np.float32), a + b)

    counts = dev.counts()
    assert counts.runs == 2 and counts.tick_hz == 25_000_000 and counts.count_unit == "instructions"
    assert counts.count_min == counts.count_max > 0 and counts.count_total == 2 * counts.count_min
    used, reserved = dev.stack()
    assert 0 < used < reserved

    # the binary bulk load replaces the buffer, and so does Device.load_hex
    a2, b2, data2 = inputs(1)
    dev.load(data2)
    dev.infer(1, 0)
    assert np.array_equal(np.frombuffer(dev.outputs(), np.float32), a2 + b2)
    a3, b3, data3 = inputs(3)
    dev.load_hex(data3)
    dev.infer(1, 0)
    assert np.array_equal(np.frombuffer(dev.outputs(), np.float32), a3 + b3)
    assert dev.last_counts.count_min == counts.count_min      # same work, same instructions

    dev.quit()
    assert emu.wait(10) == 0


def test_results_before_any_inference(dev):
    assert errors(dev.command("results", check=False)) == ["e-[results: no inference has run yet]"]
    still_serving(dev)


# ---- malformed input ------------------------------------------------------------------------

def test_garbage_bytes(dev):
    rng = np.random.default_rng(1234)
    junk = bytes(rng.integers(0, 256, 3000, dtype=np.uint8))
    dev.write(junk, note="(3000 random bytes)")
    dev.write(b"%")
    dev.drain(quiet=1.0, limit=30)
    dev.resync()
    still_serving(dev)
    # control bytes inside a command
    assert errors(dev.command("na\x01me", check=False)) == ["e-[command has bytes that are not printable ASCII]"]
    still_serving(dev)


def test_command_longer_than_80_characters(dev):
    lines = dev.command("x" * 80, check=False)          # exactly 80: accepted, unknown
    assert errors(lines) == ["e-[unknown command: " + "x" * 80 + "]"]
    dev.write(b"name " + b"y" * 200 + b"%")
    _, lines = dev.expect(r"^m-ready$")
    assert errors(lines) == ["e-[command longer than 80 characters]"]
    still_serving(dev)
    with pytest.raises(TinydeployError, match="longer than the device's 80"):
        dev.command("z" * 81)


@pytest.mark.parametrize("cmd, err", [
    ("db load 0", "e-[db load: N must be 1..64 (the input buffer size)]"),
    (f"db load {IN_BYTES + 1}", "e-[db load: N must be 1..64 (the input buffer size)]"),
    ("db load x", "e-[db load: N must be 1..64 (the input buffer size)]"),
    ("db load 99999999999", "e-[db load: N must be 1..64 (the input buffer size)]"),
    ("db 00ff", "e-[db: no db load in progress]"),
    ("db", "e-[usage: db load N | db <hex> | db print]"),
    ("infer 0 0", "e-[usage: infer N W (1 <= N <= 1000000 timed runs after W <= 1000000 warm-up runs)]"),
    ("infer a", "e-[usage: infer N W (1 <= N <= 1000000 timed runs after W <= 1000000 warm-up runs)]"),
    ("infer 1 4294967295", "e-[usage: infer N W (1 <= N <= 1000000 timed runs after W <= 1000000 warm-up runs)]"),
    ("infer 1000001 0", "e-[usage: infer N W (1 <= N <= 1000000 timed runs after W <= 1000000 warm-up runs)]"),
    ("infer 99999999999 0", "e-[usage: infer N W (1 <= N <= 1000000 timed runs after W <= 1000000 warm-up runs)]"),
    ("infer 1 2 3", "e-[too many arguments: infer]"),
    ("bload 10", "e-[usage: bload N CRC32HEX]"),
    ("bload 10 xyz", "e-[usage: bload N CRC32HEX]"),
    ("bload 10 123456789", "e-[usage: bload N CRC32HEX]"),
    (f"bload {IN_BYTES + 1} 0", "e-[bload: N must be 1..64 (the input buffer size)]"),
    ("a b c d e", "e-[too many arguments: a]"),
    ("fly", "e-[unknown command: fly]"),
    ("name extra", "e-[unknown command: name]"),
])
def test_bad_commands_answer_an_error_and_the_device_keeps_serving(dev, cmd, err):
    assert errors(dev.command(cmd, check=False)) == [err]
    still_serving(dev)


def test_db_chunk_errors(dev):
    dev.command("db load 4")
    assert errors(dev.command("db 0", check=False)) == ["e-[db: odd number of hex digits]"]
    assert errors(dev.command("db zz", check=False)) == ["e-[db: not hex]"]
    assert errors(dev.command("infer 1 0", check=False)) == ["e-[db load is not complete]"]
    assert errors(dev.command("db 0011223344", check=False)) == ["e-[db: more bytes than db load announced]"]
    assert errors(dev.command("db 00", check=False)) == ["e-[db: no db load in progress]"]
    still_serving(dev)


def test_bulk_load_with_a_bad_crc(dev):
    _, _, data = inputs()
    dev.write(f"bload {len(data)} {zlib.crc32(data) ^ 1:08x}%".encode())
    dev.expect(r"^m-bload-ready-64$")
    dev.write(data)
    _, lines = dev.expect(r"^m-ready$")
    assert errors(lines) == [f"e-[crc mismatch: received data has crc {zlib.crc32(data):08x}]"]
    dev.load(data)                        # a good one afterwards works
    still_serving(dev)


def test_truncated_bulk_load_times_out(dev):
    _, _, data = inputs()
    dev.write(f"bload {len(data)} {zlib.crc32(data):08x}%".encode())
    dev.expect(r"^m-bload-ready-64$")
    dev.write(data[:40])
    _, lines = dev.expect(r"^m-ready$", timeout=60)
    assert errors(lines) == ["e-[timeout: bulk load got 40 of 64 bytes]"]
    still_serving(dev)


def test_host_disconnect_mid_run(emu, dev):
    a, b, data = inputs(2)
    dev.load(data)
    dev.write(b"infer 200 0%")
    dev.expect(r"^m-infer-start-200$")
    dev.close()                           # the host goes away while the board infers
    dev2 = emu.device(timeout=60)
    dev2.resync(timeout=60)
    assert dev2.name() == "tinydeploy mps2-an386"
    # ... and mid bulk load: the board gives up on the missing bytes and serves the next host
    dev2.write(f"bload {len(data)} {zlib.crc32(data):08x}%".encode())
    dev2.expect(r"^m-bload-ready-64$")
    dev2.write(data[:10])
    dev2.close()
    dev3 = emu.device(timeout=60)
    time.sleep(0.5)
    dev3.resync(timeout=60)
    dev3.load(data)
    dev3.infer(1, 0)
    assert np.array_equal(np.frombuffer(dev3.outputs(), np.float32), a + b)


def test_raw_socket_client_without_pyserial(emu):
    """Anything that speaks TCP can drive the emulator (as the EnergyRunner would a serial port)."""
    with socket.create_connection(("127.0.0.1", emu.port), timeout=20) as s:
        s.sendall(b"profile%")
        buf = b""
        while b"m-model-[" not in buf or not buf.endswith(b"m-ready\r\n"):
            chunk = s.recv(4096)
            assert chunk, "connection closed"
            buf += chunk
    assert b"m-profile-[ULPMark for tinyML Firmware V0.0.1]\r\nm-model-[add]\r\nm-ready\r\n" in buf


# ---- the host side alone (loop://) ------------------------------------------------------------

def test_device_times_out_when_nobody_answers():
    dev = Device("loop://", timeout=0.3)
    t = time.monotonic()
    with pytest.raises(TinydeployError, match=r"board stopped answering: no complete reply to 'name%' within 0.3 s on loop://"):
        dev.name()
    assert time.monotonic() - t < 5
    assert any(entry.startswith("> name%") for entry in dev.log)


def test_device_reports_the_partial_line_on_timeout():
    dev = Device("loop://", timeout=0.3)
    dev.ser.write(b"m-half-a-li")
    with pytest.raises(TinydeployError, match="partial line 'm-half-a-li'"):
        dev.readline()


def test_device_parses_replies_and_raises_on_device_errors():
    dev = Device("loop://", timeout=1.0)
    dev.ser.write(b"noise\r\nm-name-dut-[board 7]\r\nm-ready\r\n")
    assert dev.name() == "board 7"        # the echoed "name%" stays in the buffer, unterminated
    dev.drain(quiet=0.1)
    dev.ser.write(b"e-[unknown command: fly]\r\nm-ready\r\n")
    with pytest.raises(TinydeployError, match=r"the board refused 'fly': e-\[unknown command: fly\]"):
        dev.command("fly")
    dev.drain(quiet=0.1)
    dev.ser.write(b"m-ticks-total-100-runs-4-min-25-max-25-hz-1000\r\n"
                  b"m-count-total-100-min-25-max-25-unit-[ticks]\r\nm-ready\r\n")
    c = dev.counts()
    assert (c.runs, c.ticks_per_run, c.count_unit) == (4, 25.0, "ticks")


def test_wait_boot_sends_a_garbled_name_command_again():
    """A byte lost while QEMU's UART starts turns name% into 'ame': the device says e-[...]."""
    dev = Device("loop://", timeout=1.0)
    dev.ser.write(b"m-init-done\r\ne-[unknown command: ame]\r\nm-ready\r\nm-name-dut-[board 7]\r\nm-ready\r\n")
    assert dev.wait_boot(timeout=2.0) == "board 7"
    dev = Device("loop://", timeout=1.0)
    dev.ser.write(b"e-[unknown command: ame]\r\nm-ready\r\n" * 3)
    with pytest.raises(TinydeployError, match="answered 'name%' with e-.unknown command: ame. three times"):
        dev.wait_boot(timeout=2.0)


def test_device_refuses_a_bulk_load_the_board_rejects():
    dev = Device("loop://", timeout=1.0)
    dev.ser.write(b"e-[bload: N must be 1..64 (the input buffer size)]\r\nm-ready\r\n")
    with pytest.raises(TinydeployError, match="N must be 1..64"):
        dev.load(bytes(100))


def test_cannot_open_a_missing_port():
    with pytest.raises(TinydeployError, match="cannot open serial port"):
        Device("/dev/does-not-exist-tinydeploy")


def test_results_parse_the_energyrunner_float_format():
    dev = Device("loop://", timeout=1.0)
    assert dev._results(["m-results-[0.046,-1.500,nan,inf,3.000e+12]"])[:2] == [0.046, -1.5]
    assert struct.calcsize("f") == 4 and protocol.DB_CHUNK == 31


def test_energyrunner_image_path_for_ic_int8(toolchain, tmp_path):  # noqa: F811
    """The runner sends IC images as uint8 with db load/db <hex>; the firmware stores v - 128 into
    the int8 input, and the result equals the exact reference on the int8 image bit for bit."""
    from tinydeploy import reference
    from tinydeploy.quant import exact
    from util import mlperf_model
    path = mlperf_model("ic_resnet8_int8.onnx")
    c = compile_model(path, get_target("cortex-m4"), board="mps2-an386")
    fw = fwlib.build_firmware(c, "mps2-an386", tmp_path / "fw")
    assert "#define TD_DB_SUBTRACT_128 1" in (fw.outdir / "src" / "harness_config.h").read_text()
    name = c.graph.inputs[0]
    x = reference.random_inputs([(name, tuple(c.graph.t(name).shape), np.int8)], seed=5)[name]
    pixels = (x.astype(np.int16) + 128).astype(np.uint8).tobytes()
    want = exact.run_model(path, {name: x})[0]
    with emulator.Emulator(fw.elf, fw.machine) as e:
        dev = e.device(timeout=60)
        dev.wait_boot(timeout=120)
        assert dev.profile()["model"] == "ic01"
        dev.load_hex(pixels)
        dev.infer(1, 0)
        got = np.frombuffer(dev.outputs(), want.dtype).reshape(want.shape)
    assert np.array_equal(got, want)


def test_late_bytes_of_a_timed_out_bulk_load_are_never_commands(dev):
    """Issue 12: bytes that arrived after a bload had timed out were run as commands. The load's
    payload here is commands (quit% would end the firmware): after the e-[timeout ...] line the
    board discards the rest of the announced bytes, then says m-ready and serves."""
    payload = (b"quit%name%infer 9 9%" * 4)[:IN_BYTES]
    dev.write(f"bload {len(payload)} {zlib.crc32(payload):08x}%".encode())
    dev.expect(r"^m-bload-ready-64$")
    dev.write(payload[:10])
    dev.expect(r"^e-\[timeout: bulk load got 10 of 64 bytes\]$", timeout=120)
    dev.write(payload[10:], note="(the late 54 bytes)")
    _, lines = dev.expect(r"^m-ready$", timeout=120)
    assert lines == [], lines                   # nothing of the payload was answered
    still_serving(dev)
    a, b, data = inputs(4)
    dev.load(data)
    dev.infer(1, 0)
    assert np.array_equal(np.frombuffer(dev.outputs(), np.float32), a + b)
