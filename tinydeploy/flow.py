"""What the commands do, as functions (the CLI only parses and prints): build a model for a
board, run it against onnxruntime, benchmark it."""
from __future__ import annotations

import contextlib
import dataclasses
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
from tinydeploy.pipeline import Compiled, compile_model
from tinydeploy.runners.harness import time_runs

FP32_RTOL = 1e-4
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


def build_mcu(model: Path, board: dict, outdir: Path, force: bool, input_shapes, command: str, log,
              emulate: bool, builder: str, max_weights_bytes=None) -> BuildResult:
    """Microcontroller boards: the model's C plus the firmware harness and the board's port, as a
    project with a Makefile and a platformio.ini, built offline; refused with numbers if too big."""
    from tinydeploy import firmware
    log(f"compiling {printable(model.name)} for {board.id}{' (emulated)' if emulate else ''}")
    target = board.make_target()
    c = compile_model(model, target, input_shapes, command=command, board=board.id,
                      max_weights_bytes=max_weights_bytes)
    log(f"building firmware with {builder} in {outdir}")
    fw = firmware.build_firmware(c.files, board, outdir, emulate=emulate, force=force, builder=builder)
    summary = _summary(model, board.id, outdir, c, sorted(p.name for p in outdir.iterdir()))
    summary["firmware"] = {k: v for k, v in fw.memory.items() if k != "sections"}
    summary["elf"] = str(fw.elf)
    return BuildResult(outdir, fw.elf, c, False, summary, fw)


def build(model, board="host", outdir=None, force: bool = False, input_shapes=None,
          command: str = "", reuse: bool = False, quiet: bool = False, extra_cflags=None, cc=None,
          emulate: bool = False, builder: str | None = None, threads: int = 1,
          max_weights_bytes=None) -> BuildResult:
    """`max_weights_bytes`: the weights budget (bytes; None: TINYDEPLOY_MAX_WEIGHTS_BYTES, else
    sized against this machine's memory; see tinydeploy.limits)."""
    model = Path(model)
    board = boards.get_board(board)
    board_id = board.id
    check_threads(board, threads)
    target = bld.with_threads(board.make_target(), threads)
    emulate = emulate and board.is_mcu and not board.is_qemu_machine
    outdir = Path(outdir) if outdir else default_outdir(model, board_id + ("-emulated" if emulate else ""))
    log = (lambda m: None) if quiet else progress
    if not model.is_file():
        raise TinydeployError(f"model file {printable(str(model))!r} does not exist or is not a file")
    if board.is_mcu:
        return build_mcu(model, board, outdir, force, input_shapes, command, log, emulate,
                         builder or ("make" if emulate or board.is_qemu_machine else "pio"),
                         max_weights_bytes)
    from tinydeploy.frontend.importer import sha256_file
    key = bld.build_key(sha256_file(model), board_id,
                        {"shapes": sorted((k, list(v)) for k, v in (input_shapes or {}).items()),
                         "cflags": extra_cflags or [], "cc": cc or "", "threads": threads,
                         "selection": schedule.selection_state(target)})
    previous = bld.prepare_outdir(outdir, force)
    exe = outdir / "model_run"
    if reuse and previous.get("key") == key and exe.is_file() and "summary" in previous:
        log(f"reusing up-to-date build in {outdir}")
        return BuildResult(outdir, exe, None, True, previous["summary"])
    log(f"compiling {printable(model.name)} for {board_id}")
    c = compile_model(model, target, input_shapes, command=command, board=board_id, threads=threads,
                      max_weights_bytes=max_weights_bytes)
    fast = schedule.describe(c.kernels, fast_only=True)
    for line in fast:
        log(printable(line, 160))
    log(f"{len(fast)} layers with fast algorithms, "
        f"{sum(1 for k in c.kernels if k is not None and k.params.get('algo') == 'ref')} conv/dense layers kept the reference")
    files = dict(c.files)
    from tinydeploy.codegen.project import ModelInfo, header
    info = ModelInfo(model.name, c.sha256, command, board_id)
    files.update(bld.host_files(f"Makefile -- generated by tinydeploy for {model.name}", header(info, "main.c: host harness"), target,
                                threads))
    summary = _summary(model, board_id, outdir, c, files)
    bld.write_project(outdir, files, "")
    size = sum(len(t) for t in files.values())
    log(f"wrote {len(files)} files ({size / 1e6:.1f} MB of C) to {outdir}; compiling")
    # The C is on disk: let go of its text before the compiler runs. A 400 MB weight is 0.5 to 1.7 GB
    # of C, and the compiler needs ~3.3 bytes per character of it for itself (tinydeploy/limits.py).
    del files
    c = dataclasses.replace(c, files={})
    exe = bld.compile_host(outdir, target, extra_cflags, cc)
    # Record the key last, so an interrupted build is never taken for an up-to-date one.
    import json
    marker = json.loads((outdir / bld.MARKER).read_text())
    marker.update(key=key, summary=summary)
    (outdir / bld.MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return BuildResult(outdir, exe, c, False, summary)


def _dequantized_scale(g, name: str) -> float | None:
    """The scale of a float output made by a per-tensor DequantizeLinear of an 8-bit tensor (the
    float outputs of QDQ models), which `run` compares in LSBs; else None."""
    from tinydeploy.quant import QTYPES, dq_info
    p = g.producer(name)
    if p is None or p.op != "DequantizeLinear":
        return None
    info = dq_info(g, p)
    if info is None or not info.per_tensor or info.dtype not in QTYPES:
        return None
    return float(info.s)


def load_inputs(path: Path, g_inputs: list[tuple[str, tuple, np.dtype]]) -> dict[str, np.ndarray]:
    try:
        data = np.load(path, allow_pickle=False)
        # an .npz loads its arrays lazily: read them here, where errors are caught
        arrays = dict(data.items()) if hasattr(data, "items") else {g_inputs[0][0]: data}
    except Exception as e:
        raise TinydeployError(f"cannot read inputs from {printable(str(path))!r}: {printable(str(e), 120)}") from None
    out = {}
    for name, shape, dtype in g_inputs:
        if name not in arrays:
            raise TinydeployError(f"{printable(str(path))} has no array named {printable(name)!r} "
                                  f"(expected {np.dtype(dtype).name} {'x'.join(map(str, shape))}; "
                                  f"it has {', '.join(map(printable, arrays)) or 'none'})")
        a = arrays[name]
        if tuple(a.shape) != tuple(shape) or a.dtype != dtype:
            raise TinydeployError(f"input {printable(name)!r}: expected {np.dtype(dtype).name} "
                                  f"{'x'.join(map(str, shape))}, got {a.dtype.name} {'x'.join(map(str, a.shape))}")
        out[name] = a
    return out


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
