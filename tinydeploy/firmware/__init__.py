"""Microcontroller firmware: a self-contained project folder around the generated model, built
with arm-none-eabi-gcc through its own Makefile, a memory report from the ELF, and runs under QEMU.

    files = compile_model(onnx, get_board("mps2-an386").make_target(), board="mps2-an386").files
    fw = build_firmware(files, "mps2-an386", "out/")      # out/Makefile, out/src/..., out/build/firmware.elf
    outputs, instructions, memory = run_on_emulator(files, "nano33ble", [x], out_specs)

The project folder builds without tinydeploy (`make`); the firmware speaks the MLPerf Tiny
EnergyRunner protocol (firmware_templates/mcu/harness.c), so the open runner drives it unchanged."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from fractions import Fraction
from pathlib import Path

import numpy as np

from tinydeploy import __version__
from tinydeploy.targets import boards
from tinydeploy.targets.boards import Board
from tinydeploy.codegen import kernels as kreg
from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError

MCU_TEMPLATES = kreg.TEMPLATES / "mcu"
COMMON = ["harness.c", "harness.h", "port.h", "startup_cortex_m.c"]
MODEL_SOURCES = ["model.c", "td_kernels.c", "td_weights.c"]
MODEL_HEADERS = ["model.h", "td_kernels.h", "td_runtime.h", "td_weights.h"]
MARKER = ".tinydeploy.json"


# ---- boards ---------------------------------------------------------------------------------

def mcu_board(board) -> Board:
    """The Board (of an id or a Board), checked to be a microcontroller with what firmware needs."""
    return boards.get_board(board).require_mcu()


# ---- model facts from the generated sources ---------------------------------------------------

def _define(model_h: str, name: str) -> int:
    m = re.search(rf"#define {name} (\d+)u?\b", model_h)
    if not m:
        raise TinydeployError(f"model.h has no {name}; regenerate it with this tinydeploy")
    return int(m.group(1))


def model_facts(files: dict[str, str]) -> dict:
    h = files["model.h"]
    n_in = _define(h, "TD_NUM_INPUTS")
    m = re.search(r"^ \* Model:\s+(.*)$", h, re.M)
    return {"model": m.group(1).strip() if m else "model",
            "weights_bytes": _define(h, "TD_WEIGHTS_BYTES"), "arena_bytes": _define(h, "TD_ARENA_BYTES"),
            "input_bytes": sum(_define(h, f"TD_INPUT{i}_BYTES") for i in range(n_in)),
            "inputs_int8": all(re.search(rf"#define TD_INPUT{i}_DTYPE TD_INT8\b", h) for i in range(n_in))}


@lru_cache(maxsize=1)
def _profiles() -> dict:
    """firmware_templates/mcu/profiles.json: the MLPerf Tiny profiles and what the harness does for each."""
    return json.loads((MCU_TEMPLATES / "profiles.json").read_text())


def model_id(model_name: str) -> str:
    """The MLPerf Tiny model id the EnergyRunner expects (kws01, ...), from the file name."""
    stem = re.split(r"[_.-]", model_name.lower())[0]
    return _profiles()["file_prefixes"].get(stem, re.sub(r"[^a-z0-9_]", "", stem)[:16] or "model")


def profile(model_name: str) -> dict:
    """What the harness does for the model's profile (profiles.json; {} for other models)."""
    return _profiles()["profiles"].get(model_id(model_name), {})


# ---- fitting --------------------------------------------------------------------------------

def _kb(n: int) -> str:
    return f"{n:,} B ({n / 1024:.1f} KiB)"


def _too_big(facts: dict, board: dict, what: str, need: int, have: int, detail: str) -> TinydeployError:
    hint = ("quantise the model to int8 (weights and activations 4x smaller) or pick a board with more "
            f"{what}" if facts["weights_bytes"] or facts["arena_bytes"] else f"pick a board with more {what}")
    return TinydeployError(f"{printable(facts['model'])} does not fit {board.id}: needs {_kb(need)} of {what}, "
                           f"the board has {_kb(have)} ({detail}); {hint}")


