"""The library form on a Cortex-M4 under QEMU (mps2-an386): the int8 KWS and IC models linked into
one image whose harness selects the model by name (`model NAME%`), both matching their references
in one boot, no clashing symbol, flash and RAM per model, one shared arena and its saving; and
the arena, the scratch and the weights placed in the board's other memories (BLOCKRAM, PSRAM:
boards/mps2-an386.json memory_regions) as the linker map shows."""
from __future__ import annotations

import dataclasses
import re
import subprocess

import numpy as np
import pytest

from tinydeploy import firmware, flow, reference
from tinydeploy.codegen.project import Api
from tinydeploy.errors import TinydeployError
from tinydeploy.pipeline import compile_model
from tinydeploy.runners.mcu import QemuSystemRunner, run_models_under_qemu
from tinydeploy.runners.qemu_system import qemu_processes
from tinydeploy.targets import get_target
from tinydeploy.targets.boards import get_board
from test_deploy import tiny_model
from test_library import specs_of
from util import check_8bit, mlperf_model, require


@pytest.fixture(autouse=True)
def toolchain():
    require("arm-none-eabi-gcc")
    require("qemu-system-arm")
    yield
    assert not qemu_processes(), "QEMU left running"


def map_sections(fw_dir) -> dict[str, int]:
    """Output sections of the firmware's linker map: name -> address."""
    text = (fw_dir / "build" / "firmware.map").read_text()
    return {m.group(1): int(m.group(2), 16) for m in re.finditer(r"^(\.\S+)\s+0x([0-9a-f]+)\s+0x[0-9a-f]+", text, re.M)}


@pytest.mark.models
def test_kws_and_ic_in_one_cortex_m4_image_alone_and_on_one_arena(tmp_path):
    paths = [mlperf_model("kws_dscnn_int8.onnx"), mlperf_model("ic_resnet8_int8.onnx")]
    ram = {}
    for share in (False, True):
        b = flow.build_library(paths, "mps2-an386", tmp_path / f"fw-{share}",
                               flow.Library(names=["kws", "ic"], share_arena=share), quiet=True)
        jobs, feeds = [], {}
        for m in b.summary["models"]:
            ins = specs_of(m, "inputs")
            feeds[m["name"]] = reference.random_inputs(ins, 4)
            jobs.append((m["name"], [feeds[m["name"]][n] for n, _, _ in ins],
                         [(s, d) for _, s, d in specs_of(m, "outputs")]))
        got = run_models_under_qemu(b.firmware, jobs)        # one boot, both models
        for m, path in zip(b.summary["models"], paths):
            outs, instructions = got[m["name"]]
            assert instructions > 0
            check_8bit(path, feeds[m["name"]], outs, label=f"{m['name']} share={share}", lsb_scales=m["output_lsb"])
        fwm = b.summary["firmware"]
        per = fwm["models"]
        assert set(per) == {"kws", "ic", "shared"} and per["ic"]["flash_bytes"] > per["kws"]["flash_bytes"] > 0
        assert sum(v["ram_bytes"] for v in per.values()) == fwm["ram_used_bytes"]
        assert sum(v["flash_bytes"] for v in per.values()) == fwm["flash_used_bytes"]
        ram[share] = fwm["ram_used_bytes"]
        if share:
            saved = b.summary["shared_saving_bytes"]
            assert saved == min(m["arena_bytes"] for m in b.summary["models"])
        else:
            assert per["kws"]["ram_bytes"] >= b.summary["models"][0]["arena_bytes"]
        # nm: every global symbol once, each model's named after it
        objs = sorted((b.outdir / "build").glob("*.o"))
        nm = subprocess.run(["arm-none-eabi-nm", "-g", "--defined-only", *map(str, objs)], capture_output=True,
                            text=True, check=True).stdout
        syms = [ln.split()[-1] for ln in nm.splitlines() if re.match(r"^[0-9a-f]+ [A-Z] ", ln)]
        assert len(syms) == len(set(syms)), sorted({s for s in syms if syms.count(s) > 1})
        model_objs = [o for o in objs if o.name.startswith(("kws_", "ic_"))]
        nm = subprocess.run(["arm-none-eabi-nm", "-g", "--defined-only", *map(str, model_objs)], capture_output=True,
                            text=True, check=True).stdout
        assert all(ln.split()[-1].startswith(("kws_", "ic_")) for ln in nm.splitlines()
                   if re.match(r"^[0-9a-f]+ [A-Z] ", ln))
    assert saved <= ram[False] - ram[True] < saved + 16       # (+ alignment padding)


