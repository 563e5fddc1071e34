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
    }


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


def _firmware(c: Compiled, board, outdir: Path, emulate: bool, builder: str, force: bool):
    """Microcontroller boards: the model's C plus the firmware harness and the board's port, as a
    project with a Makefile and a platformio.ini, built offline; refused with numbers if too big."""
    from tinydeploy import firmware
    fw = firmware.build_firmware(c, board, outdir, emulate=emulate, force=force, builder=builder)
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
          max_weights_bytes=None) -> BuildResult:
    """Compile `model` for `board` and build it in `outdir`: a harness binary for Linux boards,
    firmware for microcontrollers (`emulate`: for the QEMU machine that stands in for the board,
    with the board's limits). With `reuse`, an up-to-date build in `outdir` (the same model,
    board, options and tinydeploy: bld.build_key) is taken as it is. `max_weights_bytes`: the
    weights budget (bytes; None: TINYDEPLOY_MAX_WEIGHTS_BYTES, else sized against this machine's
    memory; see tinydeploy.limits)."""
    from tinydeploy.frontend.importer import sha256_file
    model = Path(model)
    board = boards.get_board(board)
    check_threads(board, threads)
    target = bld.with_threads(board.make_target(), threads)
    emulate = emulate and board.is_mcu and not board.is_qemu_machine
    builder = builder or ("make" if emulate or board.is_qemu_machine else "pio")
    outdir = Path(outdir) if outdir else default_outdir(model, board.id + ("-emulated" if emulate else ""))
    log = (lambda m: None) if quiet else progress
    regular_size(model, "model file")
    key = bld.build_key(sha256_file(model), board.id,
                        {"shapes": sorted((k, list(v)) for k, v in (input_shapes or {}).items()),
                         "cflags": extra_cflags or [], "cc": cc or "", "threads": threads, "emulate": emulate,
                         "builder": builder if board.is_mcu else "", "selection": schedule.selection_state(target)})
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
                                   json.loads((outdir / "memory.json").read_text()))
        return BuildResult(outdir, artifact, None, True, previous["summary"], fw)
    log(f"compiling {printable(model.name)} for {board.id}{' (emulated)' if emulate else ''}")
    c = compile_model(model, target, input_shapes, command=command, board=board.id, threads=threads,
                      max_weights_bytes=max_weights_bytes)
    fast = schedule.describe(c.kernels, fast_only=True)
    for line in fast:
        log(printable(line, 160))
    if not board.is_mcu:
        log(f"{len(fast)} layers with fast algorithms, "
            f"{sum(1 for k in c.kernels if k is not None and k.params.get('algo') == 'ref')} conv/dense layers "
            "kept the reference")
    fw = None
    if board.is_mcu:
        log(f"building firmware with {builder} in {outdir}")
        artifact, fw = _firmware(c, board, outdir, emulate, builder, force)
        hashes = bld.read_marker(outdir).get("files", {})
    else:
        artifact, hashes = _host_binary(c, board, target, outdir, command, threads, extra_cflags, cc, force,
                                        previous, log)
    summary = _summary(model, board.id, outdir, c, sorted(hashes))
    if fw is not None:
        summary["firmware"] = {k: v for k, v in fw.memory.items() if k != "sections"}
        summary["elf"] = str(fw.elf)
    # The key goes in last, so an interrupted build is never taken for an up-to-date one.
    bld.write_marker(outdir, "firmware" if board.is_mcu else "host", hashes, key=key,
                     artifact=str(artifact.relative_to(outdir)), summary=summary)
    return BuildResult(outdir, artifact, c, False, summary, fw)


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
        seconds: float = 1.0, threads: int = 1, max_weights_bytes=None) -> dict:
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
                  max_weights_bytes=max_weights_bytes)
        specs = io_specs(b.summary, "inputs")
        feeds = load_inputs(Path(inputs), specs) if inputs else reference.random_inputs(specs, seed)
        out_specs = [(shape, dt) for _, shape, dt in io_specs(b.summary, "outputs")]
        x = [feeds[n] for n, _, _ in specs]
        built = b.exe if b.firmware is None else b.firmware
        if b.firmware is not None and not quiet:
            progress(f"running under QEMU ({b.firmware.machine.id}, -icount: exact instruction counts)")
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
            max_weights_bytes=None) -> dict:
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
    b = build(model, board, outdir, force, input_shapes, command, quiet=quiet, max_weights_bytes=max_weights_bytes)
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
