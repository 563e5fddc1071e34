"""PlatformIO without its registry: tinydeploy's own core folder, platform and toolchain package.

Every pio run here happens with a network guard (a sitecustomize on PYTHONPATH that records and
refuses any Internet connection or name lookup from pio, SCons or anything else in Python), so a
path that reaches for the PlatformIO registry fails at once and is reported, instead of hanging.
"""
from __future__ import annotations

import configparser
import dataclasses
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tinydeploy.targets import boards
from tinydeploy.firmware import pio as tp
from tinydeploy.errors import TinydeployError
from util import require

QEMU_TIMEOUT_S = 60
BUILD_TIMEOUT_S = 600

# ------------------------------------------------------------------------------------------------
# A tiny self-contained firmware: vector table + reset handler, a "model" library using libm and
# hard float, and semihosting to print and to end QEMU with an exit code.

LINKER = """/* Test linker script: flash {flash_bytes} B at 0x{flash_origin:08X},
   RAM {ram_bytes} B at 0x{ram_origin:08X}. */
MEMORY
{{
  FLASH (rx)  : ORIGIN = 0x{flash_origin:08X}, LENGTH = {flash_bytes}
  RAM   (rwx) : ORIGIN = 0x{ram_origin:08X}, LENGTH = {ram_bytes}
}}
ENTRY(reset_handler)
_estack = ORIGIN(RAM) + LENGTH(RAM);
SECTIONS
{{
  .vectors : {{ KEEP(*(.vectors)) }} > FLASH
  .text : {{ *(.text*) *(.rodata*) . = ALIGN(4); }} > FLASH
  .ARM.exidx : {{ *(.ARM.exidx*) }} > FLASH
  _sidata = LOADADDR(.data);
  .data : {{ _sdata = .; *(.data*) . = ALIGN(4); _edata = .; }} > RAM AT > FLASH
  .bss (NOLOAD) : {{ _sbss = .; *(.bss*) *(COMMON) . = ALIGN(4); _ebss = .; }} > RAM
}}
"""

STARTUP_C = r"""/* Minimal Cortex-M startup: vector table, reset handler (copy .data, zero .bss, enable the FPU). */
#include <stdint.h>

extern uint32_t _estack, _sidata, _sdata, _edata, _sbss, _ebss;
int main(void);
void reset_handler(void);

static void fault_handler(void) { for (;;) { } }

__attribute__((section(".vectors"), used))
static void (*const vectors[16])(void) = {
    (void (*)(void))(&_estack), reset_handler, fault_handler, fault_handler,
    fault_handler, fault_handler, fault_handler, 0, 0, 0, 0,
    fault_handler, fault_handler, 0, fault_handler, fault_handler,
};

void reset_handler(void)
{
    uint32_t *src = &_sidata, *dst = &_sdata;
    while (dst < &_edata) *dst++ = *src++;
    for (dst = &_sbss; dst < &_ebss; ) *dst++ = 0;
    *(volatile uint32_t *)0xE000ED88u |= 0xFu << 20;   /* CPACR: CP10 and CP11 full access */
    __asm volatile ("dsb\n isb");
    (void)main();
    for (;;) { }
}
"""

SEMIHOST_H = r"""#ifndef SEMIHOST_H
#define SEMIHOST_H
void semihost_write0(const char *s);
void semihost_exit(int code) __attribute__((noreturn));
#endif
"""

SEMIHOST_C = r"""/* Arm semihosting through bkpt 0xab: SYS_WRITE0 (0x04) and SYS_EXIT_EXTENDED (0x20). */
#include "semihost.h"
#include <stdint.h>

static int semihost_call(int op, const void *arg)
{
    register int r0 __asm__("r0") = op;
    register const void *r1 __asm__("r1") = arg;
    __asm volatile ("bkpt 0xab" : "+r"(r0) : "r"(r1) : "memory");
    return r0;
}

void semihost_write0(const char *s) { (void)semihost_call(0x04, s); }

void semihost_exit(int code)
{
    uint32_t block[2] = {0x20026u /* ADP_Stopped_ApplicationExit */, (uint32_t)code};
    (void)semihost_call(0x20, block);
    for (;;) { }
}
"""

