"""`tinydeploy measure` against a board over a serial port, proven without hardware: QEMU's
mps2-an386 serial port is a pyserial socket:// URL."""
import json
import subprocess
import sys

from tinydeploy import flow
from tinydeploy.targets import boards
from tinydeploy.runners.qemu_system import Emulator
from util import mlperf_model


def test_measure_over_a_serial_url_matches_onnxruntime(tmp_path):
    model = mlperf_model("kws_dscnn_int8.onnx")
    b = flow.build(model, "mps2-an386", tmp_path / "fw", quiet=True)
    with Emulator(b.firmware.elf, boards.get_board("mps2-an386")) as emu:
        r = subprocess.run([sys.executable, "-m", "tinydeploy", "measure", "--board", "mps2-an386", "--port", emu.url,
                            str(model), "-o", str(tmp_path / "fw"), "--json", "--runs", "2"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["outputs_match"] is True and res["latency"]["runs"] == 2
    assert res["latency"]["instructions"] > 1_000_000
    assert res["memory"]["flash_bytes"] > res["memory"]["weights_bytes"]


def test_a_board_that_does_not_answer_is_a_clear_error(tmp_path):
    model = mlperf_model("kws_dscnn_int8.onnx")
    r = subprocess.run([sys.executable, "-m", "tinydeploy", "measure", "--board", "mps2-an386", "--port", "loop://",
                        str(model), "-o", str(tmp_path / "fw"), "--timeout", "3"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "stopped answering" in r.stderr or "did not answer" in r.stderr, r.stderr


def test_flash_needs_a_built_project(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tinydeploy", "flash", "--board", "nano33ble", str(tmp_path)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "platformio.ini" in r.stderr