def check_fits(files: dict[str, str], board: dict) -> None:
    """Refuses a model whose weights alone exceed the board's flash, or whose arena, input buffer
    and stack exceed its RAM, before anything is compiled."""
    f = model_facts(files)
    stack = board.stack_bytes
    if f["weights_bytes"] > board.flash_bytes:
        raise _too_big(f, board, "flash", f["weights_bytes"], board.flash_bytes,
                       f"weights alone {_kb(f['weights_bytes'])}, before code")
    ram = f["arena_bytes"] + f["input_bytes"] + stack
    if ram > board.ram_bytes:
        raise _too_big(f, board, "RAM", ram, board.ram_bytes,
                       f"arena {f['arena_bytes']:,} B + input buffer {f['input_bytes']:,} B + stack {stack:,} B")


# ---- the project folder ---------------------------------------------------------------------

def _render(name: str, **kw) -> str:
    return kreg.env().get_template(f"mcu/{name}").render(version=__version__, **kw)


def project_files(files: dict[str, str], board_id: str, emulate: bool = False, dut_name: str | None = None,
                  bulk_timeout_ms: int | None = None) -> dict[str, str]:
    """Relative path -> text of the firmware project for `board_id` (emulate: for the QEMU machine
    that stands in for it, with the board's own memory limits)."""
    board = mcu_board(board_id)
    machine = board.emulator() if emulate else board
    target = machine.make_target()
    facts = model_facts(files)
    port = f"port_{machine.port}.c"
    if not (MCU_TEMPLATES / port).is_file():
        raise TinydeployError(f"boards/{machine.id}.json names port {machine.port!r} but {port} does not exist")
    title = f"firmware for {facts['model']} on {board.id}" + (f" (emulated by {machine.id})" if emulate else "")
    out = {f"src/{n}": files[n] for n in MODEL_SOURCES + MODEL_HEADERS}
    for n in COMMON + [port]:
        out[f"src/{n}"] = (MCU_TEMPLATES / n).read_text()
    if bulk_timeout_ms is None:   # QEMU's virtual time runs slower than real time while polling
        bulk_timeout_ms = int((machine.qemu or {}).get("bulk_timeout_ms", 2000))
    out["src/harness_config.h"] = _render("harness_config.h.j2", dut_name=dut_name or f"tinydeploy {board.id}",
                                          model_id=model_id(facts["model"]), bulk_timeout_ms=int(bulk_timeout_ms),
                                          db_subtract_128=int(bool(profile(facts["model"]).get("db_subtract_128"))
                                                              and facts["inputs_int8"]))
    # Emulating: the machine's memory map, the board's sizes (so the link fails as on the board).
    out["link.ld"] = _render("link.ld.j2", title=title, board_id=board.id,
                             flash_origin=machine.flash_origin, ram_origin=machine.ram_origin,
                             flash_bytes=min(board.flash_bytes, machine.flash_bytes),
                             ram_bytes=min(board.ram_bytes, machine.ram_bytes),
                             stack_bytes=board.stack_bytes)
    sources = [f"src/{n}" for n in ["harness.c", "startup_cortex_m.c", port] + MODEL_SOURCES]
    upload = None if emulate else board.upload
    qemu = machine.qemu if machine.is_qemu_machine else None
    out["Makefile"] = _render("Makefile.j2", title=title, cflags=" ".join(target.cflags), sources=sources,
                              qemu=qemu, upload=upload)
    extras = []
    if not emulate and (MCU_TEMPLATES / "port_arduino.cpp").is_file() and board.runner == "serial":
        out["arduino/port_arduino.cpp"] = (MCU_TEMPLATES / "port_arduino.cpp").read_text()
        extras.append("arduino/port_arduino.cpp")
    out["README.md"] = _render("README.md.j2", title=title, board=board, machine=machine, emulate=emulate,
                               facts=facts, port=port, qemu=qemu, upload=upload, extras=extras,
                               cflags=" ".join(target.cflags), model_id=model_id(facts["model"]))
    return out