MODEL_H = r"""#ifndef TINY_MODEL_H
#define TINY_MODEL_H
float tiny_model_run(float x);
#endif
"""

MODEL_C = r"""#include "tiny_model.h"
#include <math.h>

static float bias = 0.5f;      /* .data: checks the copy from flash */
static float scratch[8];       /* .bss: checks the zeroing */

float tiny_model_run(float x)
{
    for (int i = 0; i < 8; i++) scratch[i] += x * (float)i;
    return expf(scratch[1]) + sqrtf(scratch[4]) + bias;   /* libm, hard float */
}
"""

MAIN_C = r"""#include "semihost.h"
#include "tiny_model.h"

int main(void)
{
    volatile float x = 1.0f;
    float y = tiny_model_run(x);   /* e + 2 + 0.5 = 5.218 */
    if (y > 5.21f && y < 5.23f) {
        semihost_write0("tinydeploy-pio: ok\n");
        semihost_exit(0);
    }
    semihost_write0("tinydeploy-pio: wrong result\n");
    semihost_exit(3);
}
"""

BROKEN_C = "int main(void) { return undeclared_thing; }\n"

# Records and refuses every Internet connection and name lookup made by a Python process.
GUARD = r'''
import os, socket
_LOG = os.environ.get("TD_NET_GUARD_LOG")
_LOCAL = (None, "", "localhost", "127.0.0.1", "::1")

def _deny(what, where):
    if _LOG:
        with open(_LOG, "a") as fh:
            fh.write("pid %d %s %r\n" % (os.getpid(), what, where))
    raise OSError("network access refused by the tinydeploy test guard: %r" % (where,))

_connect, _connect_ex, _getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOCAL:
        _deny("connect", address)
    return _connect(self, address)

def connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOCAL:
        _deny("connect_ex", address)
    return _connect_ex(self, address)

def getaddrinfo(host, *args, **kwargs):
    if host not in _LOCAL:
        _deny("getaddrinfo", host)
    return _getaddrinfo(host, *args, **kwargs)

socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
'''


@pytest.fixture(scope="module")
def pio_core(tmp_path_factory):
    """A fresh tinydeploy PlatformIO core folder for this module, with the network guard on."""
    require("pio")
    require("arm-none-eabi-gcc")
    try:
        import SCons  # noqa: F401
    except ImportError:
        pytest.fail("SCons is not installed; run `pip install scons` (tinydeploy makes PlatformIO's "
                    "tool-scons from it)")
    root = tmp_path_factory.mktemp("pio")
    guard_dir = root / "guard"
    guard_dir.mkdir()
    (guard_dir / "sitecustomize.py").write_text(GUARD)
    net_log = root / "network-attempts.log"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINYDEPLOY_PIO_CORE", str(root / "core"))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(guard_dir), os.environ.get("PYTHONPATH")])))
        mp.setenv("TD_NET_GUARD_LOG", str(net_log))
        t0 = time.monotonic()
        env = tp.ensure_core()
        cold = time.monotonic() - t0
        yield {"env": env, "core": root / "core", "net_log": net_log, "cold_ensure_s": cold}
    assert not net_log.exists(), f"something reached for the network:\n{net_log.read_text()}"


def no_network(pio_core):
    log = pio_core["net_log"]
    assert not log.exists(), f"something reached for the network:\n{log.read_text()}"


def elf_header(path: Path) -> dict:
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF", f"{path} is not an ELF file"
    ei_class, ei_data = data[4], data[5]
    assert (ei_class, ei_data) == (1, 1), "expected a 32-bit little-endian ELF"
    e_machine, = struct.unpack_from("<H", data, 18)
    e_entry, e_phoff = struct.unpack_from("<II", data, 24)
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 42)
    loads = []
    for i in range(e_phnum):
        p_type, _, _, p_paddr, p_filesz = struct.unpack_from("<IIIII", data, e_phoff + i * e_phentsize)
        if p_type == 1 and p_filesz:
            loads.append(p_paddr)
    return {"machine": e_machine, "entry": e_entry, "load_addresses": sorted(loads)}


