"""tinydeploy/runners without running a model: the harness's I/O (packing, unpacking, timing
lines, run counts) and which runner select_runner picks for a board and the options given."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tinydeploy import flow
from tinydeploy.errors import TinydeployError
from tinydeploy.runners import select_runner
from tinydeploy.runners.energy import EnergyRunner
from tinydeploy.runners.harness import (MAX_RUNS, MIN_RUNS, layer_times, latency_us, median_ms, pack_inputs,
                                        runs_within, time_runs, unpack_outputs)
from tinydeploy.runners.local import LocalRunner
from tinydeploy.runners.mcu import QemuSystemRunner, SerialRunner
from tinydeploy.runners.ssh import SshRunner
from tinydeploy.targets import this_machine

SPECS = [((1, 3), np.dtype(np.float32)), ((2,), np.dtype(np.int8)), ((), np.dtype(np.int64))]


def outputs():
    return [np.array([[1.5, -2.0, 3.25]], np.float32), np.array([-128, 127], np.int8), np.array(7, np.int64)]


def test_outputs_round_trip_through_the_harness_bytes():
    raw = pack_inputs(outputs())
    assert len(raw) == 12 + 2 + 8
    got = unpack_outputs(raw, SPECS)
    for g, w in zip(got, outputs()):
        assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)
        assert g.flags.writeable                     # copies, not views of the bytes
    assert pack_inputs([np.arange(6, dtype=np.int16).reshape(2, 3).T]) == np.arange(6, dtype=np.int16).reshape(2, 3).T.copy().tobytes()


def test_short_outputs_are_a_clear_error():
    raw = pack_inputs(outputs())[:-3]
    with pytest.raises(TinydeployError, match=r"^the model binary returned 19 output bytes; the model's outputs need 22$"):
        unpack_outputs(raw, SPECS)
    with pytest.raises(TinydeployError, match=r"^the board running kws returned 0 output bytes; the model's outputs "
                                              r"need 1,200$"):
        unpack_outputs(b"", [((1, 300), np.float32)], "the board running kws")


def test_timing_lines():
    out = "runs 5\nlatency_us_median 1234.500\nlayer_us_median 0 1000.250\nlayer_us_median 3 200.000\n"
    assert latency_us(out) == 1234.5 and median_ms(out) == pytest.approx(1.2345)
    assert layer_times(out) == (1234.5, {0: 1000.25, 3: 200.0})
    assert latency_us("") is None and median_ms("runs 0\n") is None
    assert median_ms("x latency_us_median 5\n") is None            # only at the start of a line
    with pytest.raises(TinydeployError, match="no per-layer times .*-DTD_PROFILE"):
        layer_times("latency_us_median 12.0\n")


def test_run_counts():
    assert runs_within(1.0, 0.1) == 10
    assert runs_within(1.0, 10.0) == MIN_RUNS == 3
    assert runs_within(1.0, 0.0) == runs_within(1.0, 1e-9) == MAX_RUNS == 1000
    assert runs_within(0.05, 0.001) == 50


class FakeRunner:
    """Answers with a fixed latency; records the run counts asked for."""
    emulated, where = False, "nowhere"

    def __init__(self, ms):
        self.ms, self.asked = ms, []

    def run(self, built, feeds, out_specs, runs=0):
        self.asked.append(runs)
        return ["out"], (self.ms if runs else None)

    def close(self):
        self.asked.append("closed")


def test_time_runs_probes_then_fills_the_budget():
    r = FakeRunner(2.0)
    assert time_runs(r, "exe", [], [], 0.1) == (2.0, 50) and r.asked == [1, 50]
    r = FakeRunner(2.0)
    assert time_runs(r, "exe", [], [], 1.0, probe=3) == (2.0, 500) and r.asked == [3, 500]


def test_energy_runner_wraps_any_runner():
    inner = FakeRunner(1.0)
    inner.emulated, inner.where = True, "under qemu-aarch64"
    e = EnergyRunner(inner, rails=[])
    assert e.emulated and e.where == "under qemu-aarch64"
    assert e.run("exe", [], [], runs=0) == (["out"], None)       # untimed: no sampling
    e.close()
    assert inner.asked == [0, "closed"]


# ---- which runner -----------------------------------------------------------------------------

@pytest.fixture
def qemu_user_installed(monkeypatch):
    import shutil
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}" if name.startswith("qemu-") else real(name))


def test_host_runs_natively():
    r = select_runner("host")
    assert type(r) is LocalRunner and r.prefix == [] and not r.emulated and r.where == "natively"
    assert select_runner("host", emulate=True).prefix == []     # nothing to emulate


def test_rpi4_emulated_runs_under_qemu_user(qemu_user_installed):
    r = select_runner("rpi4", emulate=True)
    assert type(r) is LocalRunner and r.prefix[0] == "qemu-aarch64" and "-cpu" in r.prefix
    assert r.emulated and r.where == "under qemu-aarch64"


@pytest.mark.skipif(this_machine() == "aarch64", reason="an aarch64 machine runs rpi4 builds natively")
def test_rpi4_without_emulate_or_ssh_is_refused():
    with pytest.raises(TinydeployError, match=r"this machine is .*, not a rpi4: add --emulate .* `tinydeploy deploy"):
        select_runner("rpi4")


def test_rpi4_over_ssh():
    remote = SimpleNamespace(target="pi@rpi:2222")
    r = select_runner("rpi4", remote=remote, remote_dir="/home/pi/td", timeout=600)
    assert type(r) is SshRunner and r.remote is remote and r.remote_dir == "/home/pi/td" and r.timeout == 600
    assert r.where == "on pi@rpi:2222" and not r.emulated and r.dir is None     # nothing done on the board yet


def test_mps2_runs_under_qemu_system():
    r = select_runner("mps2-an386")
    assert type(r) is QemuSystemRunner and r.emulated


def test_nano33ble_emulated_and_over_its_port():
    assert type(select_runner("nano33ble", emulate=True)) is QemuSystemRunner
    r = select_runner("nano33ble", port="/dev/ttyACM0", timeout=5)
    assert type(r) is SerialRunner and (r.port, r.baudrate, r.timeout) == ("/dev/ttyACM0", 115200, 5)
    assert not r.emulated and r.where == "on /dev/ttyACM0"
    with pytest.raises(TinydeployError, match=r"nano33ble is a real board: add --emulate .* --port PORT"):
        select_runner("nano33ble")


def test_options_that_do_not_fit_the_board_are_refused():
    with pytest.raises(TinydeployError, match="--port is for microcontroller boards"):
        select_runner("rpi4", port="/dev/ttyUSB0")
    with pytest.raises(TinydeployError, match="nano33ble is a microcontroller: it is not reached over ssh"):
        select_runner("nano33ble", remote=SimpleNamespace(target="x"))


def test_measure_without_energy_does_not_sample_power(monkeypatch):
    seen = {}

    def fake_run(model, board, runner=None, **kw):
        seen["runner"] = runner
        return {"latency": {"runs": 3}}
    monkeypatch.setattr(flow, "run", fake_run)
    flow.measure("m.onnx", "host", None)
    assert type(seen["runner"]) is LocalRunner
