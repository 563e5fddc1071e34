"""`tinydeploy measure --energy` on Jetson boards, proven on a fake sysfs tree (--sysfs-root)
with the INA3221 layouts of JetPack 5/6 (hwmon) and JetPack 4 (IIO), the binary run under
qemu-aarch64 (--emulate); plus the trapezoid integrator against a power that changes in time."""
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tinydeploy.targets import boards
from tinydeploy.runners import energy
from tinydeploy.errors import TinydeployError
from test_deploy import tiny_model
from util import require


def hwmon_channel(root: Path, dev: str, hwmon: str, n: int, label: str, mv: int, ma: int) -> None:
    d = root / "sys/bus/i2c/drivers/ina3221" / dev / "hwmon" / hwmon
    d.mkdir(parents=True, exist_ok=True)
    (d / f"in{n}_label").write_text(label + "\n")
    (d / f"in{n}_input").write_text(f"{mv}\n")
    (d / f"curr{n}_input").write_text(f"{ma}\n")


def fake_orin(root: Path, with_ddr: bool = True) -> float:
    """JetPack 5/6 layout of the AGX Orin's two monitors; returns the watts of the measured rails."""
    hwmon_channel(root, "1-0040", "hwmon3", 1, "VDD_GPU_SOC", 5000, 2000)    # not measured
    hwmon_channel(root, "1-0040", "hwmon3", 2, "VDD_CPU_CV", 5000, 800)
    hwmon_channel(root, "1-0040", "hwmon3", 3, "VIN_SYS_5V0", 5000, 600)     # not measured
    hwmon_channel(root, "1-0041", "hwmon4", 1, "NC", 0, 0)
    if with_ddr:
        hwmon_channel(root, "1-0041", "hwmon4", 2, "VDDQ_VDD2_1V8AO", 5000, 300)
    return 5.0 * 0.8 + 5.0 * 0.3


def run_measure(args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinydeploy", "measure", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_energy_per_inference_on_a_fake_orin(tmp_path):
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    watts = fake_orin(tmp_path / "sysfs")
    model = tiny_model(tmp_path / "tiny.onnx")
    r = run_measure(["--board", "jetson-orin", "--energy", "--sysfs-root", str(tmp_path / "sysfs"), "--emulate",
                     "--runs", "200", "--json", "-o", str(tmp_path / "b"), str(model)], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["outputs_match"] is True and res["emulated"] is True and res["latency"]["runs"] == 200
    e, ms = res["energy"], res["latency"]["median_ms"]
    assert ms > 0 and e["samples"] >= 2 and e["window_s"] > 0
    assert e["joules_per_inference"] == pytest.approx(watts * ms / 1000.0, rel=1e-3)
    assert e["inferences_per_joule"] == pytest.approx(1.0 / e["joules_per_inference"], rel=1e-9)
    assert e["mean_power_w"] == pytest.approx({"VDD_CPU_CV": 4.0, "VDDQ_VDD2_1V8AO": 1.5}, rel=1e-6)
    assert e["total_mean_power_w"] == pytest.approx(watts, rel=1e-6)


def test_missing_rail_names_what_and_where(tmp_path):
    fake_orin(tmp_path / "sysfs", with_ddr=False)
    r = run_measure(["--board", "jetson-orin", "--energy", "--sysfs-root", str(tmp_path / "sysfs"), "--emulate",
                     str(tiny_model(tmp_path / "tiny.onnx"))], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    msg = r.stderr.strip().splitlines()[-1]
    assert "VDDQ_VDD2_1V8AO" in msg and "VDD_CPU_CV" in msg and "ina3221" in msg and "hwmon" in msg, msg
    assert "--sysfs-root" in msg


@pytest.mark.parametrize("board,needle", [("rpi4", "jetson-orin"), ("mps2-an386", "microcontroller")])
def test_energy_on_a_board_without_rails_is_refused(board, needle, tmp_path):
    r = run_measure(["--board", board, "--energy", "--emulate", str(tiny_model(tmp_path / "tiny.onnx"))], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr


def test_jetson_binary_does_not_run_natively_on_another_machine(tmp_path):
    fake_orin(tmp_path / "sysfs")
    r = run_measure(["--board", "jetson-orin", "--energy", "--sysfs-root", str(tmp_path / "sysfs"),
                     str(tiny_model(tmp_path / "tiny.onnx"))], tmp_path)
    assert r.returncode == 2 and "--emulate" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_xavier_jetpack4_iio_layout(tmp_path):
    """JetPack 4: NVIDIA's ina3221x IIO driver, rail_name_<n>, in_voltage<n>_input / in_current<n>_input."""
    for dev, iio, names in (("1-0040", "iio:device0", ["GPU", "CPU", "SOC"]),
                            ("1-0041", "iio:device1", ["CV", "VDDRQ", "SYS5V"])):
        d = tmp_path / "sys/bus/i2c/drivers/ina3221x" / dev / iio
        d.mkdir(parents=True)
        for n, name in enumerate(names):
            (d / f"rail_name_{n}").write_text(name + "\n")
            (d / f"in_voltage{n}_input").write_text("19000\n")
            (d / f"in_current{n}_input").write_text(f"{100 * (n + 1)}\n")
    rails = energy.find_rails(boards.get_board("jetson-xavier"), tmp_path)
    assert [r.name for r in rails] == ["CPU", "VDDRQ"]
    assert [r.watts() for r in rails] == pytest.approx([19.0 * 0.2, 19.0 * 0.2])


class RampRail:
    """A rail whose power rises linearly in time: P(t) = 2 W + 3 W/s * t."""
    name = "RAMP"

    def __init__(self):
        self.t0 = time.monotonic()

    def watts(self) -> float:
        return 2.0 + 3.0 * (time.monotonic() - self.t0)


def test_integrator_against_a_time_varying_power():
    t = [i * math.pi / 1000 for i in range(1001)]
    assert energy.integrate(t, [math.sin(x) for x in t]) == pytest.approx(2.0, rel=1e-5)
    rail = RampRail()
    with energy.PowerSampler([rail], interval=0.02) as s:
        time.sleep(0.4)
    a, b = s.times[0] - rail.t0, s.times[-1] - rail.t0
    exact = 2.0 * (b - a) + 1.5 * (b * b - a * a)
    assert len(s.times) >= 10 and s.seconds == pytest.approx(b - a)
    assert s.joules() == pytest.approx(exact, rel=0.02)


def test_sampler_reports_a_rail_that_stops_reading(tmp_path):
    fake_orin(tmp_path)
    rails = energy.find_rails(boards.get_board("jetson-orin"), tmp_path)
    with pytest.raises(TinydeployError, match="cannot read power rail"):
        with energy.PowerSampler(rails, interval=0.01):
            rails[0].current_ma.unlink()
            time.sleep(0.1)
