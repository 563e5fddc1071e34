"""The firmware harness (firmware_templates/mcu/harness.c) built for this machine with AddressSanitizer
and UBSan, its serial port on stdin/stdout (tests/harness_host/port_host.c): the protocol fuzzer of
the rig (hil/protofuzz.py) against it, so that every parsing path runs under the sanitizers, and
the 64-bit tick totals (issue 12: the nRF52840's 16 MHz count wrapped after 268 s)."""
from __future__ import annotations

import os
import re
import select
import subprocess
import time
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest

from hil import protofuzz
from tinydeploy import firmware as fwlib
from tinydeploy.pipeline import compile_model
from tinydeploy.runners.protocol import Device
from tinydeploy.targets import get_target
from util import SANITIZE, make_model, require, save

N = 8
IN_BYTES = 2 * N * 4
PORT = Path(__file__).resolve().parent / "harness_host" / "port_host.c"


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """The harness, the model's C (y = a + b on 8 floats) and the host port, built with ASan/UBSan."""
    require("gcc")
    tmp = tmp_path_factory.mktemp("harness_host")
    vi = lambda name: onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [1, N])  # noqa: E731
    model = make_model([onnx.helper.make_node("Add", ["a", "b"], ["y"])], [vi("a"), vi("b")], [vi("y")])
    c = compile_model(save(model, tmp, "add.onnx"), get_target("host"), board="host")
    for rel, text in fwlib.project_files(c, "mps2-an386").items():   # mps2: a 100 ms bulk-load timeout
        if rel.startswith("src/"):
            (tmp / rel).parent.mkdir(exist_ok=True)
            (tmp / rel).write_text(text)
    src = tmp / "src"
    exe = tmp / "harness"
    cmd = ["gcc", "-std=c99", "-Wall", "-Wextra", "-Werror", *SANITIZE, "-I", str(src), "-o", str(exe),
           str(src / "harness.c"), str(PORT), *(str(src / f) for f in ("model.c", "td_kernels.c", "td_weights.c")),
           "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


class PipePort:
    """The harness process's stdin/stdout as the serial object protocol.Device reads and writes."""

    def __init__(self, exe: Path, env: dict | None = None):
        self.proc = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
        self.name = "host harness"
        os.set_blocking(self.proc.stdout.fileno(), False)

    @property
    def in_waiting(self) -> int:
        return 0

    def read(self, n: int) -> bytes:
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], 0.05)[0]:
            return b""
        data = os.read(fd, max(n, 4096))
        if not data:
            raise OSError("the harness ended")
        return data

    def write(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def flush(self) -> None:
        pass

    def close(self) -> tuple[int, str]:
        """Ends the harness (end of stdin); its exit code and what it said on stderr."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        err = self.proc.stderr.read().decode("latin-1")
        return code, err


def inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal(N).astype(np.float32) for _ in range(2))
    return a, b, a.tobytes() + b.tobytes()


def test_protocol_fuzz_under_asan_and_ubsan(harness):
    """200 seeded faults; the sanitizers stop the process at the first memory or UB error, which
    the next name% then misses."""
    port = PipePort(harness)
    dev = Device(port, timeout=20)
    try:
        dev.wait_boot(timeout=20)
        a, b, data = inputs()
        out_specs = [((1, N), np.dtype(np.float32))]
        from tinydeploy.runners import mcu
        before = mcu.infer(dev, data, out_specs, stack=False)
        assert np.array_equal(before["outputs"][0].reshape(-1), a + b)
        rep = protofuzz.fuzz(dev, "tinydeploy mps2-an386", data, out_specs, before["raw"], n=200, seed=12,
                             timeout=20, slow=3)
        print(rep.line())
        assert rep.faults == 200
    finally:
        code, err = port.close()
    assert "Sanitizer" not in err and "runtime error" not in err, err[-3000:]
    assert code == 0, err[-3000:]


def test_tick_totals_are_64_bits(harness):
    """Issue 12: three runs of 0xF0000000 ticks each (a 16 MHz counter: 4.2 minutes per run) sum
    to more than 2^32; the board reports the whole sum."""
    port = PipePort(harness, {"TD_TICK_STEP": str(0xF0000000)})
    dev = Device(port, timeout=20)
    try:
        dev.wait_boot(timeout=20)
        _, _, data = inputs(1)
        dev.load(data)
        dev.infer(3, 0)
        c = dev.last_counts
        assert c.runs == 3 and c.ticks_total >= 3 * 0xF0000000 > 2**32, c
        assert 0xF0000000 <= c.ticks_min <= c.ticks_max < 2**32
    finally:
        code, err = port.close()
    assert code == 0 and "Sanitizer" not in err, err[-2000:]


def test_a_late_bulk_load_tail_is_discarded_on_the_host_build_too(harness):
    port = PipePort(harness)
    dev = Device(port, timeout=20)
    try:
        dev.wait_boot(timeout=20)
        payload = (b"quit%" * 13)[:IN_BYTES]
        dev.write(f"bload {IN_BYTES} {zlib.crc32(payload):08x}%".encode())
        dev.expect(r"^m-bload-ready-64$")
        dev.write(payload[:5])
        dev.expect(r"^e-\[timeout: bulk load got 5 of 64 bytes\]$", timeout=20)
        time.sleep(0.02)
        dev.write(payload[5:])
        _, lines = dev.expect(r"^m-ready$", timeout=20)
        assert lines == []
        assert dev.name() == "tinydeploy mps2-an386"
        assert not any(re.match(r"m-bye", ln) for ln in dev.log)
    finally:
        port.close()