@pytest.mark.models
def test_arena_scratch_and_weights_go_where_asked_on_mps2_an386(tmp_path):
    kws = mlperf_model("kws_dscnn_int8.onnx")
    board = get_board("mps2-an386")
    region = {r["name"]: r for r in board.memory_regions}
    lib = flow.Library(names=["kws"], arena_section=".psram.arena", weights_section=".psram.weights",
                       scratch_section=".blockram")
    b = flow.build_library([kws], board, tmp_path / "fw", lib, quiet=True)
    secs = map_sections(b.outdir)
    psram, blockram = region["PSRAM"]["origin"], region["BLOCKRAM"]["origin"]
    assert psram <= secs[".psram.weights"] < psram + region["PSRAM"]["bytes"]
    assert psram <= secs[".psram.arena"] < psram + region["PSRAM"]["bytes"]
    assert secs[".blockram"] == blockram
    fwm = b.summary["firmware"]
    assert fwm["regions"]["BLOCKRAM"]["used_bytes"] == b.summary["models"][0]["scratch_bytes"] > 0
    assert fwm["regions"]["PSRAM"]["used_bytes"] >= b.summary["models"][0]["weights_bytes"]
    m = b.summary["models"][0]
    runner = QemuSystemRunner()
    x = reference.random_inputs(specs_of(m, "inputs"), 6)
    outs, _ = runner.run(b.firmware, [x[n] for n, _, _ in specs_of(m, "inputs")],
                         [(s, d) for _, s, d in specs_of(m, "outputs")])
    check_8bit(kws, x, outs, label="sections", lsb_scales=m["output_lsb"])
    # the caller's arena: the harness's model table owns it, in the section asked for
    b2 = flow.build_library([kws], board, tmp_path / "fw2", flow.Library(names=["kws"], arena="caller",
                                                                          arena_section=".psram"), quiet=True)
    secs = map_sections(b2.outdir)
    syms = subprocess.run(["arm-none-eabi-nm", str(b2.exe)], capture_output=True,
                          text=True, check=True).stdout
    table = next(int(ln.split()[0], 16) for ln in syms.splitlines() if ln.endswith(" kws_table_arena"))
    assert secs[".psram"] == table >= psram
    outs, _ = runner.run(b2.firmware, [x[n] for n, _, _ in specs_of(m, "inputs")],
                         [(s, d) for _, s, d in specs_of(m, "outputs")])
    check_8bit(kws, x, outs, label="caller arena", lsb_scales=m["output_lsb"])


def test_sections_go_to_the_main_memories_where_the_board_has_no_such_region(tmp_path):
    c = compile_model(tiny_model(tmp_path / "t.onnx"), get_target("cortex-m4"), board="nano33ble",
                      api=Api("t", arena_section=".psram.arena", weights_section=".qspi"))
    link = firmware.project_files(c, "nano33ble", emulate=True)["link.ld"]
    assert re.search(r"\.psram\.arena \(NOLOAD\) :\n    \{\n.*\n.*\n    \} > RAM", link)
    assert re.search(r"\.qspi :\n    \{\n.*\n.*\n    \} > FLASH", link)
    assert "PSRAM (rwx)" not in link        # nano33ble has none, so neither has its emulation
    flashy = dataclasses.replace(get_board("mps2-an386"), memory_regions=(
        {"name": "QSPI", "kind": "flash", "origin": 0x90000000, "bytes": 1 << 20},))
    assert flashy.region_for(".qspi.weights", "flash")["name"] == "QSPI"
    with pytest.raises(TinydeployError, match="written at run time"):
        flashy.region_for(".qspi.arena", "ram")


@pytest.mark.parametrize("library", [[], ["--name", "tiny"]])
def test_platformio_firmware_into_a_relative_folder(tmp_path, library):
    """PlatformIO names the ELF by its absolute path; the marker keeps it relative to -o (which was
    an internal error for a relative -o, as the default build/<model>-<board>/ is)."""
    import json
    from test_bad_input import cli_run
    require("pio")
    tiny_model(tmp_path / "tiny.onnx")
    r = cli_run(tmp_path, "build", "--board", "nano33ble", "tiny.onnx", "-o", "fw", *library, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    marker = json.loads((tmp_path / "fw" / ".tinydeploy.json").read_text())
    assert marker["artifact"] == ".pio/build/nano33ble/firmware.elf"