def make_project(project: Path, board_id: str) -> dict:
    board = boards.get_board(board_id)
    tp.write_platformio_ini(project, board_id, ldscript="link.ld", model="tiny_model",
                            build_flags=["-std=c99", "-Wall", "-Wextra", "-Werror"])
    tp.write_sources(project, "tiny_model",
                     src={"startup.c": STARTUP_C, "semihost.c": SEMIHOST_C, "main.c": MAIN_C},
                     include={"semihost.h": SEMIHOST_H},
                     lib={"tiny_model.h": MODEL_H, "tiny_model.c": MODEL_C})
    (project / "link.ld").write_text(LINKER.format(**dataclasses.asdict(board)))
    return board


def test_network_guard_catches_a_connection(pio_core, tmp_path):
    """The guard this module relies on must really see a connection attempt."""
    log = tmp_path / "net.log"
    env = dict(pio_core["env"], TD_NET_GUARD_LOG=str(log))
    subprocess.run([sys.executable, "-c", "import socket\ntry:\n socket.create_connection(('example.com', 80), 1)\n"
                    "except OSError:\n pass"], env=env, timeout=60, check=True)
    assert "getaddrinfo 'example.com'" in log.read_text()


def test_core_folder_is_complete_and_second_ensure_is_fast(pio_core):
    core = pio_core["core"]
    assert (core / "packages" / "tool-scons" / ".piopm").is_file()
    assert '"owner": "platformio"' in (core / "packages" / "tool-scons" / ".piopm").read_text()
    gcc_link = core / "tinydeploy" / "toolchain-gccarmnoneeabi" / "bin" / "arm-none-eabi-gcc"
    assert gcc_link.is_symlink() and os.path.samefile(gcc_link, shutil.which("arm-none-eabi-gcc"))
    pboards = core / "tinydeploy" / "platform-cortexm" / "boards"
    mcu = sorted(b for b, d in boards.load_all().items() if d.is_mcu)
    assert sorted(p.stem for p in pboards.glob("*.json")) == mcu
    env = pio_core["env"]
    assert env["PLATFORMIO_CORE_DIR"] == str(core)
    assert env["PLATFORMIO_DISABLE_UPGRADE_CHECK"] == "true"
    assert env["PLATFORMIO_SETTING_ENABLE_TELEMETRY"] == "no"
    t0 = time.monotonic()
    again = tp.ensure_core()
    warm = time.monotonic() - t0
    print(f"ensure_core: cold {pio_core['cold_ensure_s']:.2f} s, warm {warm * 1000:.0f} ms")
    assert warm < 2.0
    assert {k: v for k, v in again.items() if k.startswith("PLATFORMIO")} == \
        {k: v for k, v in env.items() if k.startswith("PLATFORMIO")}
    # a missing piece would send pio to the registry: ensure_core puts it back
    (core / "packages" / "tool-scons" / ".piopm").unlink()
    tp.ensure_core()
    assert (core / "packages" / "tool-scons" / ".piopm").is_file()


