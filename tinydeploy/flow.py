"""What the commands do, as functions (the CLI only parses and prints): build a model for a
board, run it against onnxruntime, benchmark it."""
from __future__ import annotations

import contextlib
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinydeploy import build as bld, reference, runners
from tinydeploy.targets import boards
from tinydeploy import schedule
from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.inputfiles import regular_size
from tinydeploy.pipeline import Compiled, compile_model
from tinydeploy.runners.harness import time_runs

FP32_RTOL = 1e-4
RELEASE_C_BYTES = 64 << 20   # generated C larger than this is dropped from memory once written
MAX_THREADS = 256


def check_threads(board: dict, threads) -> int:
    """`--threads N`: OpenMP threads per layer on Linux boards (1: the serial code)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise TinydeployError(f"--threads must be a whole number from 1 to {MAX_THREADS}, "
                              f"not {printable(str(threads), 20)!r}")
    if threads > 1 and board.is_mcu:
        raise TinydeployError(f"--threads is for Linux boards (host, rpi4, jetson-*); {board.id} is a "
                              "single-core microcontroller: leave --threads out")
    return threads


MAX_RUNS = 100_000
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def check_runs(runs) -> int | None:
    """`--runs N`: timed inferences, 1 to MAX_RUNS (None: the command's default)."""
    if runs is None:
        return None
    if isinstance(runs, bool) or not isinstance(runs, int) or not 1 <= runs <= MAX_RUNS:
        raise TinydeployError(f"--runs must be a whole number from 1 to {MAX_RUNS}, not {printable(str(runs), 20)!r}")
    return runs


def check_timeout(timeout) -> float:
    """`--timeout S`: seconds every wait on a board may last, a positive finite number."""
    try:
        t = float(timeout)
    except (TypeError, ValueError):
        t = float("nan")
    if isinstance(timeout, bool) or not (math.isfinite(t) and 0 < t <= MAX_TIMEOUT_S):
        shown = f"{t:g}" if isinstance(timeout, float) else str(timeout)
        raise TinydeployError(f"--timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g} "
                              f"(a week), not {printable(shown, 20)!r}")
    return t


def progress(msg: str) -> None:
    print(f"[tinydeploy] {msg}", file=sys.stderr, flush=True)


def default_outdir(model: Path, board: str) -> Path:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", model.stem).lstrip(".-") or "model"  # no hidden or option-like names
    return Path("build") / f"{stem[:64]}-{board}"


@dataclass
class BuildResult:
    outdir: Path
    exe: Path | None              # host/Linux harness binary, or the firmware ELF of an MCU
    compiled: Compiled | None     # None when an up-to-date build was reused; host and Linux boards:
                                  # files is empty, the C is in outdir
    reused: bool
    summary: dict
    firmware: object = None       # firmware.Firmware for microcontroller boards


def _summary(model: Path, board_id: str, outdir: Path, c: Compiled, files) -> dict:
    return {
        "model": model.name, "board": board_id, "layers": sum(1 for k in c.kernels if k),
        "macs": c.macs, "weights_bytes": c.weights_bytes, "arena_bytes": c.plan.arena_bytes,
        "lower_bound_bytes": c.plan.lower_bound, "outdir": str(outdir), "notes": c.notes,
        "files": sorted(files),
        "inputs": [[n, list(c.graph.t(n).shape), np.dtype(c.graph.t(n).dtype).name] for n in c.graph.inputs],
        "outputs": [[n, list(c.graph.t(n).shape), np.dtype(c.graph.t(n).dtype).name] for n in c.graph.outputs],
        "output_lsb": [_dequantized_scale(c.graph, n) for n in c.graph.outputs],
        "layer_table": layer_table(c),
        "schedule": c.schedule(),
        "sha256": c.sha256,
    }


def weights_layout(c: Compiled, optimize: str) -> str:
    """One line for `build` on microcontrollers: how the 8-bit weights are laid out under
    --optimize and the flash that costs beyond one byte per weight ("" without such layers)."""
    f = schedule.flash_choices(c.kernels)
    if not f["layers"]:
        return ""
    n8 = f["layers"].get("i8pair", 0) + f["layers"].get("i8", 0)
    n16 = f["layers"].get("i16", 0)
    return (f"--optimize {optimize}: 8-bit weights at one byte each on {n8} layer{'s' * (n8 != 1)}, int16 pairs on "
            f"{n16} (flash +{f['extra_bytes']:,} B for them)")


def layer_table(c: Compiled) -> list[list]:
    """[step, ONNX op, node name, algorithm, MACs] of each layer with code (`bench --layers`);
    the algorithm is the "[...]" prefix of the kernel's description, else its family."""
    from tinydeploy.ops import REGISTRY
    rows = []
    for step, (n, k) in enumerate(zip(c.graph.nodes, c.kernels)):
        if k is not None:
            m = re.match(r"\[([^\]]*)\]", k.desc)
            rows.append([step, printable(n.onnx_op, 40), printable(n.name, 60),
                         printable(m.group(1) if m else k.family, 80), int(REGISTRY[n.op].macs(n, c.graph))])
    return rows


def _firmware(c: Compiled, board, outdir: Path, emulate: bool, builder: str, force: bool, extra_cflags=None):
    """Microcontroller boards: the model's C plus the firmware harness and the board's port, as a
    project with a Makefile and a platformio.ini, built offline; refused with numbers if too big."""
    from tinydeploy import firmware
    fw = firmware.build_firmware(c, board, outdir, emulate=emulate, force=force, builder=builder,
                                 extra_cflags=extra_cflags)
    return fw.elf, fw


def _host_binary(c: Compiled, board, target, outdir: Path, command: str, threads: int, extra_cflags, cc,
                 force: bool, previous: dict, log) -> tuple[Path, dict]:
    """Linux boards: the model's C, the harness, a Makefile and a CMakeLists.txt, compiled here."""
    from tinydeploy.codegen.project import ModelInfo, header
    files = dict(c.files)
    info = ModelInfo(c.model, c.sha256, command, board.id)
    files.update(bld.host_files(f"Makefile -- generated by tinydeploy for {c.model}",
                                header(info, "main.c: host harness"), target, threads))
    hashes = bld.write_files(outdir, files, previous, force)
    size = sum(len(t) for t in files.values())
    log(f"wrote {len(files)} files ({size / 1e6:.1f} MB of C) to {outdir}; compiling")
    # Very large models: the C is on disk, so let go of its text before the compiler runs. A 400 MB
    # weight is 0.5 to 1.7 GB of C, and the compiler needs ~3.3 bytes per character of it for itself
    # (tinydeploy/limits.py); c.files is then empty, the folder holds it.
    if size > RELEASE_C_BYTES:
        del files
        c.files.clear()
    return bld.compile_host(outdir, target, extra_cflags, cc), hashes


def build(model, board="host", outdir=None, force: bool = False, input_shapes=None,
          command: str = "", reuse: bool = False, quiet: bool = False, extra_cflags=None, cc=None,
          emulate: bool = False, builder: str | None = None, threads: int = 1,
          max_weights_bytes=None, optimize: str = "balanced") -> BuildResult:
    """Compile `model` for `board` and build it in `outdir`: a harness binary for Linux boards,
    firmware for microcontrollers (`emulate`: for the QEMU machine that stands in for the board,
    with the board's limits). With `reuse`, an up-to-date build in `outdir` (the same model,
    board, options and tinydeploy: bld.build_key) is taken as it is. `max_weights_bytes`: the
    weights budget (bytes; None: TINYDEPLOY_MAX_WEIGHTS_BYTES, else sized against this machine's
    memory; see tinydeploy.limits). `optimize` (balanced, speed, size): what microcontroller
    kernels may spend flash on for speed (schedule/mcu.py)."""
    from tinydeploy.frontend.importer import sha256_file
    model = Path(model)
    board = boards.get_board(board)
    check_threads(board, threads)
    schedule.check_optimize(optimize)
    target = bld.with_threads(board.make_target(), threads)
    emulate = emulate and board.is_mcu and not board.is_qemu_machine
    builder = builder or ("make" if emulate or board.is_qemu_machine else "pio")
    outdir = Path(outdir) if outdir else default_outdir(model, board.id + ("-emulated" if emulate else ""))
    log = (lambda m: None) if quiet else progress
    regular_size(model, "model file")
    key = bld.build_key(sha256_file(model), board.id,
                        {"shapes": sorted((k, list(v)) for k, v in (input_shapes or {}).items()),
                         "cflags": extra_cflags or [], "cc": cc or "", "threads": threads, "emulate": emulate,
                         "builder": builder if board.is_mcu else "", "selection": schedule.selection_state(target),
                         "optimize": optimize if board.is_mcu else ""})
    previous = bld.claim_outdir(outdir, force)
    rel = Path(str(previous.get("artifact", "model_run")))
    artifact = outdir / rel
    if (reuse and previous.get("key") == key and not rel.is_absolute() and ".." not in rel.parts
            and artifact.is_file() and "summary" in previous and (not board.is_mcu or (outdir / "memory.json").is_file())):
        log(f"reusing up-to-date build in {outdir}")
        fw = None
        if board.is_mcu:
            import json
            from tinydeploy import firmware
            fw = firmware.Firmware(outdir, artifact, board, board.emulator() if emulate else board,
                                   json.loads((outdir / "memory.json").read_text()), previous["summary"].get("harness"))
        return BuildResult(outdir, artifact, None, True, previous["summary"], fw)
    log(f"compiling {printable(model.name)} for {board.id}{' (emulated)' if emulate else ''}")
    c = compile_model(model, target, input_shapes, command=command, board=board.id, threads=threads,
                      max_weights_bytes=max_weights_bytes, optimize=optimize)
    fast = schedule.describe(c.kernels, fast_only=True)
    for line in fast:
        log(printable(line, 160))
    layout = weights_layout(c, optimize) if board.is_mcu else ""
    if layout:
        log(layout)
    if not board.is_mcu:
        log(f"{len(fast)} layers with fast algorithms, "
            f"{sum(1 for k in c.kernels if k is not None and k.params.get('algo') == 'ref')} conv/dense layers "
            "kept the reference")
    fw = None
    if board.is_mcu:
        log(f"building firmware with {builder} in {outdir}")
        artifact, fw = _firmware(c, board, outdir, emulate, builder, force, extra_cflags)
        hashes = bld.read_marker(outdir).get("files", {})
    else:
        artifact, hashes = _host_binary(c, board, target, outdir, command, threads, extra_cflags, cc, force,
                                        previous, log)
    summary = _summary(model, board.id, outdir, c, sorted(hashes))
    summary["weights_layout"] = layout
    if fw is not None:
        summary["firmware"] = {k: v for k, v in fw.memory.items() if k != "sections"}
        summary["harness"] = fw.harness          # what a reused build's Firmware needs back
        summary["elf"] = str(fw.elf)
    # The key goes in last, so an interrupted build is never taken for an up-to-date one.
    bld.write_marker(outdir, "firmware" if board.is_mcu else "host", hashes, key=key,
                     artifact=_inside(artifact, outdir), summary=summary)
    return BuildResult(outdir, artifact, c, False, summary, fw)


@dataclass
class Library:
    """The library form of `build` (`--name` and the options beside it; codegen/project.py Api):
    names one per model (None: from the file names), the arena ("static" or "caller"), the
    sections, the state pairs ([(in, out)] or "auto"), one arena shared by several models, and
    the model's packages for other build systems (tinydeploy/packages.py)."""
    names: list[str] | None = None
    arena: str = "static"
    arena_section: str | None = None
    weights_section: str | None = None
    scratch_section: str | None = None
    states: list | str | None = None
    share_arena: bool = False
    package: bool = False


def library_apis(models: list[Path], lib: Library):
    """One project.Api per model, checked: names (given, or from the file names) that are C
    prefixes and cannot clash, sections the linker can place, options that go together."""
    from tinydeploy.codegen.cfmt import c_prefix, c_prefix_problem, c_section_problem
    from tinydeploy.codegen.project import Api
    if lib.names and len(lib.names) != len(models):
        raise TinydeployError(f"--name was given {len(lib.names)} times for {len(models)} models: give one name per "
                              "model, in the order of the models, or none (names then come from the file names)")
    names = list(lib.names) if lib.names else [c_prefix(m.stem) for m in models]
    for n in lib.names or []:
        why = c_prefix_problem(n)
        if why:
            raise TinydeployError(f"--name {printable(n, 40)!r}: {why}")
    for a in names:
        for b in names:
            if a is not b and (a.lower() == b.lower() or b.lower().startswith(a.lower() + "_")):
                raise TinydeployError(f"model names {a!r} and {b!r} would clash in C ({b}_... names start like "
                                      f"{a}_..., and macros are upper case): give other names with --name")
    for opt, sec in (("--arena-section", lib.arena_section), ("--weights-section", lib.weights_section),
                     ("--scratch-section", lib.scratch_section)):
        why = sec is not None and c_section_problem(sec)
        if why:
            raise TinydeployError(f"{opt} {printable(sec, 40)!r}: {why}")
    if lib.arena not in ("static", "caller"):
        raise TinydeployError(f"--arena {printable(str(lib.arena), 20)!r}: use static or caller")
    if lib.scratch_section and (lib.arena == "caller" or lib.share_arena):
        raise TinydeployError("--scratch-section gives each model a static scratch arena that every context of it "
                              "uses, so it goes with the model's own static arena: leave out --arena caller "
                              "and --share-arena, or --scratch-section")
    if lib.share_arena and len(models) < 2:
        raise TinydeployError("--share-arena puts several models on one arena: give two or more models")
    if lib.states and lib.share_arena:
        raise TinydeployError("--share-arena: models that keep state between runs (--state) keep it in their arena, "
                              "which the other models would overwrite; build them without --share-arena")
    if lib.states and lib.states != "auto" and len(models) > 1:
        raise TinydeployError("--state IN=OUT names the tensors of one model; with several models use --state auto "
                              "(each input X_in with an output X_out)")
    arena = "caller" if lib.share_arena else lib.arena
    return [Api(n, arena, lib.arena_section, lib.weights_section, lib.scratch_section) for n in names]


def build_library(models, board="host", outdir=None, lib: Library | None = None, force: bool = False,
                  input_shapes=None, command: str = "", quiet: bool = False, extra_cflags=None, cc=None,
                  emulate: bool = False, builder: str | None = None, max_weights_bytes=None) -> BuildResult:
    """`build` in the library form: one or more models (each named, with its own symbols, files
    and contexts) behind the model table in one program: a host harness binary (several models:
    `model_run NAME IN.bin OUT.bin`) or one firmware whose harness selects the model by name
    (`model NAME%`), with flash and RAM per model; with lib.package, the models' packages in
    `package/<name>/`. compiled is pipeline.Image."""
    from tinydeploy import packages
    from tinydeploy.codegen.project import ModelInfo, header
    from tinydeploy.frontend.importer import sha256_file
    from tinydeploy.pipeline import compile_image
    lib = lib or Library()
    models = [Path(m) for m in models]
    for m in models:
        if not m.is_file():
            raise TinydeployError(f"model file {printable(str(m))!r} does not exist or is not a file")
    board = boards.get_board(board)
    target = board.make_target()
    emulate = emulate and board.is_mcu and not board.is_qemu_machine
    builder = builder or ("make" if emulate or board.is_qemu_machine else "pio")
    apis = library_apis(models, lib)
    outdir = Path(outdir) if outdir else Path("build") / (
        "-".join(a.name for a in apis)[:64] + f"-{board.id}" + ("-emulated" if emulate else ""))
    log = (lambda m: None) if quiet else progress
    previous = bld.claim_outdir(outdir, force)
    log(f"compiling {', '.join(printable(m.name) for m in models)} for {board.id}{' (emulated)' if emulate else ''} "
        f"as {', '.join(a.name for a in apis)}")
    info = ModelInfo(" + ".join(m.name for m in models), " ".join(sha256_file(m) for m in models), command, board.id)
    image = compile_image(models, target, apis, lib.share_arena, lib.states, header(info, "@FILE@"),
                          input_shapes=input_shapes, command=command, board=board.id,
                          max_weights_bytes=max_weights_bytes)
    extra = packages.package_files(image, board, command) if lib.package else {}
    fw = None
    if board.is_mcu:
        from tinydeploy import firmware
        log(f"building firmware with {builder} in {outdir}")
        fw = firmware.build_firmware(image, board, outdir, emulate=emulate, force=force, builder=builder, extra=extra)
        artifact, hashes = fw.elf, bld.read_marker(outdir).get("files", {})
    else:
        files = image.files | extra
        files.update(bld.host_files(f"Makefile -- generated by tinydeploy for {image.model}",
                                    header(info, "main.c: host harness"), target, sources=image.sources,
                                    headers=image.headers, multi=len(image.models) > 1))
        hashes = bld.write_files(outdir, files, previous, force)
        log(f"wrote {len(files)} files to {outdir}; compiling")
        artifact = bld.compile_host(outdir, target, extra_cflags, cc, sources=image.sources)
    summary = library_summary(models, board.id, outdir, image, sorted(hashes))
    if fw is not None:
        summary["firmware"] = {k: v for k, v in fw.memory.items() if k != "sections"}
        summary["elf"] = str(fw.elf)
    bld.write_marker(outdir, "firmware" if board.is_mcu else "host", hashes, artifact=_inside(artifact, outdir),
                     summary=summary)
    return BuildResult(outdir, artifact, image, False, summary, fw)


def library_summary(models: list[Path], board_id: str, outdir: Path, image, files) -> dict:
    """`build`'s summary of a library-form image: per model (its name, arena, states and the usual
    summary), and the image's totals; a shared arena with what it saves."""
    per = []
    for path, c in zip(models, image.models):
        s = _summary(path, board_id, outdir, c, files)
        s.update(name=c.api.name, arena=c.api.arena, scratch_bytes=c.plan.scratch_bytes,
                 states=[[i, o, o in c.plan.state_aliased] for i, o in c.states],
                 inputs=[x for x in s["inputs"] if x[0] not in dict(c.states)],
                 outputs=[x for x in s["outputs"] if x[0] not in dict(c.states).values()])
        s["output_lsb"] = [_dequantized_scale(c.graph, n) for n, _, _ in s["outputs"]]
        per.append(s)
    out = {"model": image.model, "board": board_id, "outdir": str(outdir), "models": per, "files": sorted(files),
           "weights_bytes": image.weights_bytes, "arena_bytes": image.arena_bytes,
           "scratch_bytes": image.scratch_bytes, "share_arena": image.share_arena}
    if image.share_arena:
        out["separate_arena_bytes"] = image.separate_arena_bytes
        out["shared_saving_bytes"] = image.separate_arena_bytes - image.arena_bytes
    return out


def _inside(artifact: Path, outdir: Path) -> str:
    """The build's artifact relative to its folder (PlatformIO names it by its absolute path)."""
    return str(Path(artifact).resolve().relative_to(Path(outdir).resolve()))


def _dequantized_scale(g, name: str) -> float | None:
    """The scale of a float output made by a per-tensor DequantizeLinear of an 8-bit tensor (the
    float outputs of QDQ models), which `run` compares in LSBs; else None."""
    from tinydeploy.quant.params import QTYPES, dq_info
    p = g.producer(name)
    if p is None or p.op != "DequantizeLinear":
        return None
    info = dq_info(g, p)
    if info is None or not info.per_tensor or info.dtype not in QTYPES:
        return None
    return float(info.s)


def load_inputs(path: Path, g_inputs: list[tuple[str, tuple, np.dtype]]) -> dict[str, np.ndarray]:
    """The model's inputs from an .npz (arrays named like the inputs; others are never read) or an
    .npy (one input): a regular file, each array's shape, type and byte order checked from its
    header before its data is read (tinydeploy.inputfiles)."""
    from tinydeploy.inputfiles import load_arrays
    return load_arrays(path, g_inputs)


def io_specs(summary: dict, kind: str) -> list[tuple[str, tuple, np.dtype]]:
    return [(n, tuple(shape), np.dtype(dt)) for n, shape, dt in summary[kind]]


def reference_model_bytes(model: Path) -> bytes:
    """The model as onnxruntime gets it. onnxruntime resolves the external data of a model given
    as bytes against the current folder, so such data is inlined here, loaded by
    importer.load_model (which reads only files inside the model's folder)."""
    import onnx
    from tinydeploy.frontend.importer import load_model
    data = model.read_bytes()
    m = onnx.load_model_from_string(data)
    if not any(t.data_location == onnx.TensorProto.EXTERNAL
               for t in onnx.external_data_helper._get_all_tensors(m)):
        return data
    return load_model(model).SerializeToString()


def run(model, board="host", inputs=None, seed: int = 0, input_shapes=None, outdir=None,
        force: bool = False, command: str = "", quiet: bool = False, extra_cflags=None, cc=None,
        latency: bool = True, emulate: bool = False, runner=None, runs: int | None = None,
        seconds: float = 1.0, threads: int = 1, max_weights_bytes=None, optimize: str = "balanced") -> dict:
    """Build, run on the inputs, compare with onnxruntime, time. `runner` (tinydeploy.runners)
    runs a Linux board's harness elsewhere (deploy: over ssh; measure: with --energy while sampling
    power); default: runners.select_runner's, here. `runs` fixes the number of timed runs (default:
    as many as fit in about `seconds`; none for the default runner under user-mode QEMU, whose time
    means nothing)."""
    model = Path(model)
    board = boards.get_board(board)
    board_id = board.id
    check_threads(board, threads)
    runs = check_runs(runs)
    timed = runner is not None or bool(runs)     # a runner handed in is for measuring (and stays open)
    with contextlib.nullcontext(runner) if runner else runners.select_runner(board, emulate) as runner:
        b = build(model, board, outdir, force, input_shapes, command, reuse=True, quiet=quiet,
                  extra_cflags=extra_cflags, cc=cc, emulate=emulate, threads=threads,
                  max_weights_bytes=max_weights_bytes, optimize=optimize)
        specs = io_specs(b.summary, "inputs")
        feeds = load_inputs(Path(inputs), specs) if inputs else reference.random_inputs(specs, seed)
        out_specs = [(shape, dt) for _, shape, dt in io_specs(b.summary, "outputs")]
        x = [feeds[n] for n, _, _ in specs]
        built = b.exe if b.firmware is None else b.firmware
        if b.firmware is not None and not quiet:
            progress(f"running under QEMU ({b.firmware.machine.id}, -icount: exact instruction counts)")
        # a Linux board's build under user-mode QEMU: its instructions per inference, counted exactly
        counting = (latency and not timed and b.firmware is None and threads == 1
                    and getattr(runner, "counts_instructions", False))
        if counting:
            if not quiet:
                progress(f"running {runner.where} with tinydeploy's counting plugin (exact instructions per inference)")
            got, counted = runner.count(built, x, out_specs)
            ms = None
        else:
            got, ms = runner.run(built, x, out_specs, runs=0)
        # 8-bit outputs, and float outputs of a DequantizeLinear: in LSBs against the oracle
        cmp = reference.check_outputs(model, reference_model_bytes(model), feeds, got, FP32_RTOL,
                                      b.summary.get("output_lsb"), input_shapes)
        result = {"model": model.name, "board": board_id, **cmp, "macs": b.summary["macs"],
                  "latency": {"median_ms": None, "runs": 0},
                  "memory": {"arena_bytes": b.summary["arena_bytes"], "lower_bound_bytes": b.summary["lower_bound_bytes"],
                             "weights_bytes": b.summary["weights_bytes"]}}
        if b.firmware is not None:
            fwm = b.summary["firmware"]
            result["latency"] = {"median_ms": ms, "runs": 1, "instructions": runner.last["instructions"],
                                 "note": "instructions per inference, exact under QEMU -icount; median_ms = "
                                         "instructions / board clock (a lower bound on the real board)"}
            result["memory"].update(flash_bytes=fwm["flash_used_bytes"], ram_bytes=fwm["ram_used_bytes"],
                                    flash_limit_bytes=fwm["flash_bytes"], ram_limit_bytes=fwm["ram_bytes"],
                                    stack_used_bytes=runner.last["stack_used_bytes"])
            result["emulated"] = True    # microcontroller firmware runs under QEMU here
        elif runner.emulated and not timed:
            result["emulated"] = True   # user-mode QEMU: results are real, time is not
            if counting:
                result["latency"] = {"median_ms": None, "runs": 0, **counted.as_dict(),
                                     "note": "instructions per inference under user-mode QEMU (tinydeploy's counting "
                                             "plugin; the difference of a 1-inference and a "
                                             f"{counted.inferences + 1}-inference run), exact; no time: a Cortex-A "
                                             "core runs several instructions per cycle"}
            elif latency and threads > 1:
                from tinydeploy.runners.icount import ONE_THREAD
                result["latency"]["note"] = ONE_THREAD
        elif latency:
            if runs:
                ms = runner.run(built, x, out_specs, runs=runs)[1]
            else:
                ms, runs = time_runs(runner, built, x, out_specs, seconds)
            result["latency"] = {"median_ms": ms, "runs": runs}
            if runner.emulated:
                result["emulated"] = True
    return result


def measure(model, board, port: str | None, inputs=None, seed: int = 0, input_shapes=None, outdir=None,
            force: bool = False, command: str = "", quiet: bool = False, runs: int | None = None,
            timeout: float = 60.0, energy: bool = False, sysfs_root="/", emulate: bool = False,
            max_weights_bytes=None, reuse: bool = False) -> dict:
    """The `run` flow against a board that already runs this model's firmware, over a serial port
    (any pyserial URL: /dev/ttyACM0, or socket://127.0.0.1:N for QEMU in tests). Linux boards are
    measured on this machine instead (natively on the board itself, or with --emulate), with
    --energy from their power rails (runners.energy)."""
    model = Path(model)
    board = boards.get_board(board)
    board_id = board.id
    runs, timeout = check_runs(runs), check_timeout(timeout)
    if board.is_linux:
        return _measure_linux(model, board, port, energy, sysfs_root, emulate, runs, inputs=inputs, seed=seed,
                              input_shapes=input_shapes, outdir=outdir, force=force, command=command, quiet=quiet,
                              max_weights_bytes=max_weights_bytes)
    if energy:
        raise TinydeployError(f"--energy reads a Jetson's power rails; {board_id} is a microcontroller (measure its "
                              "energy with an external power analyser)")
    if not port:
        raise TinydeployError(f"{board_id} is a microcontroller: give its serial port with --port (/dev/ttyACM0, or "
                              "a pyserial URL)")
    runner = runners.select_runner(board, port=port, timeout=timeout)
    b = build(model, board, outdir, force, input_shapes, command, quiet=quiet, reuse=reuse, max_weights_bytes=max_weights_bytes)
    specs = io_specs(b.summary, "inputs")
    feeds = load_inputs(Path(inputs), specs) if inputs else reference.random_inputs(specs, seed)
    out_specs = [(shape, dt) for _, shape, dt in io_specs(b.summary, "outputs")]
    got, ms = runner.run(b.firmware, [feeds[n] for n, _, _ in specs], out_specs, runs=runs or 1)
    cmp = reference.check_outputs(model, reference_model_bytes(model), feeds, got, FP32_RTOL,
                                  b.summary.get("output_lsb"), input_shapes)
    counts = runner.last["counts"]
    lat = {"runs": counts.runs, "median_ms": ms}
    if counts.instructions is not None:
        lat["instructions"] = counts.instructions
    fwm = b.summary["firmware"]
    return {"model": model.name, "board": board_id, "port": port, **cmp, "latency": lat,
            "memory": {"arena_bytes": b.summary["arena_bytes"], "lower_bound_bytes": b.summary["lower_bound_bytes"],
                       "weights_bytes": b.summary["weights_bytes"], "flash_bytes": fwm["flash_used_bytes"],
                       "ram_bytes": fwm["ram_used_bytes"], "flash_limit_bytes": fwm["flash_bytes"],
                       "ram_limit_bytes": fwm["ram_bytes"], "stack_used_bytes": runner.last["stack_used_bytes"]}}


def _measure_linux(model: Path, board, port, energy: bool, sysfs_root, emulate: bool, runs, **run_args) -> dict:
    """`measure` of a Linux board on this machine: `run` with timing, and with --energy the
    board's power rails sampled during the timed runs ("energy" in the report; the window is at
    least energy.MIN_WINDOW_S unless `runs` is given)."""
    rails = None
    if energy:
        from tinydeploy.runners import energy as en
        rails = en.find_rails(board, sysfs_root)
    runner = runners.select_runner(board, emulate, port=port)
    if energy:
        runner = en.EnergyRunner(runner, rails, min_window_s=0.0 if runs else en.MIN_WINDOW_S)
    res = run(model, board, emulate=emulate, runner=runner, runs=runs, **run_args)
    if energy:
        res["energy"] = runner.report()
        res["latency"]["runs"] = runner.runs      # the window may have been lengthened
    return res


# ---- validate: every layer against its reference ------------------------------------------------

CAPTURE_CFLAGS = ["-DTD_CAPTURE", "-DTD_PROFILE"]   # the capture build: hooks after and around each layer
PROFILE_RUNS = {False: 10, True: 3}                 # timed runs per layer on Linux boards (natively, emulated)


def load_dataset(folder: Path, specs) -> list[tuple[dict, int | None, str]]:
    """`--dataset DIR`: every .npz in DIR (in name order) holds the model's inputs by name, either
    one sample (the inputs' shapes) or several (one more leading axis, the same count for every
    input), and optionally `label` (an integer) or `labels` (one per sample). [(feeds, label,
    where)]."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TinydeployError(f"--dataset {printable(str(folder))!r} is not a folder")
    files = sorted(p for p in folder.iterdir() if p.suffix == ".npz" and p.is_file())
    if not files:
        raise TinydeployError(f"--dataset {printable(str(folder))!r} holds no .npz files")
    out = []
    for f in files:
        try:
            with np.load(f, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
        except Exception as e:
            raise TinydeployError(f"cannot read {printable(f.name)!r}: {printable(str(e), 120)}") from None
        labels = arrays.get("labels", arrays.get("label"))
        counts = set()
        for name, shape, dtype in specs:
            a = arrays.get(name)
            if a is None or a.dtype != dtype or tuple(a.shape[-len(shape):] if shape else ()) != tuple(shape) \
                    or a.ndim not in (len(shape), len(shape) + 1):
                raise TinydeployError(f"{printable(f.name)}: expected {printable(name)!r} as {np.dtype(dtype).name} "
                                      f"{'x'.join(map(str, shape))} (or N x that), got "
                                      + (f"{a.dtype.name} {'x'.join(map(str, a.shape))}" if a is not None else "none"))
            counts.add(1 if a.ndim == len(shape) else a.shape[0])
        if len(counts) != 1:
            raise TinydeployError(f"{printable(f.name)}: the inputs hold different numbers of samples {sorted(counts)}")
        n = counts.pop()
        lab = None if labels is None else np.asarray(labels).reshape(-1)
        if lab is not None and (lab.size != n or lab.dtype.kind not in "iu"):
            raise TinydeployError(f"{printable(f.name)}: labels must be {n} integer(s)")
        for k in range(n):
            feeds = {name: (arrays[name] if arrays[name].ndim == len(shape) else arrays[name][k])
                     for name, shape, _ in specs}
            out.append((feeds, None if lab is None else int(lab[k]), f"{f.name}[{k}]" if n > 1 else f.name))
    return out


def validate(model, board="host", inputs=None, dataset=None, seed: int = 0, input_shapes=None, outdir=None,
             force: bool = False, command: str = "", quiet: bool = False, emulate: bool = False,
             port: str | None = None, ssh: str | None = None, identity: str | None = None, ssh_options=(),
             profile: bool = False, reference_kind: str = "oracle", extra_cflags=None,
             max_weights_bytes=None, timeout: float | None = None) -> dict:
    """Runs the capture build of `model` on `board` (here, under QEMU, on a serial port or over
    ssh) on one input or a data set, and holds every layer's outputs to the reference of the same
    tensor (tinydeploy.validate). `extra_cflags` go into the capture build (the tests plant a
    fault with -DTD_TEST_FAULT_STEP=k). The verdict on the outputs is `run`'s."""
    from tinydeploy import validate as val
    model = Path(model)
    board = boards.get_board(board)
    if inputs and dataset:
        raise TinydeployError("give --inputs or --dataset, not both")
    if reference_kind not in val.REFERENCES:
        raise TinydeployError(f"--reference must be one of {', '.join(val.REFERENCES)}")
    if dataset and not Path(dataset).is_dir():        # bad input is refused before anything is built
        raise TinydeployError(f"--dataset {printable(str(dataset))!r} is not a folder")
    if inputs and not Path(inputs).is_file():
        raise TinydeployError(f"cannot read inputs from {printable(str(inputs))!r}: no such file")
    remote = None
    if ssh:
        from tinydeploy.runners.ssh import Remote, check_board
        if not board.is_linux:
            raise TinydeployError(f"--ssh reaches Linux boards; {board.id} is a microcontroller (use --port)")
        remote = Remote(ssh, None, identity, options=ssh_options)
        check_board(remote, board)
    log = (lambda m: None) if quiet else progress
    cflags = CAPTURE_CFLAGS + list(extra_cflags or [])
    if board.runs_here and remote is not None and "-static" not in board.make_target().cflags:
        cflags.append("-static")
    with runners.select_runner(board, emulate, remote=remote, port=port, timeout=timeout) as runner:
        emulated_mcu = board.is_mcu and port is None
        outdir = Path(outdir) if outdir else default_outdir(
            model, board.id + ("-emulated" if emulate and board.is_mcu and not board.is_qemu_machine else "")
            + ("-static" if "-static" in cflags else "") + "-validate")
        b = build(model, board, outdir, force, input_shapes, command, reuse=True, quiet=quiet, extra_cflags=cflags,
                  emulate=emulate and emulated_mcu, max_weights_bytes=max_weights_bytes)
        schedule = b.summary["schedule"]
        specs = io_specs(b.summary, "inputs")
        out_specs = [(shape, dt) for _, shape, dt in io_specs(b.summary, "outputs")]
        if dataset:
            samples = load_dataset(Path(dataset), specs)
        else:
            feeds = load_inputs(Path(inputs), specs) if inputs else reference.random_inputs(specs, seed)
            samples = [(feeds, None, str(inputs) if inputs else f"random inputs, seed {seed}")]
        model_bytes = reference_model_bytes(model)
        oracle, q = reference.oracle_bytes(model_bytes)
        names = val.onnx_names(schedule, reference.produced_tensors(oracle if reference_kind == "oracle"
                                                                      else model_bytes))
        graph = None
        if q:
            from tinydeploy.quant import exact
            graph = exact.lowered_graph(model, input_shapes)
        built = b.exe if b.firmware is None else b.firmware
        stats, tally, verdicts, rows, first, costs = {}, val.Tally(), [], [], None, None
        for k, (feeds, label, where) in enumerate(samples):
            log(f"capturing every layer {runner.where} ({where})")
            runs = PROFILE_RUNS[runner.emulated] if profile and k == 0 and not board.is_mcu else 0
            cap = runner.capture(built, [feeds[n] for n, _, _ in specs], out_specs, profile_runs=runs)
            if k == 0:
                costs = (cap.cost_unit, cap.costs)
            refs = val.references(model, model_bytes, schedule, feeds, val.target_tensors(schedule, cap.tensors, feeds),
                                  names, reference_kind, input_shapes, graph)
            rows_k = val.analyse(schedule, cap.tensors, feeds, refs, names, reference_kind, FP32_RTOL,
                                 stats if dataset else None)
            verdicts.append(reference.check_outputs(model, model_bytes, feeds, cap.outputs, FP32_RTOL,
                                                    b.summary.get("output_lsb"), input_shapes))
            fd = val.first_divergent(rows_k)
            if k == 0 or (fd is not None and first is None):   # the rows shown: the first sample that diverges
                rows = rows_k
            if fd is not None and first is None:
                first = dict(fd, sample=where) if dataset else fd
            if dataset:    # X-CUBE-AI's figures on the first output, top-1 against the reference and labels
                want = reference.run_onnxruntime(oracle if reference_kind == "oracle" else model_bytes, feeds,
                                                 optimize=not q or reference_kind != "oracle")
                tally.add(cap.outputs[0], want[0], label, fd is not None)
        if dataset:
            rows = val.aggregate(rows, stats, FP32_RTOL)
        if profile:
            for r in rows:
                r["cost"] = costs[1].get(r["step"]) if r["index"] == 0 else None
        matches = sum(bool(v["outputs_match"]) for v in verdicts)
        shown = next((v for v in verdicts if not v["outputs_match"]), verdicts[0])
        result = {"model": model.name, "board": board.id, "where": runner.where, "emulated": runner.emulated,
                  "reference": reference_kind, "outputs_match": matches == len(samples),
                  "first_divergent_layer": first, "tolerance": {"lsb": reference.LSB_TOLERANCE, "relative": FP32_RTOL},
                  "outputs": shown,
                  "layers": rows, "build": str(outdir), "samples": len(samples)}
        if profile:
            from tinydeploy.runners.capture import cost_label
            result["profile"] = {"unit": costs[0], "what": cost_label(costs[0], runner.emulated),
                                 "total": sum(costs[1].values())}
        if dataset:
            result["dataset"] = dict(tally.figures(), outputs_match=matches)
        memory = {"arena_bytes": b.summary["arena_bytes"], "lower_bound_bytes": b.summary["lower_bound_bytes"],
                  "weights_bytes": b.summary["weights_bytes"]}
        if b.summary.get("firmware"):
            memory["firmware"] = b.summary["firmware"]
        result["memory"] = memory
        result["summary"] = b.summary
    return json_safe(result)


def json_safe(obj):
    """NaN and infinities (which JSON cannot carry) as None, everywhere in obj."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


# ---- report: the compiled model, its memory and (when measured) its costs, as one HTML file ------

def report_facts(summary: dict, board, capture_build: bool = False) -> dict:
    """What report.render draws, from a build summary (_summary)."""
    board = boards.get_board(board)
    return {"model": summary["model"], "board": board.id, "board_name": board.name, "sha256": summary.get("sha256"),
            "schedule": summary["schedule"], "macs": summary["macs"], "weights_bytes": summary["weights_bytes"],
            "layers": summary["layers"], "notes": summary.get("notes", []), "firmware": summary.get("firmware"),
            "flash_limit_bytes": board.flash_bytes, "ram_limit_bytes": board.ram_bytes, "capture_build": capture_build}


def layer_costs(model, board, emulate: bool = False, outdir=None, force: bool = False, input_shapes=None,
                command: str = "", quiet: bool = False, seed: int = 0, runs: int | None = None,
                max_weights_bytes=None) -> dict:
    """Each layer's cost on the board, from its capture build (-DTD_CAPTURE -DTD_PROFILE) with
    nothing sent: microcontrollers count instructions under QEMU (DWT cycles on a board over a
    serial port are validate --port --profile's), Linux boards time `runs` inferences (their
    runner's layer_costs: microseconds, the seam for an instruction-counting runner).
    {"unit", "what", "costs": {step: cost}, "emulated", "summary"}."""
    from tinydeploy.runners.capture import cost_label
    model, board = Path(model), boards.get_board(board)
    with runners.select_runner(board, emulate) as runner:
        outdir = Path(outdir) if outdir else default_outdir(
            model, board.id + ("-emulated" if emulate and board.is_mcu and not board.is_qemu_machine else "") + "-validate")
        b = build(model, board, outdir, force, input_shapes, command, reuse=True, quiet=quiet,
                  extra_cflags=CAPTURE_CFLAGS, emulate=emulate and board.is_mcu, max_weights_bytes=max_weights_bytes)
        specs = io_specs(b.summary, "inputs")
        feeds = reference.random_inputs(specs, seed)
        out_specs = [(shape, dt) for _, shape, dt in io_specs(b.summary, "outputs")]
        built = b.exe if b.firmware is None else b.firmware
        cap = runner.capture(built, [feeds[n] for n, _, _ in specs], out_specs,
                             profile_runs=runs or PROFILE_RUNS[runner.emulated], send=False)
    return {"unit": cap.cost_unit, "what": cost_label(cap.cost_unit, runner.emulated), "costs": cap.costs,
            "emulated": runner.emulated, "summary": b.summary}


def report(model, board="host", output=None, input_shapes=None, outdir=None, force: bool = False, command: str = "",
           quiet: bool = False, profile: bool = False, emulate: bool = False, max_weights_bytes=None) -> Path:
    """`tinydeploy report`: microcontrollers build the board's firmware (make) for its flash and
    RAM; Linux boards only compile (the arena, the kernels and the weights are known then). With
    `profile`, each layer's cost (layer_costs). Returns the report's path."""
    from tinydeploy import report as rep
    model, board = Path(model), boards.get_board(board)
    if not model.is_file():
        raise TinydeployError(f"model file {printable(str(model))!r} does not exist or is not a file")
    output = Path(output) if output else default_outdir(model, board.id).with_name(
        default_outdir(model, board.id).name + "-report.html")
    if output.parent == Path("build") and not output.parent.exists():
        output.parent.mkdir()
    rep.check_path(output, force)       # before the work
    if board.is_mcu:
        b = build(model, board, outdir, force, input_shapes, command, reuse=True, quiet=quiet, builder="make",
                  max_weights_bytes=max_weights_bytes)
        summary = b.summary
    else:
        (progress if not quiet else (lambda m: None))(f"compiling {printable(model.name)} for {board.id}")
        c = compile_model(model, board.make_target(), input_shapes, command=command, board=board.id,
                          max_weights_bytes=max_weights_bytes)
        summary = _summary(model, board.id, Path(outdir or "-"), c, [])
    prof = None
    if profile:
        prof = layer_costs(model, board, emulate=emulate or board.is_mcu, input_shapes=input_shapes, command=command,
                           quiet=quiet, max_weights_bytes=max_weights_bytes)
        prof.pop("summary")
    return rep.write(output, report_facts(summary, board), profile=prof, force=force)