def write_project(outdir, files: dict[str, str], board_id: str, emulate: bool = False, force: bool = False,
                  **kw) -> Path:
    from tinydeploy.build import prepare_outdir
    outdir = Path(outdir)
    marker = outdir / MARKER
    prepare_outdir(outdir, force)
    proj = project_files(files, board_id, emulate, **kw)
    for rel, text in proj.items():
        p = outdir / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if not p.is_file() or p.read_text() != text:     # keep make's timestamps when unchanged
            p.write_text(text)
    marker.write_text(json.dumps({"tool": "tinydeploy", "version": __version__, "kind": "firmware",
                                  "board": mcu_board(board_id).id, "emulate": emulate, "files": sorted(proj)}, indent=1) + "\n")
    return outdir


# ---- building and measuring -----------------------------------------------------------------

_OVERFLOW = re.compile(r"region [`']?(FLASH|RAM)'? overflowed by (\d+) bytes")


def make(outdir: Path, board: dict, jobs: int = 2) -> Path:
    """Runs the project's Makefile; returns build/firmware.elf."""
    target = board.make_target()
    cc = target.compiler()         # a clear error when arm-none-eabi-gcc is missing
    if shutil.which("make") is None:
        raise TinydeployError("make not found (Debian: apt-get install make)")
    prefix = cc[:-3] if cc.endswith("gcc") else "arm-none-eabi-"
    cmd = ["make", "-C", str(outdir), f"-j{jobs}", f"PREFIX={prefix}", "all"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except subprocess.TimeoutExpired:
        raise TinydeployError("building the firmware took more than an hour; giving up") from None
    if r.returncode != 0:
        log = outdir / "build.log"
        log.write_text(" ".join(cmd) + "\n" + r.stdout + r.stderr)
        over = {m.group(1): int(m.group(2)) for m in _OVERFLOW.finditer(r.stderr)}
        if over:
            raise TinydeployError("the firmware does not fit " + board.id + ": " + "; ".join(
                f"{region} needs {_kb(_limit(outdir, region) + n)}, has {_kb(_limit(outdir, region))} "
                f"(over by {n:,} B)" for region, n in over.items())
                + "; quantise the model to int8 (4x smaller) or pick a bigger board")
        first = next((ln for ln in r.stderr.splitlines() if "error" in ln.lower()), r.stderr.strip()[-200:])
        raise TinydeployError(f"building the firmware failed ({printable(first, 200)}); full log in {log}")
    return outdir / "build" / "firmware.elf"


def _limit(outdir: Path, region: str) -> int:
    m = re.search(rf"^\s*{region}\s*\([a-z]+\)\s*:\s*ORIGIN = \w+, LENGTH = (\d+)", (outdir / "link.ld").read_text(), re.M)
    return int(m.group(1)) if m else 0


def sections(elf: Path, board: dict) -> list[dict]:
    """Allocated sections of the ELF: name, size, vma, lma, load (has bytes in the image)."""
    objdump = board.make_target().tool("objdump")
    r = subprocess.run([objdump, "-h", "-w", str(elf)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise TinydeployError(f"cannot read {elf}: {printable(r.stderr.strip(), 200)}")
    out = []
    for ln in r.stdout.splitlines():
        m = re.match(r"\s*\d+\s+(\S+)\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)\s+[0-9a-f]+\s+\S+\s+(.*)$", ln)
        if m and "ALLOC" in m.group(5):
            out.append({"name": m.group(1), "size": int(m.group(2), 16), "vma": int(m.group(3), 16),
                        "lma": int(m.group(4), 16), "load": "LOAD" in m.group(5)})
    return out


def memory_report(elf: Path, files: dict[str, str], board: dict, machine: dict | None = None) -> dict:
    """Flash = everything loaded into the image (code, constants and weights, .data's initial
    values); RAM = .stack reserve + .data + .bss (which holds the arena and input buffer)."""
    machine = machine or board
    fo, ro = machine.flash_origin, machine.ram_origin
    flash = ram = 0
    secs = sections(elf, machine)
    for s in secs:
        if s["load"] and fo <= s["lma"] < fo + machine.flash_bytes:
            flash += s["size"]
        if ro <= s["vma"] < ro + machine.ram_bytes:
            ram += s["size"]
    facts = model_facts(files)
    stack = next((s["size"] for s in secs if s["name"] == ".stack"), 0)
    return {"board": board.id, "built_for": machine.id,
            "flash_used_bytes": flash, "flash_bytes": board.flash_bytes,
            "ram_used_bytes": ram, "ram_bytes": board.ram_bytes,
            "stack_reserved_bytes": stack, "arena_bytes": facts["arena_bytes"],
            "weights_bytes": facts["weights_bytes"], "input_buffer_bytes": facts["input_bytes"],
            "fits": flash <= board.flash_bytes and ram <= board.ram_bytes,
            "sections": {s["name"]: s["size"] for s in secs}}


@dataclass
class Firmware:
    outdir: Path
    elf: Path
    board: dict          # the board the firmware is for (limits)
    machine: dict        # the board it was built to run on (itself, or its QEMU stand-in)
    memory: dict


def build_firmware(files: dict[str, str], board_id: str, outdir=None, emulate: bool = False,
                   force: bool = False, builder: str = "make", **kw) -> Firmware:
    """Writes the project (Makefile and platformio.ini), refuses a model that cannot fit, builds
    it with `builder` ("make" or "pio": PlatformIO, offline) and measures it."""
    board = mcu_board(board_id)
    machine = board.emulator() if emulate else board
    check_fits(files, board)
    outdir = Path(outdir) if outdir else Path(tempfile.mkdtemp(prefix=f"tinydeploy-fw-{board_id}-"))
    write_project(outdir, files, board_id, emulate, force=force, **kw)
    from tinydeploy.firmware import pio
    pio.write_platformio_ini(outdir, machine.id, ldscript="link.ld", model=model_facts(files)["model"])
    if builder == "pio":
        elf = pio.pio_build(outdir, machine.id, quiet=True)
    elif builder == "make":
        elf = make(outdir, machine)
    else:
        raise TinydeployError(f"unknown builder {builder!r}: use pio or make")
    mem = memory_report(elf, files, board, machine)
    if not mem["fits"]:
        raise TinydeployError(
            f"{printable(model_facts(files)['model'])} does not fit {board.id}: flash {mem['flash_used_bytes']:,} "
            f"of {mem['flash_bytes']:,} B, RAM {mem['ram_used_bytes']:,} of {mem['ram_bytes']:,} B; "
            "quantise the model to int8 (4x smaller) or pick a bigger board")
    (outdir / "memory.json").write_text(json.dumps(mem, indent=1) + "\n")
    return Firmware(outdir, elf, board, machine, mem)


# ---- running under QEMU ---------------------------------------------------------------------

def instructions_per_tick(machine: dict, tick_hz: int) -> Fraction:
    """Under -icount shift=N one instruction takes 2^N ns of virtual time."""
    shift = int(machine.qemu.get("icount_shift", 0))
    return Fraction(10 ** 9, tick_hz * 2 ** shift)


def infer_on_device(dev, memory: dict, inputs: list[np.ndarray], out_specs, runs: int = 1, warmup: int = 0,
                    timeout: float = 600.0) -> tuple[list[np.ndarray], object, int]:
    """Loads inputs into a device that speaks the protocol (QEMU or a real board), infers, and
    reads the raw outputs back; returns (outputs, protocol.Counts, stack high-water mark)."""
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in inputs)
    if len(data) != memory["input_buffer_bytes"]:
        raise TinydeployError(f"the inputs hold {len(data):,} bytes but the model takes {memory['input_buffer_bytes']:,}")
    dev.load(data)
    dev.infer(runs, warmup, timeout=timeout)
    raw = dev.outputs()
    counts = dev.last_counts
    stack_used, _ = dev.stack()
    outs, pos = [], 0
    for shape, dt in out_specs:
        dt = np.dtype(dt)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if pos + n > len(raw):
            raise TinydeployError(f"the firmware returned {len(raw)} output bytes; expected at least {pos + n}")
        outs.append(np.frombuffer(raw[pos:pos + n], dtype=dt).reshape(shape).copy())
        pos += n
    return outs, counts, stack_used


def run_firmware(fw: Firmware, inputs: list[np.ndarray], out_specs, runs: int = 1, warmup: int = 0,
                 timeout: float = 600.0) -> tuple[list[np.ndarray], int, dict]:
    """Runs a built firmware under QEMU on `inputs`; returns (outputs, instructions per inference,
    details)."""
    from tinydeploy.runners.qemu_system import Emulator
    with Emulator(fw.elf, fw.machine) as emu:
        dev = emu.device(timeout=timeout)
        try:
            dev.wait_boot(timeout=60)
            outs, counts, stack_used = infer_on_device(dev, fw.memory, inputs, out_specs, runs, warmup, timeout)
            dev.quit()
        except TinydeployError as e:
            qemu = emu.output().strip()
            ended = emu.wait(0.5)
            why = {3: " (the firmware crashed: hard fault)", 4: " (unexpected interrupt)"}.get(ended, "")
            raise TinydeployError(f"{e}" + (f"; QEMU exited with code {ended}{why}" if ended is not None else "")
                                  + (f"; QEMU said: {printable(qemu, 200)}" if qemu else "")) from None
        code = emu.wait(10)
        if code not in (0, None):
            raise TinydeployError(f"the firmware ended with exit code {code}")
    if counts.count_unit == "instructions":
        if counts.count_min != counts.count_max:
            raise TinydeployError(f"instruction counts differ between runs ({counts.count_min} to {counts.count_max}); "
                                  "is QEMU running with -icount shift=0?")
        instructions = counts.count_min
    else:
        instructions = int(round(counts.ticks_total / counts.runs * instructions_per_tick(fw.machine, counts.tick_hz)))
    details = {"ticks_per_inference": counts.ticks_per_run, "tick_hz": counts.tick_hz, "runs": counts.runs,
               "stack_used_bytes": stack_used, "log": dev.log}
    return outs, instructions, details


def run_on_emulator(compiled_files: dict[str, str], board_id: str, inputs: list[np.ndarray], out_specs,
                    outdir=None, runs: int = 1, warmup: int = 0) -> tuple[list[np.ndarray], int, dict]:
    """Builds firmware for `board_id` (a QEMU machine, or a board with emulate_with), runs one
    set of inputs under QEMU and returns (outputs, instructions per inference, memory report).
    The instruction count is exact and repeatable (QEMU -icount shift=0). The memory report is
    against `board_id`'s own flash and RAM, with the measured stack high-water mark and, for a
    real board, the latency its clock would give at one instruction per cycle (a lower bound)."""
    board = mcu_board(board_id)
    emulate = not board.is_qemu_machine
    with tempfile.TemporaryDirectory(prefix="tinydeploy-fw-") as tmp:
        fw = build_firmware(compiled_files, board_id, outdir or tmp, emulate=emulate, force=outdir is None)
        outs, instructions, details = run_firmware(fw, inputs, out_specs, runs=runs, warmup=warmup)
    mem = dict(fw.memory)
    mem["stack_used_bytes"] = details["stack_used_bytes"]
    if emulate and board.clock_hz:
        mem["min_latency_ms_at_clock"] = instructions / board.clock_hz * 1000.0
    return outs, instructions, mem
