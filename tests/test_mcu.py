"""Cortex-M4 firmware: boards as data, the generated Make project, the memory report and refusal,
and MLPerf Tiny models run under QEMU (mps2-an386) against onnxruntime with exact, repeatable
instruction counts."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tinydeploy import reference
from tinydeploy.targets import boards
from tinydeploy.runners import qemu_system as emulator
from tinydeploy import firmware
from tinydeploy.errors import TinydeployError
from tinydeploy.pipeline import compile_model
from tinydeploy.targets import get_target
from tinydeploy.runners.qemu_system import qemu_processes
from util import mlperf_model, require

FP32_RTOL = 1e-4


def qemu_children() -> list[int]:
    """QEMU processes this test process started and that are still alive."""
    return qemu_processes()


@pytest.fixture(autouse=True)
def no_qemu_left_behind():
    yield
    assert not emulator._LIVE, "an Emulator was not stopped"
    left = qemu_children()
    assert not left, f"QEMU processes left running: {left}"


@pytest.fixture(scope="module")
def toolchain():
    require("arm-none-eabi-gcc")
    require("qemu-system-arm")
    require("make")


@pytest.fixture(scope="module")
def kws(toolchain):
    path = mlperf_model("kws_dscnn_fp32.onnx")
    c = compile_model(path, get_target("cortex-m4"), board="mps2-an386")
    spec = [(n, tuple(c.graph.t(n).shape), np.dtype(c.graph.t(n).dtype)) for n in c.graph.inputs]
    out_specs = [(tuple(c.graph.t(n).shape), np.dtype(c.graph.t(n).dtype)) for n in c.graph.outputs]
    feeds = reference.random_inputs(spec, seed=0)
    want = reference.run_onnxruntime(path.read_bytes(), feeds)
    return c, [feeds[n] for n, _, _ in spec], out_specs, want


# ---- boards and target --------------------------------------------------------------------

def test_mcu_boards_are_valid_data():
    b = boards.load_all()
    an386, nano = b["mps2-an386"], b["nano33ble"]
    assert an386.is_qemu_machine and an386.qemu["machine"] == "mps2-an386"
    assert (an386.flash_origin, an386.ram_origin) == (0, 0x20000000)
    assert nano.flash_bytes == 983_040 and nano.flash_origin == 0x10000
    assert nano.ram_bytes == 262_144 and nano.clock_hz == 64_000_000
    assert nano.emulator() is an386 and nano.upload["tool"] == "bossac"
    for board in (an386, nano):
        assert (firmware.MCU_TEMPLATES / f"port_{board.port}.c").is_file()
        assert board.target == "cortex-m4" and board.make_target().isa_with_role("dsp8") == "cortex-m4-dsp"


@pytest.mark.parametrize("change", [{"port": "Bad-Port"}, {"serial_baud": 300}, {"ram_bytes": 0},
                                    {"flash_origin": -1}, {"emulate": "mps2-an386"}])
def test_invalid_mcu_manifests_are_refused(change):
    data = dict(boards.manifest_data("nano33ble"), **change)
    with pytest.raises(TinydeployError, match="invalid board manifest"):
        boards.validate(data, "nano33ble.json")


def test_cortex_m4_target():
    t = get_target("cortex-m4")
    for flag in ("-mcpu=cortex-m4", "-mthumb", "-mfloat-abi=hard", "-mfpu=fpv4-sp-d16", "-O2",
                 "-ffunction-sections", "-fdata-sections", "-Werror", "-Wall", "-Wextra"):
        assert flag in t.cflags
    assert t.isas == ["cortex-m4-dsp", "cortex-m4-fpu"] and t.alignment in (8, 16)


def test_missing_arm_gcc_names_the_debian_package(monkeypatch):
    monkeypatch.setenv("ARM_CC", "arm-none-eabi-gcc-not-installed")
    with pytest.raises(TinydeployError, match="apt-get install gcc-arm-none-eabi libnewlib-arm-none-eabi"):
        get_target("cortex-m4").compiler()


def test_model_ids_for_the_energyrunner():
    assert [firmware.model_id(n) for n in ("kws_dscnn_fp32.onnx", "ic_resnet8_int8.onnx", "vww_x.onnx", "ad_a.onnx")] \
        == ["kws01", "ic01", "vww01", "ad01"]


# ---- the project folder -------------------------------------------------------------------

def test_project_builds_with_make_alone_for_both_boards(kws, tmp_path):
    c = kws[0]
    for board in ("mps2-an386", "nano33ble"):
        out = firmware.write_project(tmp_path / board, c, board)
        for name in ("Makefile", "README.md", "link.ld", "src/harness.c", "src/port.h", "src/model.c",
                     "src/startup_cortex_m.c", "src/harness_config.h"):
            assert (out / name).is_file(), name
        mk = (out / "Makefile").read_text()
        assert "-Werror" in mk and "--gc-sections" in mk and "tinydeploy" not in mk.split("\n", 3)[3]
        # plain make, no Python involved
        r = subprocess.run(["make", "-C", str(out), "-j2"], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        elf = out / "build" / "firmware.elf"
        assert (out / "build" / "firmware.bin").is_file() and (out / "build" / "firmware.hex").is_file()
        entry = next(s for s in firmware.sections(elf, boards.get_board(board)) if s["name"] == ".isr_vector")
        assert entry["vma"] == boards.get_board(board).flash_origin
        syms = subprocess.run(["arm-none-eabi-nm", str(elf)], capture_output=True, text=True).stdout
        assert not re.search(r"\b(malloc|_malloc_r|_sbrk)\b", syms), "the firmware must not use the heap"
    nano = tmp_path / "nano33ble"
    assert (nano / "src" / "port_nrf52840.c").is_file() and (nano / "arduino" / "port_arduino.cpp").is_file()
    assert "upload:" in (nano / "Makefile").read_text() and "bossac" in (nano / "README.md").read_text()
    assert "run:" in (tmp_path / "mps2-an386" / "Makefile").read_text()


def test_arduino_port_compiles_against_the_arduino_api(tmp_path):
    """port_arduino.cpp cannot be built for real offline; check it against a stub of the few
    Arduino calls it makes."""
    gxx = shutil.which("arm-none-eabi-g++") or shutil.which("g++")
    if gxx is None:
        pytest.fail("no C++ compiler (apt-get install g++)")
    (tmp_path / "Arduino.h").write_text(
        "#include <stdint.h>\n#include <stddef.h>\n"
        "struct SerialStub { void begin(unsigned long); operator bool(); size_t write(uint8_t);"
        " int available(); int read(); void flush(); };\nextern SerialStub Serial;\nunsigned long micros(void);\n")
    (tmp_path / "harness_config.h").write_text("/* no profile: the port's defaults */\n")
    r = subprocess.run([gxx, "-fsyntax-only", "-Wall", "-Wextra", "-Werror", f"-I{tmp_path}",
                        f"-I{firmware.MCU_TEMPLATES}", str(firmware.MCU_TEMPLATES / "port_arduino.cpp")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_refuses_to_overwrite_a_folder_it_did_not_make(kws, tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(TinydeployError, match="not empty"):
        firmware.write_project(tmp_path, kws[0], "mps2-an386")
    assert (tmp_path / "mine.txt").read_text() == "keep me"


# ---- fitting --------------------------------------------------------------------------------

def test_ad_autoencoder_fp32_is_refused_for_nano33ble_with_the_numbers(toolchain, tmp_path):
    path = mlperf_model("ad_autoencoder_fp32.onnx")
    c = compile_model(path, get_target("cortex-m4"), board="nano33ble")
    assert c.weights_bytes > 983_040
    for emulate in (False, True):
        with pytest.raises(TinydeployError) as e:
            firmware.build_firmware(c, "nano33ble", tmp_path / f"fw{emulate}", emulate=emulate)
        msg = str(e.value)
        assert "does not fit nano33ble" in msg and "flash" in msg
        assert f"{c.weights_bytes:,} B" in msg and "983,040 B" in msg
        assert "quantise" in msg
    with pytest.raises(TinydeployError, match="does not fit nano33ble"):
        firmware.run_on_emulator(c, "nano33ble", [np.zeros((1, 640), np.float32)], [((1, 640), np.float32)])


def test_link_overflow_is_reported_with_the_numbers(kws, tmp_path, monkeypatch):
    """A model that passes the weights/arena estimate but not the link (code + weights) still
    gets a one-line answer with the numbers."""
    c = kws[0]
    board = dataclasses.replace(boards.get_board("nano33ble"), flash_bytes=95_000)
    monkeypatch.setattr(firmware, "mcu_board", lambda board_id: board)
    with pytest.raises(TinydeployError) as e:
        firmware.build_firmware(c, "nano33ble", tmp_path / "fw")
    msg = str(e.value)
    assert "does not fit nano33ble" in msg and "FLASH needs" in msg and "95,000 B" in msg


# ---- running under QEMU ---------------------------------------------------------------------

def test_kws_fp32_on_mps2_an386_matches_onnxruntime_with_repeatable_instruction_counts(kws):
    c, inputs, out_specs, want = kws
    outs, instructions, mem = firmware.run_on_emulator(c, "mps2-an386", inputs, out_specs)
    res = reference.compare(outs, want, FP32_RTOL)
    assert res["outputs_match"], res
    # the reference fp32 kernels: about 2.66 M MACs, a little over 8 instructions per MAC
    assert 5_000_000 < instructions < 100_000_000, instructions
    assert mem["fits"] and mem["board"] == "mps2-an386"
    assert mem["flash_used_bytes"] >= c.weights_bytes and mem["ram_used_bytes"] >= c.plan.arena_bytes
    assert 0 < mem["stack_used_bytes"] < mem["stack_reserved_bytes"]
    # a second QEMU run, from a fresh build, counts exactly the same instructions
    outs2, instructions2, _ = firmware.run_on_emulator(c, "mps2-an386", inputs, out_specs)
    assert instructions2 == instructions
    assert all(np.array_equal(a, b) for a, b in zip(outs, outs2))
    print(f"KWS fp32 on mps2-an386: {instructions:,} instructions per inference, flash "
          f"{mem['flash_used_bytes']:,} B, RAM {mem['ram_used_bytes']:,} B")


def test_nano33ble_emulated_keeps_its_own_limits(kws):
    c, inputs, out_specs, want = kws
    outs, instructions, mem = firmware.run_on_emulator(c, "nano33ble", inputs, out_specs, runs=3, warmup=1)
    assert reference.compare(outs, want, FP32_RTOL)["outputs_match"]
    assert mem["board"] == "nano33ble" and mem["built_for"] == "mps2-an386"
    assert mem["flash_bytes"] == 983_040 and mem["ram_bytes"] == 262_144
    assert mem["min_latency_ms_at_clock"] == pytest.approx(instructions / 64e6 * 1e3)


def test_emulator_is_stopped_on_keyboard_interrupt(kws, tmp_path):
    fw = firmware.build_firmware(kws[0], "mps2-an386", tmp_path / "fw")
    with pytest.raises(KeyboardInterrupt):
        with emulator.Emulator(fw.elf, fw.machine) as emu:
            dev = emu.device()
            dev.wait_boot()
            proc = emu.proc
            raise KeyboardInterrupt
    assert proc.poll() is not None


COUNTER_PROBE = r"""
#include <stdint.h>
#include "port.h"
static void say(const char *s) { while (*s) port_putc(*s++); }
static void say_u32(uint32_t v) { char b[12]; int n = 0; do { b[n++] = (char)('0' + v % 10u); v /= 10u; } while (v); while (n) port_putc(b[--n]); }
__attribute__((noinline)) static void delay(volatile uint32_t j) { while (j--) { } }
#define SEQ(N) __attribute__((noinline)) static void seq##N(void) { __asm__ volatile(".rept " #N "\n\tnop\n\t.endr"); }
SEQ(1) SEQ(2) SEQ(39) SEQ(40) SEQ(41) SEQ(1000)
int main(void)
{
    static void (*const fs[6])(void) = {seq1, seq2, seq39, seq40, seq41, seq1000};
    int f;
    uint32_t j;
    port_init();
    for (f = 0; f < 6; ++f) {
        uint32_t lo = 0xFFFFFFFFu, hi = 0, c;
        for (j = 0; j < 160; ++j) {
            delay(j % 61u);                /* start at every phase of the 40-instruction tick */
            port_count_begin();
            fs[f]();
            c = port_count_end();
            lo = c < lo ? c : lo;
            hi = c > hi ? c : hi;
        }
        say("seq "); say_u32(lo); say(" "); say_u32(hi); say("\r\n");
    }
    port_exit(0);
    return 0;
}
"""


def test_mps2_instruction_counter_is_exact_at_every_timer_phase(toolchain, tmp_path):
    """port_mps2.c's counter under -icount shift=0: the same code counts the same at every
    phase of the timer, and one more nop counts exactly one more instruction."""
    board = boards.get_board("mps2-an386")
    src = firmware.MCU_TEMPLATES
    (tmp_path / "probe.c").write_text(COUNTER_PROBE)
    (tmp_path / "harness_config.h").write_text("/* no profile: the port's defaults */\n")
    (tmp_path / "link.ld").write_text(firmware._render("link.ld.j2", title="probe", board_id="mps2-an386",
                                                  flash_origin=0, ram_origin=0x20000000, flash_bytes=1 << 20,
                                                  ram_bytes=1 << 20, stack_bytes=4096))
    t = get_target("cortex-m4")
    r = subprocess.run([t.compiler(), *t.cflags, f"-I{src}", f"-I{tmp_path}", "-nostartfiles", "--specs=nano.specs", "-T", "link.ld",
                        "-o", "probe.elf", "probe.c", str(src / "startup_cortex_m.c"), str(src / "port_mps2.c")],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    q = board.qemu
    r = subprocess.run([q["binary"], "-M", q["machine"], "-display", "none", "-monitor", "none", "-icount", "shift=0",
                        "-semihosting-config", "enable=on,target=native", "-serial", "stdio",
                        "-kernel", str(tmp_path / "probe.elf")], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    rows = [tuple(map(int, ln.split()[1:])) for ln in r.stdout.splitlines() if ln.startswith("seq ")]
    assert len(rows) == 6 and all(lo == hi for lo, hi in rows), rows
    base = rows[0][0] - 1
    assert [lo - base for lo, _ in rows] == [1, 2, 39, 40, 41, 1000]


def test_qemu_that_cannot_start_is_reported(toolchain, tmp_path):
    elf = tmp_path / "fw.elf"
    elf.write_bytes(b"\x7fELF not really")
    board = boards.get_board("mps2-an386")
    board = dataclasses.replace(board, qemu=dict(board.qemu, machine="no-such-machine"))
    with pytest.raises(TinydeployError, match="QEMU did not start .machine .no-such-machine.*unsupported machine type"):
        with emulator.Emulator(elf, board):
            pass
    with pytest.raises(TinydeployError, match="is not a QEMU machine"):
        emulator.Emulator(elf, boards.get_board("nano33ble"))
