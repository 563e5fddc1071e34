"""Microcontroller firmware: a self-contained project folder around the generated model, built
with arm-none-eabi-gcc through its own Makefile, a memory report from the ELF; run_on_emulator builds
and runs it under QEMU (tinydeploy.runners.mcu runs built firmware).

    c = compile_model(onnx, get_board("mps2-an386").make_target(), board="mps2-an386")
    fw = build_firmware(c, "mps2-an386", "out/")      # out/Makefile, out/src/..., out/build/firmware.elf
    outputs, instructions, memory = run_on_emulator(c, "nano33ble", [x], out_specs)

The project folder builds without tinydeploy (`make`); the firmware speaks the MLPerf Tiny
EnergyRunner protocol (firmware_templates/mcu/harness.c), so the open runner drives it unchanged."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinydeploy import __version__
from tinydeploy import build as bld
from tinydeploy.pipeline import Compiled, Image
from tinydeploy.targets import boards
from tinydeploy.targets.boards import Board
from tinydeploy.codegen import kernels as kreg
from tinydeploy.codegen.cfmt import c_float, printable
from tinydeploy.firmware import profiles
from tinydeploy.firmware.profiles import model_id  # noqa: F401  (the runner's model id, for the rig)
from tinydeploy.errors import TinydeployError

MCU_TEMPLATES = kreg.TEMPLATES / "mcu"
COMMON = ["harness.c", "harness.h", "port.h", "startup_cortex_m.c"]


# ---- boards ---------------------------------------------------------------------------------

def mcu_board(board) -> Board:
    """The Board (of an id or a Board), checked to be a microcontroller with what firmware needs."""
    return boards.get_board(board).require_mcu()


# ---- the model's facts, from the compiler's contract ------------------------------------------

def model_facts(c: Compiled | Image) -> dict:
    """What the firmware needs to know of a compiled model (pipeline.Compiled), or of several in
    one image (pipeline.Image): arena_bytes holds every activation arena, scratch arenas apart."""
    scratch = c.scratch_bytes if isinstance(c, Image) else c.plan.scratch_bytes
    return {"model": c.model, "weights_bytes": c.weights_bytes, "arena_bytes": c.arena_bytes,
            "input_bytes": c.input_bytes, "inputs_int8": c.inputs_int8, "scratch_bytes": scratch}


# ---- fitting --------------------------------------------------------------------------------

def _kb(n: int) -> str:
    return f"{n:,} B ({n / 1024:.1f} KiB)"


def _too_big(facts: dict, board: dict, what: str, need: int, have: int, detail: str) -> TinydeployError:
    hint = ("quantise the model to int8 (weights and activations 4x smaller) or pick a board with more "
            f"{what}" if facts["weights_bytes"] or facts["arena_bytes"] else f"pick a board with more {what}")
    return TinydeployError(f"{printable(facts['model'])} does not fit {board.id}: needs {_kb(need)} of {what}, "
                           f"the board has {_kb(have)} ({detail}); {hint}")


def check_fits(c: Compiled, board) -> None:
    """Refuses a model whose weights alone exceed the board's flash, or whose arena, input buffer
    and stack exceed its RAM, before anything is compiled."""
    f = model_facts(c)
    stack = board.stack_bytes
    if f["weights_bytes"] > board.flash_bytes:
        raise _too_big(f, board, "flash", f["weights_bytes"], board.flash_bytes,
                       f"weights alone {_kb(f['weights_bytes'])}, before code")
    ram = f["arena_bytes"] + f["scratch_bytes"] + f["input_bytes"] + stack
    if ram > board.ram_bytes:
        scratch = f" + scratch arena {f['scratch_bytes']:,} B" if f["scratch_bytes"] else ""
        raise _too_big(f, board, "RAM", ram, board.ram_bytes,
                       f"arena {f['arena_bytes']:,} B{scratch} + input buffer {f['input_bytes']:,} B + stack {stack:,} B")


# ---- the project folder ---------------------------------------------------------------------

def _render(name: str, **kw) -> str:
    return kreg.env().get_template(f"mcu/{name}").render(version=__version__, **kw)


def sections_placed(c: Compiled | Image, machine: Board) -> list[dict]:
    """The sections of its own a build asks for (--arena-section, --scratch-section,
    --weights-section) and the memory region each goes into (Board.region_for): dicts name,
    what, load (has contents in the image), region."""
    models = c.models if isinstance(c, Image) else [c]
    out, seen = [], set()
    for m in models:
        api = m.api
        if api is None:
            continue
        for name, what, load in ((api.arena_section, "arena", False), (api.scratch_section, "scratch", False),
                                 (api.weights_section, "weights", True)):
            if name and (name, load) not in seen:
                seen.add((name, load))
                if name in {s["name"] for s in out}:
                    raise TinydeployError(f"section {printable(name)} is asked for both the weights and an arena; "
                                          "the weights are loaded with the image and the arenas are not: give them "
                                          "sections of their own")
                out.append({"name": name, "what": what, "load": load,
                            "region": machine.region_for(name, "flash" if load else "ram")})
    return out


def project_files(c: Compiled | Image, board_id, emulate: bool = False, dut_name: str | None = None,
                  bulk_timeout_ms: int | None = None, extra_cflags=None) -> dict[str, str]:
    """Relative path -> text of the firmware project for `board_id` (emulate: for the QEMU machine
    that stands in for it, with the board's own memory limits). `extra_cflags` go after the
    target's flags (the capture build of `tinydeploy validate`: -DTD_CAPTURE -DTD_PROFILE)."""
    board = mcu_board(board_id)
    machine = board.emulator() if emulate else board
    target = machine.make_target()
    facts = model_facts(c)
    port = f"port_{machine.port}.c"
    if not (MCU_TEMPLATES / port).is_file():
        raise TinydeployError(f"boards/{machine.id}.json names port {machine.port!r} but {port} does not exist")
    title = f"firmware for {facts['model']} on {board.id}" + (f" (emulated by {machine.id})" if emulate else "")
    files = c.files
    out = {f"src/{n}": files[n] for n in c.sources + c.headers}
    for n in COMMON + [port]:
        out[f"src/{n}"] = (MCU_TEMPLATES / n).read_text()
    if bulk_timeout_ms is None:   # QEMU's virtual time runs slower than real time while polling
        bulk_timeout_ms = int((machine.qemu or {}).get("bulk_timeout_ms", 2000))
    h = profiles.image_settings(c, board, machine)
    out["src/harness_config.h"] = _render("harness_config.h.j2", dut_name=dut_name or f"tinydeploy {board.id}",
                                          model_id=h["model_id"], bulk_timeout_ms=int(bulk_timeout_ms), h=h,
                                          c_float=c_float)
    # Sections of the build's own go into the regions the board lists (emulating: only those the
    # board itself has, so the image is laid out as on the board).
    regions = machine if not emulate else dataclasses.replace(machine, memory_regions=tuple(
        r for r in machine.memory_regions if r["name"] in {b["name"] for b in board.memory_regions}))
    placed = sections_placed(c, regions)
    extra = [r for r in {s["region"]["name"]: s["region"] for s in placed}.values() if r["name"] not in ("FLASH", "RAM")]
    # Emulating: the machine's memory map, the board's sizes (so the link fails as on the board).
    out["link.ld"] = _render("link.ld.j2", title=title, board_id=board.id,
                             flash_origin=machine.flash_origin, ram_origin=machine.ram_origin,
                             flash_bytes=min(board.flash_bytes, machine.flash_bytes),
                             ram_bytes=min(board.ram_bytes, machine.ram_bytes),
                             stack_bytes=board.stack_bytes, regions=extra, placed=placed)
    sources = [f"src/{n}" for n in ["harness.c", "startup_cortex_m.c", port] + c.sources]
    upload = None if emulate else board.upload
    qemu = machine.qemu if machine.is_qemu_machine else None
    out["Makefile"] = _render("Makefile.j2", title=title, cflags=" ".join(target.cflags + list(extra_cflags or [])),
                              sources=sources,
                              qemu=qemu, upload=upload)
    extras = []
    if not emulate and (board.platformio or {}).get("framework") == "arduino":   # the Arduino env's port
        out["arduino/port_arduino.cpp"] = (MCU_TEMPLATES / "port_arduino.cpp").read_text()
        extras.append("arduino/port_arduino.cpp")
    out["README.md"] = _render("README.md.j2", title=title, board=board, machine=machine, emulate=emulate,
                               facts=facts, port=port, qemu=qemu, upload=upload, extras=extras,
                               capture="-DTD_CAPTURE" in (extra_cflags or []),
                               cflags=" ".join(target.cflags + list(extra_cflags or [])), model_id=h["model_id"],
                               h=h, library=_library_facts(c), placed=placed)
    return out


def _library_facts(c: Compiled | Image) -> dict | None:
    """What README.md says of library-form models (None: the classic one)."""
    models = c.models if isinstance(c, Image) else [c]
    if models[0].api is None:
        return None
    return {"models": [{"name": m.api.name, "file": printable(m.model, 80), "files": m.sources + m.headers, "arena": m.api.arena,
                        "arena_bytes": m.arena_bytes} for m in models],
            "share": isinstance(c, Image) and c.share_arena, "select": len(models) > 1}


def write_project(outdir, c: Compiled | Image, board_id, emulate: bool = False, force: bool = False,
                  extra: dict[str, str] | None = None, **kw) -> Path:
    """The firmware project folder (build.py writes it: no file the user changed is overwritten,
    no symlink followed, unchanged files keep their timestamps for make); `extra`: more files
    for it (relative path -> text), e.g. the model's packages."""
    outdir = Path(outdir)
    previous = bld.claim_outdir(outdir, force)
    board = mcu_board(board_id)
    hashes = bld.write_files(outdir, project_files(c, board, emulate, **kw) | (extra or {}), previous, force)
    bld.write_marker(outdir, "firmware", hashes, board=board.id, emulate=emulate)
    return outdir


# ---- building and measuring -----------------------------------------------------------------

_OVERFLOW = re.compile(r"region [`']?([A-Z][A-Z0-9_]*)'? overflowed by (\d+) bytes")


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


def memory_report(elf: Path, c: Compiled | Image, board, machine=None) -> dict:
    """Flash = everything loaded into the image (code, constants and weights, .data's initial
    values); RAM = .stack reserve + .data + .bss (which holds the arena and input buffer), in the
    board's main FLASH and RAM; `regions`: what sections of the build's own (--arena-section, ...)
    use of the board's other memories; `models`: per library-form model, its own symbols."""
    machine = machine or board
    fo, ro = machine.flash_origin, machine.ram_origin
    flash = ram = 0
    secs = sections(elf, machine)
    regions = {r["name"]: dict(r, used_bytes=0) for r in machine.memory_regions}
    for s in secs:
        if s["load"] and fo <= s["lma"] < fo + machine.flash_bytes:
            flash += s["size"]
        if ro <= s["vma"] < ro + machine.ram_bytes:
            ram += s["size"]
        for r in regions.values():
            if r["origin"] <= s["vma"] < r["origin"] + r["bytes"]:
                r["used_bytes"] += s["size"]
    facts = model_facts(c)
    stack = next((s["size"] for s in secs if s["name"] == ".stack"), 0)
    used = {k: {"used_bytes": r["used_bytes"], "bytes": r["bytes"], "kind": r["kind"]}
            for k, r in regions.items() if r["used_bytes"]}
    out = {"board": board.id, "built_for": machine.id,
           "flash_used_bytes": flash, "flash_bytes": board.flash_bytes,
           "ram_used_bytes": ram, "ram_bytes": board.ram_bytes,
           "stack_reserved_bytes": stack, "arena_bytes": facts["arena_bytes"],
           "weights_bytes": facts["weights_bytes"], "input_buffer_bytes": facts["input_bytes"],
           "fits": flash <= board.flash_bytes and ram <= board.ram_bytes
           and all(r["used_bytes"] <= r["bytes"] for r in used.values()),
           "sections": {s["name"]: s["size"] for s in secs}}
    if used:
        out["regions"] = used
    models = c.models if isinstance(c, Image) else [c]
    if models[0].api is not None:
        per = model_memory(elf, [m.api.name for m in models], machine)
        every = {kind: main + sum(r["used_bytes"] for r in used.values() if r["kind"] == kind)
                 for kind, main in (("flash", flash), ("ram", ram))}     # the board's other memories too
        per["shared"] = {f"{k}_bytes": every[k] - sum(v[f"{k}_bytes"] for v in per.values()) for k in every}
        out["models"] = per
    return out


def model_memory(elf: Path, names: list[str], machine) -> dict:
    """Flash and RAM per model of an image, from its symbols (nm): each model's code, weights,
    arenas and contexts are named <name>_... Flash: its symbols in flash memories (and .data's
    initial values); RAM: those in RAM memories, the main one and the board's other regions
    (weights placed in a RAM region count there).
    What belongs to no model (harness, port, C library, stack, the model table and a shared arena)
    memory_report counts as "shared": the image's totals minus the models'."""
    nm = machine.make_target().tool("nm")
    r = subprocess.run([nm, "-S", "--defined-only", str(elf)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise TinydeployError(f"cannot read the symbols of {elf}: {printable(r.stderr.strip(), 200)}")
    rams = [(machine.ram_origin, machine.ram_bytes)] + [(x["origin"], x["bytes"]) for x in machine.memory_regions
                                                        if x["kind"] == "ram"]
    out = {n: {"flash_bytes": 0, "ram_bytes": 0} for n in names}
    for ln in r.stdout.splitlines():
        parts = ln.split()
        if len(parts) != 4:
            continue
        addr, size, kind, sym = int(parts[0], 16), int(parts[1], 16), parts[2], parts[3]
        owner = next((n for n in names if sym.startswith(n + "_")), None)
        if owner is None:
            continue
        in_ram = any(o <= addr < o + b for o, b in rams)
        out[owner]["ram_bytes" if in_ram else "flash_bytes"] += size
        if in_ram and kind in "dD":       # initialised data: its values are in flash too
            out[owner]["flash_bytes"] += size
    return out


@dataclass
class Firmware:
    outdir: Path
    elf: Path
    board: dict          # the board the firmware is for (limits)
    machine: dict        # the board it was built to run on (itself, or its QEMU stand-in)
    memory: dict
    harness: dict | None = None   # profiles.image_settings: what the harness prints, its baud, ...


def build_firmware(c: Compiled | Image, board_id, outdir=None, emulate: bool = False,
                   force: bool = False, builder: str = "make", extra_cflags=None, **kw) -> Firmware:
    """Writes the project (Makefile and platformio.ini), refuses a model that cannot fit, builds
    it with `builder` ("make" or "pio": PlatformIO, offline) and measures it."""
    board = mcu_board(board_id)
    machine = board.emulator() if emulate else board
    check_fits(c, board)
    outdir = Path(outdir) if outdir else Path(tempfile.mkdtemp(prefix=f"tinydeploy-fw-{board.id}-"))
    write_project(outdir, c, board, emulate, force=force, extra_cflags=extra_cflags, **kw)
    from tinydeploy.firmware import pio
    pio.write_platformio_ini(outdir, machine.id, ldscript="link.ld", build_flags=extra_cflags, model=c.model)
    if builder == "pio":
        elf = pio.pio_build(outdir, machine.id, quiet=True)
    elif builder == "make":
        elf = make(outdir, machine)
    else:
        raise TinydeployError(f"unknown builder {builder!r}: use pio or make")
    mem = memory_report(elf, c, board, machine)
    if not mem["fits"]:
        raise TinydeployError(
            f"{printable(c.model)} does not fit {board.id}: flash {mem['flash_used_bytes']:,} "
            f"of {mem['flash_bytes']:,} B, RAM {mem['ram_used_bytes']:,} of {mem['ram_bytes']:,} B; "
            "quantise the model to int8 (4x smaller) or pick a bigger board")
    (outdir / "memory.json").write_text(json.dumps(mem, indent=1) + "\n")
    return Firmware(outdir, elf, board, machine, mem, profiles.image_settings(c, board, machine))


# ---- building and running under QEMU -----------------------------------------------------

def run_on_emulator(c: Compiled, board_id, inputs: list[np.ndarray], out_specs,
                    outdir=None, runs: int = 1, warmup: int = 0) -> tuple[list[np.ndarray], int, dict]:
    """Builds firmware for `board_id` (a QEMU machine, or a board with emulate_with), runs one
    set of inputs under QEMU and returns (outputs, instructions per inference, memory report).
    The instruction count is exact and repeatable (QEMU -icount shift=0). The memory report is
    against `board_id`'s own flash and RAM, with the measured stack high-water mark and, for a
    real board, the latency its clock would give at one instruction per cycle (a lower bound)."""
    from tinydeploy.runners.mcu import run_under_qemu
    board = mcu_board(board_id)
    emulate = not board.is_qemu_machine
    with tempfile.TemporaryDirectory(prefix="tinydeploy-fw-") as tmp:
        fw = build_firmware(c, board_id, outdir or tmp, emulate=emulate, force=outdir is None)
        outs, instructions, details = run_under_qemu(fw, inputs, out_specs, runs=runs, warmup=warmup)
    mem = dict(fw.memory)
    mem["stack_used_bytes"] = details["stack_used_bytes"]
    if emulate and board.clock_hz:
        mem["min_latency_ms_at_clock"] = instructions / board.clock_hz * 1000.0
    return outs, instructions, mem
