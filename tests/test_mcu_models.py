"""The Cortex-M acceptance through the CLI: the MLPerf Tiny models built for the Nano 33 BLE
(PlatformIO, offline), and run under QEMU against onnxruntime with exact instruction counts."""
import json
import os
import subprocess
import sys

import pytest

from test_models import FP32_MODELS
from util import mlperf_model, require

INT8_MODELS = [m.replace("_fp32", "_int8") for m in FP32_MODELS]


def tdy(*args, cwd):
    return subprocess.run([sys.executable, "-m", "tinydeploy", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=1200)


@pytest.mark.parametrize("board,extra", [("mps2-an386", []), ("nano33ble", ["--emulate"])])
@pytest.mark.parametrize("name", INT8_MODELS)
def test_int8_models_run_in_emulation_within_one_lsb(name, board, extra, tmp_path):
    require("qemu-system-arm")
    r = tdy("run", "--board", board, *extra, mlperf_model(name), "--json", "-o", tmp_path / "fw", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["outputs_match"] is True and res["max_abs_error"] <= 1 and res["exact_reference"]["identical"], res
    assert res["latency"]["instructions"] > 0
    mem = res["memory"]
    assert 0 < mem["flash_bytes"] <= mem["flash_limit_bytes"] and 0 < mem["ram_bytes"] <= mem["ram_limit_bytes"]
    if board == "nano33ble":
        assert mem["flash_limit_bytes"] == 983040 and mem["ram_limit_bytes"] == 262144


@pytest.mark.parametrize("name", INT8_MODELS)
def test_nano33ble_build_with_platformio_offline_then_plain_pio_and_make(name, tmp_path):
    require("arm-none-eabi-gcc")
    out = tmp_path / "proj"
    r = tdy("build", "--board", "nano33ble", mlperf_model(name), "-o", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "firmware" in r.stdout and (out / ".pio" / "build" / "nano33ble" / "firmware.elf").is_file()
    for f in ("platformio.ini", "Makefile", "README.md", "link.ld", "src/model.c", "src/harness.c"):
        assert (out / f).is_file(), f
    # The embedded team's own rebuilds, without tinydeploy on the path.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLATFORMIO", "PYTHONPATH"))}
    pio = subprocess.run(["pio", "run"], cwd=out, capture_output=True, text=True, env=env, timeout=600)
    assert pio.returncode == 0, pio.stdout[-2000:]
    mk = subprocess.run(["make", "-C", str(out), "clean", "all"], capture_output=True, text=True, env=env, timeout=600)
    assert mk.returncode == 0, mk.stderr[-2000:]


@pytest.mark.parametrize("name,fits", [("kws_dscnn_fp32.onnx", True), ("ic_resnet8_fp32.onnx", True),
                                       ("vww_mobilenetv1_fp32.onnx", True), ("ad_autoencoder_fp32.onnx", False)])
def test_fp32_models_fit_or_are_refused_with_numbers(name, fits, tmp_path):
    r = tdy("run", "--board", "nano33ble", "--emulate", mlperf_model(name), "--json", "-o", tmp_path / "fw",
            cwd=tmp_path)
    if fits:
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout)["outputs_match"] is True
    else:
        assert r.returncode == 2 and "Traceback" not in r.stderr
        msg = r.stderr.strip().splitlines()[-1]
        assert "does not fit nano33ble" in msg and "quantis" in msg and any(c.isdigit() for c in msg), msg