def test_offline_build_then_plain_pio_run_then_qemu(pio_core, tmp_path):
    project = tmp_path / "proj"
    make_project(project, "mps2-an386")

    t0 = time.monotonic()
    elf = tp.pio_build(project, "mps2-an386", timeout=BUILD_TIMEOUT_S)
    first = time.monotonic() - t0
    hdr = elf_header(elf)
    assert elf == project / ".pio" / "build" / "mps2-an386" / "firmware.elf"
    assert hdr["machine"] == 40, "not an ARM ELF"
    assert hdr["load_addresses"][0] == 0
    assert (elf.parent / "firmware.bin").is_file() and (elf.parent / "firmware.hex").is_file()
    no_network(pio_core)

    # What an embedded team does: a plain `pio run` in the folder with the same environment.
    t0 = time.monotonic()
    r = subprocess.run(["pio", "run", "-t", "clean"], cwd=project, env=pio_core["env"], capture_output=True,
                       text=True, timeout=BUILD_TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not elf.exists()
    r = subprocess.run(["pio", "run"], cwd=project, env=pio_core["env"], capture_output=True, text=True,
                       timeout=BUILD_TIMEOUT_S)
    plain = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[SUCCESS]" in r.stdout and "mps2-an386" in r.stdout
    assert elf_header(elf)["machine"] == 40
    # ... and with no PlatformIO variables at all: platformio.ini names the core folder itself.
    bare = {k: v for k, v in pio_core["env"].items() if not k.startswith("PLATFORMIO_")}
    bare["HOME"] = str(tmp_path / "home")
    elf.unlink()
    r = subprocess.run(["pio", "run"], cwd=project, env=bare, capture_output=True, text=True,
                       timeout=BUILD_TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    assert elf.is_file() and not (tmp_path / "home").exists()
    t0 = time.monotonic()
    tp.pio_build(project, "mps2-an386", timeout=BUILD_TIMEOUT_S, quiet=True)
    warm = time.monotonic() - t0
    print(f"pio build: first {first:.2f} s, clean + plain pio run {plain:.2f} s, up to date {warm:.2f} s")
    no_network(pio_core)

    qemu = require("qemu-system-arm")
    r = subprocess.run([qemu, "-M", "mps2-an386", "-display", "none", "-monitor", "none", "-serial", "none",
                        "-semihosting-config", "enable=on,target=native", "-kernel", str(elf)],
                       capture_output=True, text=True, timeout=QEMU_TIMEOUT_S)
    assert "tinydeploy-pio: ok" in r.stdout + r.stderr, r.stdout + r.stderr   # semihosting writes to stderr
    assert r.returncode == 0


def test_nano33ble_ini_has_offline_and_arduino_envs(tmp_path):
    ini = tp.write_platformio_ini(tmp_path, "nano33ble", build_flags=["-std=c99"])
    cfg = configparser.ConfigParser(inline_comment_prefixes=None)
    cfg.read(ini)
    assert cfg["platformio"]["default_envs"] == "nano33ble"   # a bare `pio run` stays offline
    off = cfg["env:nano33ble"]
    assert off["platform"] == f"symlink://{tp.platform_dir()}"
    assert off["board"] == "nano33ble" and off["board_build.ldscript"] == "link.ld"
    flags = off["build_flags"].split()
    for f in ("-mcpu=cortex-m4", "-mthumb", "-mfloat-abi=hard", "-mfpu=fpv4-sp-d16", "-O2", "-std=c99"):
        assert f in flags
    ard = cfg["env:nano33ble_arduino"]
    assert (ard["platform"], ard["board"], ard["framework"]) == ("nordicnrf52", "nano33ble", "arduino")
    text = ini.read_text()
    assert "needs the PlatformIO registry" in text.replace("\n; ", " ")
    # tinydeploy never builds the registry env (it would hang a minute offline, then fail)
    t0 = time.monotonic()
    with pytest.raises(TinydeployError, match="needs the PlatformIO registry"):
        tp.pio_build(tmp_path, "nano33ble_arduino")
    assert time.monotonic() - t0 < 5
    assert tp.env_platform(tmp_path, "nano33ble") == f"symlink://{tp.platform_dir()}"
    # boards without a stock PlatformIO board get only the offline env
    cfg2 = configparser.ConfigParser()
    cfg2.read(tp.write_platformio_ini(tmp_path / "mps2", "mps2-an386"))
    assert [s for s in cfg2.sections() if s.startswith("env:")] == ["env:mps2-an386"]


def test_ini_refuses_boards_that_are_not_microcontrollers(tmp_path):
    with pytest.raises(TinydeployError, match="not a microcontroller"):
        tp.write_platformio_ini(tmp_path, "host")
    with pytest.raises(TinydeployError, match="unknown board"):
        tp.write_platformio_ini(tmp_path, "no-such-board")


def test_board_manifest_carries_cpu_memory_and_upload(pio_core):
    m = tp.pio_board_manifest(boards.get_board("nano33ble"))
    assert m["build"]["cpu"] == "cortex-m4" and m["build"]["fpu"] == "fpv4-sp-d16"
    assert m["build"]["f_cpu"] == "64000000L"
    assert m["upload"]["maximum_size"] == 983040 and m["upload"]["maximum_ram_size"] == 262144
    assert m["upload"]["protocol"] == "sam-ba" and m["upload"]["use_1200bps_touch"] is True


def test_nano33ble_builds_offline_and_upload_calls_bossac(pio_core, tmp_path, monkeypatch):
    project = tmp_path / "nano"
    make_project(project, "nano33ble")
    elf = tp.pio_build(project, "nano33ble", timeout=BUILD_TIMEOUT_S, quiet=True)
    hdr = elf_header(elf)
    assert hdr["machine"] == 40 and hdr["load_addresses"][0] == 0x10000   # after the Arduino bootloader

    port = str(tmp_path / "ttyACM-test")
    assert tp.upload_command(project, "nano33ble", port)[1:] == [
        "run", "-e", "nano33ble", "-d", str(project.resolve()), "-t", "upload", "--upload-port", port]

    # A stand-in bossac records its arguments; the 1200-baud touch needs a real board, so this env
    # turns it off and checks the rest of the upload path.
    fake = tmp_path / "fakebin"
    fake.mkdir()
    args_file = tmp_path / "bossac-args.txt"
    (fake / "bossac").write_text(f"#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done > {args_file}\n")
    (fake / "bossac").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    with open(project / "platformio.ini", "a") as fh:
        fh.write("\n[env:nano33ble_test]\nextends = env:nano33ble\n"
                 "board_upload.use_1200bps_touch = no\nboard_upload.wait_for_upload_port = no\n")
    tp.pio_upload(project, "nano33ble_test", port=port, timeout=BUILD_TIMEOUT_S, quiet=True)
    args = args_file.read_text().split("\n")
    bin_path = str(Path(".pio") / "build" / "nano33ble_test" / "firmware.bin")
    assert args[:8] == ["--port", port, "-U", "-i", "-e", "-w", "-R", bin_path], args
    no_network(pio_core)


def test_compile_error_is_one_line_pointing_to_the_log(pio_core, tmp_path):
    project = tmp_path / "broken"
    make_project(project, "mps2-an386")
    (project / "src" / "main.c").write_text(BROKEN_C)
    with pytest.raises(TinydeployError) as e:
        tp.pio_build(project, "mps2-an386", timeout=BUILD_TIMEOUT_S, quiet=True)
    msg = str(e.value)
    assert "\n" not in msg and "undeclared_thing" in msg and "full log:" in msg
    log = Path(msg.rsplit("full log: ", 1)[1])
    assert log.is_file() and "undeclared_thing" in log.read_text()


@pytest.mark.parametrize("missing", ["pio", "arm-none-eabi-gcc", "SCons"])
def test_missing_tools_say_what_to_install(missing, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYDEPLOY_PIO_CORE", str(tmp_path / "core"))
    if missing == "pio":
        monkeypatch.setattr(tp.shutil, "which", lambda name: None)
        monkeypatch.setattr(tp.sys, "executable", str(tmp_path / "python"))
        expect = "pip install platformio"
    elif missing == "arm-none-eabi-gcc":
        real_which = shutil.which
        monkeypatch.setattr(tp.shutil, "which", lambda name: None if name.startswith("arm-") else real_which(name))
        expect = "apt-get install gcc-arm-none-eabi"
    else:
        real_find = tp.importlib.util.find_spec
        monkeypatch.setattr(tp.importlib.util, "find_spec", lambda n, *a: None if n == "SCons" else real_find(n, *a))
        expect = "pip install scons"
    with pytest.raises(TinydeployError, match=expect) as e:
        tp.ensure_core()
    assert "\n" not in str(e.value)
