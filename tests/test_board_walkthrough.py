"""Adding a board is data (docs/architecture.md, "Adding a board"): a manifest in boards/, at most
a port file in firmware_templates/mcu/, and an inventory entry for the rig. These tests follow
that walkthrough for the two boards added that way, the ST NUCLEO-L4R5ZI (Cortex-M4F, the MLPerf
Tiny reference board) and the STM32F746 Discovery (Cortex-M7, emulated on QEMU's mps2-an500):
the manifests are valid, the firmware for the real board builds (its port compiles under the
target's -Werror flags, with make and with offline PlatformIO) and links where the chip's flash
is, and the model runs bit-exact under emulation with the board's own limits."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tinydeploy.firmware import MCU_TEMPLATES
from tinydeploy.targets.boards import get_board, load_all, manifest_data, validate
from util import mlperf_model, require

NEW = {  # board -> (emulated by, core, FPU flag)
    "nucleo-l4r5zi": ("mps2-an386", "cortex-m4", "-mfpu=fpv4-sp-d16"),
    "stm32f746-disco": ("mps2-an500", "cortex-m7", "-mfpu=fpv5-sp-d16"),
}


def tdy(*args, cwd):
    return subprocess.run([sys.executable, "-m", "tinydeploy", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=1200)


@pytest.mark.parametrize("board_id", list(NEW))
def test_manifest_port_and_target(board_id):
    machine, core, fpu = NEW[board_id]
    validate(manifest_data(board_id), f"{board_id}.json")
    b = get_board(board_id)
    assert b.is_mcu and b.emulator().id == machine and b.emulator().is_qemu_machine
    assert (MCU_TEMPLATES / f"port_{b.port}.c").is_file()
    t = b.make_target()
    assert f"-mcpu={core}" in t.cflags and fpu in t.cflags and "-Werror" in t.cflags
    assert t.isa_with_role("dsp8") and t.isa_with_role("fpu32") and not t.caches
    assert b.flash_origin == 0x08000000 and b.upload["tool"] == "openocd"
    assert board_id in load_all()


@pytest.mark.parametrize("builder", ["make", "pio"])
@pytest.mark.parametrize("board_id", list(NEW))
def test_real_board_firmware_builds(board_id, builder, tmp_path):
    require("arm-none-eabi-gcc")
    out = tmp_path / "fw"
    r = tdy("build", "--board", board_id, "--builder", builder, mlperf_model("kws_dscnn_int8.onnx"), "-o", out,
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    elf = out / ("build/firmware.elf" if builder == "make" else f".pio/build/{board_id}/firmware.elf")
    assert elf.is_file()
    objdump = subprocess.run(["arm-none-eabi-objdump", "-h", str(elf)], capture_output=True, text=True).stdout
    vector = next(ln for ln in objdump.splitlines() if ".isr_vector" in ln).split()
    assert int(vector[3], 16) == 0x08000000          # linked where the chip's flash is
    assert (out / "src" / f"port_{get_board(board_id).port}.c").is_file()
    assert not (out / "arduino").exists()             # the Arduino port is for Arduino boards only
    assert "openocd" in (out / "Makefile").read_text()


@pytest.mark.parametrize("board_id", list(NEW))
def test_runs_bit_exact_under_emulation_with_its_own_limits(board_id, tmp_path):
    require("qemu-system-arm")
    r = tdy("run", "--board", board_id, "--emulate", mlperf_model("kws_dscnn_int8.onnx"), "--json", "-o",
            tmp_path / "fw", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    b = get_board(board_id)
    assert res["outputs_match"] and res["exact_reference"]["identical"], res
    assert res["memory"]["flash_limit_bytes"] == b.flash_bytes and res["memory"]["ram_limit_bytes"] == b.ram_bytes
    assert res["latency"]["instructions"] > 0 and res["emulated"] is True
