"""Command line: `tinydeploy build|run|inspect|boards|bench|doctor|...`. Parses, calls
tinydeploy.flow (doctor: tinydeploy.doctor), prints. Every expected failure is a TinydeployError:
one line on stderr, exit code 2."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from tinydeploy import __version__
from tinydeploy.codegen.cfmt import printable  # model file names reach the terminal only through it
from tinydeploy.errors import TinydeployError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--board", default="host", help="board id (see `tinydeploy boards`; default host)")
    p.add_argument("--input-shape", action="append", metavar="NAME=1x3x224x224",
                   help="pin an input's shape (repeatable); a symbolic batch dimension defaults to 1")
    p.add_argument("-o", "--outdir", help="output folder (default build/<model>-<board>)")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder tinydeploy did not create")
    _max_weights(p)


def _max_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-weights-bytes", metavar="SIZE",
                   help="the most bytes of constants a model may make (its weights and what constant folding "
                   "computes), e.g. 2G or 512M (default: $TINYDEPLOY_MAX_WEIGHTS_BYTES, else this machine's "
                   "available memory / the build's memory per weight byte)")


def _threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="Linux boards: run each layer on up to N OpenMP threads (default 1)")


class _Version(argparse.Action):
    """--version: tinydeploy's version, the reference stack's and the CPU features (for bug reports)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from tinydeploy import doctor
        print("\n".join(doctor.format_version(doctor.summary())))
        parser.exit()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tinydeploy", description="ONNX models to static-memory C for MCUs, SBCs and the host.")
    ap.add_argument("--version", action=_Version, help=f"tinydeploy {__version__}: with the versions of onnx, "
                    "onnxruntime, numpy, ... and the CPU features that decide 8-bit results; then exit")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("build", help="generate the C project and compile it")
    _common(p)
    p.add_argument("--builder", choices=["pio", "make"], help="microcontroller boards: PlatformIO (default for "
                   "real boards, offline) or the generated Makefile")
    p.add_argument("--emulate", action="store_true", help="microcontroller boards: build for the QEMU machine "
                   "that stands in for the board, with the board's memory limits")
    p.add_argument("--quantize", choices=["uint8", "int8"], help="quantise first (onnxruntime, QDQ, per channel)")
    p.add_argument("--calibration", help="calibration data for --quantize (.npz/.npy or a folder)")
    _threads(p)
    p = sub.add_parser("run", help="build, run on inputs, compare with onnxruntime")
    _common(p)
    _threads(p)
    p.add_argument("--inputs", help=".npz (arrays named like the model inputs) or .npy (single input)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--emulate", action="store_true", help="run a board's build here under QEMU")
    p = sub.add_parser("inspect", help="operator table, shapes, MACs, parameters, unsupported operators")
    p.add_argument("model")
    p.add_argument("--input-shape", action="append", metavar="NAME=1x3x224x224")
    _max_weights(p)
    p = sub.add_parser("quantize", help="8-bit static quantisation by onnxruntime, with an accuracy report")
    p.add_argument("model")
    p.add_argument("--calibration", required=True, help=".npz/.npy file or a folder of them")
    p.add_argument("-o", "--output", required=True, help="quantised .onnx to write")
    p.add_argument("--activations", choices=["uint8", "int8"], default="uint8")
    p.add_argument("--weights", choices=["uint8", "int8"], default="int8")
    p.add_argument("--per-channel", action="store_true")
    p.add_argument("--method", choices=["minmax", "entropy", "percentile"], default="minmax")
    p.add_argument("--format", choices=["qdq", "qoperator"], default="qdq")
    p.add_argument("--json", action="store_true")
    _max_weights(p)
    p = sub.add_parser("measure", help="run against a board already flashed with the model, over serial; "
                       "Linux boards: on this machine, with --energy from a Jetson's power rails")
    _common(p)
    p.add_argument("--port", help="microcontroller boards (required): serial port or pyserial URL "
                   "(socket://127.0.0.1:N for QEMU)")
    p.add_argument("--inputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, help="inferences to time (default: 1 on microcontrollers, about 3 s of "
                   "runs on Linux boards)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each answer (default 60)")
    p.add_argument("--energy", action="store_true", help="Jetson boards: sample the power rails of the board "
                   "manifest at 10 Hz during the timed runs; joules per inference")
    p.add_argument("--sysfs-root", default="/", help="where sysfs is mounted for --energy (default /)")
    p.add_argument("--emulate", action="store_true", help="Linux boards: run the board's binary here under QEMU")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("deploy", help="cross-build, run on a Linux board over ssh, compare with onnxruntime")
    _common(p)
    p.add_argument("--ssh", required=True, metavar="USER@HOST[:PORT]", help="the board (system ssh/scp, no prompts)")
    p.add_argument("--port", type=int, help="ssh port (default 22, or the one in --ssh)")
    p.add_argument("--identity", metavar="KEY", help="private key to log in with (ssh -i)")
    p.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra ssh -o option, e.g. UserKnownHostsFile=FILE (repeatable)")
    p.add_argument("--remote-dir", help="folder on the board to run in, kept afterwards (default: a fresh "
                   "mktemp -d, removed afterwards)")
    p.add_argument("--runs", type=int, help="inferences to time (default: as many as fit in about 1 s)")
    _threads(p)
    p.add_argument("--inputs", help=".npz (arrays named like the model inputs) or .npy (single input)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p = sub.add_parser("flash", help="flash a built firmware project to a board (PlatformIO upload)")
    p.add_argument("builddir", nargs="?", help="the project folder `tinydeploy build` wrote")
    p.add_argument("--board", required=True)
    p.add_argument("--port", help="serial port of the board (default: PlatformIO finds it)")
    p = sub.add_parser("doctor", help="versions of tinydeploy, Python and the reference stack, the CPU and its "
                       "features, the external tools, and whether the installed packages match constraints.txt")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    sub.add_parser("boards", help="list the known boards")
    sub.add_parser("ops", help="list the supported ONNX operators")
    p = sub.add_parser("bench", help="median latency of the generated code next to onnxruntime's")
    p.add_argument("models", nargs="+")
    p.add_argument("--board", default="host")
    p.add_argument("--seconds", type=float, default=1.0, help="time budget per measurement (default 1 s)")
    p.add_argument("--json", action="store_true")
    _threads(p)
    p.add_argument("--layers", action="store_true", help="per layer: algorithm, MACs, median us, GFLOP/s, share "
                   "of the time (a build with -DTD_PROFILE)")
    p.add_argument("--emulate", action="store_true", help="with --layers: run an SBC board's build under "
                   "qemu-aarch64 (times labelled emulated)")
    _max_weights(p)
    p = sub.add_parser("tune", help="measure kernel candidates per layer shape, keep the fastest in the "
                       "target's tuning database")
    p.add_argument("models", nargs="+")
    p.add_argument("--board", default="host")
    p.add_argument("--db", help="tuning database file (default tinydeploy/schedule/tuning/<target>-<isa>.json)")
    p.add_argument("--jobs", type=int, help="parallel candidate builds (default: CPU count)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="skip layer shapes already in the database (default; --no-resume measures them again)")
    p.add_argument("--seconds", type=float, default=0.2, help="time budget per candidate timing (default 0.2 s)")
    p.add_argument("--ssh", metavar="USER@HOST", help="measure on this Linux board over ssh")
    p.add_argument("--port", type=int, help="ssh port")
    p.add_argument("--identity", help="ssh private key")
    _max_weights(p)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    command = "tinydeploy " + " ".join(shlex.quote(a) for a in argv)
    try:
        return _dispatch(args, command)
    except TinydeployError as e:
        print(f"tinydeploy: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tinydeploy: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug in tinydeploy, not the user's input: still one line
        if os.environ.get("TINYDEPLOY_DEBUG"):
            raise
        print(f"tinydeploy: internal error: {type(e).__name__}: {str(e)[:200]} "
              "(set TINYDEPLOY_DEBUG=1 for the traceback and please report it)", file=sys.stderr)
        return 3


def _dispatch(args, command: str) -> int:
    if args.cmd == "doctor":   # before the pipeline's imports: it also reports a broken onnx install
        from tinydeploy import doctor
        r = doctor.report()
        print(json.dumps(r)) if args.json else print("\n".join(doctor.format_report(r)))
        return 0
    from tinydeploy import flow, limits
    from tinydeploy.targets import boards
    from tinydeploy.frontend import importer
    shapes = importer.parse_shape_overrides(getattr(args, "input_shape", None))
    mwb = getattr(args, "max_weights_bytes", None)
    mwb = limits.parse_size(mwb) if mwb is not None else None   # bytes, passed down explicitly
    if args.cmd == "boards":
        for b in boards.load_all().values():
            mem = ""
            if b.ram_bytes:
                mem = f"  RAM {b.ram_bytes // 1024} KB, flash {b.flash_bytes // 1024} KB"
            print(f"{b.id:<14} {b.name}  [target {b.target}, runs via {b.runner}]{mem}")
        return 0
    if args.cmd == "ops":
        import onnx
        from tinydeploy.ops import REGISTRY
        # Straight from the registry (internal ops such as Copy are not ONNX ops).
        names = sorted(op for op in REGISTRY if onnx.defs.has(op))
        print(f"{len(names)} ONNX operators: " + ", ".join(names))
        return 0
    if args.cmd == "quantize":
        from tinydeploy.frontend import quantize as q
        out = Path(args.output)
        if out.exists():
            raise TinydeployError(f"{printable(str(out))} exists; choose another -o (tinydeploy never overwrites "
                                  "your files)")
        r = q.quantize(args.model, args.calibration, out, args.activations, args.weights, args.per_channel,
                       args.method, args.format, quiet=args.json, max_weights_bytes=mwb)
        print(json.dumps(r)) if args.json else q.print_report(r)
        return 0
    if args.cmd == "build":
        model = args.model
        if args.quantize:
            model = _quantize_for_build(args, mwb)
        r = flow.build(model, args.board, args.outdir, args.force, shapes, command, emulate=args.emulate,
                       builder=args.builder, threads=args.threads, max_weights_bytes=mwb)
        if args.quantize:
            import shutil
            shutil.copyfile(model, r.outdir / Path(model).name)   # keep the model the C was made from
        _print_summary(r.summary)
        return 0
    if args.cmd == "run":
        res = flow.run(args.model, args.board, args.inputs, args.seed, shapes, args.outdir, args.force, command,
                       emulate=args.emulate, threads=args.threads, max_weights_bytes=mwb)
        if args.json:
            print(json.dumps(res))
        else:
            _print_run(res)
        return 0 if res["outputs_match"] else 1
    if args.cmd == "measure":
        res = flow.measure(args.model, args.board, args.port, args.inputs, args.seed, shapes, args.outdir,
                           args.force, command, quiet=args.json, runs=args.runs,
                           timeout=args.timeout, energy=args.energy, sysfs_root=args.sysfs_root,
                           emulate=args.emulate, max_weights_bytes=mwb)
        print(json.dumps(res)) if args.json else _print_run(res)
        return 0 if res["outputs_match"] else 1
    if args.cmd == "deploy":
        from tinydeploy.commands.deploy import deploy
        res = deploy(args.model, args.board, args.ssh, args.port, args.identity, args.remote_dir, args.runs,
                     args.inputs, args.seed, shapes, args.outdir, args.force, command, quiet=args.json,
                     ssh_options=args.ssh_option, threads=args.threads, max_weights_bytes=mwb)
        print(json.dumps(res)) if args.json else _print_run(res)
        return 0 if res["outputs_match"] else 1
    if args.cmd == "flash":
        from tinydeploy import firmware
        from tinydeploy.firmware import pio
        board = boards.get_board(args.board)
        if not board.is_mcu or board.runner != "serial":
            raise TinydeployError(f"{args.board} is not a board to flash (it runs via {board.runner})")
        folder = Path(args.builddir) if args.builddir else None
        if folder is None or not (folder / "platformio.ini").is_file():
            raise TinydeployError("give the folder `tinydeploy build --board " + args.board + "` wrote "
                                  "(it holds platformio.ini)")
        firmware.mcu_board(args.board)
        pio.pio_upload(folder, args.board, args.port)
        print(f"flashed {folder} to {args.board}")
        return 0
    if args.cmd == "inspect":
        from tinydeploy.commands.inspect_model import inspect_model
        print(inspect_model(args.model, shapes, mwb))
        return 0
    if args.cmd == "bench":
        from tinydeploy.commands.bench import bench, bench_layers
        if args.layers:
            bench_layers(args.models, args.board, args.seconds, args.json, args.emulate, args.threads, mwb)
        else:
            bench(args.models, args.board, args.seconds, args.json, args.threads, mwb)
        return 0
    if args.cmd == "tune":
        from tinydeploy.schedule.tuner import tune
        tune(args.models, args.board, args.db, args.jobs, args.resume, args.seconds, args.ssh, args.port,
             args.identity, max_weights_bytes=mwb)
        return 0
    raise TinydeployError(f"unknown command {args.cmd}")


def _quantize_for_build(args, max_weights_bytes=None) -> str:
    """`build --quantize`: quantise into a private temporary folder, print the accuracy report."""
    import tempfile
    from tinydeploy.frontend import quantize as q
    if not args.calibration:
        raise TinydeployError("--quantize needs --calibration DATA (.npz/.npy or a folder; see "
                              "models/make_calibration.py)")
    tmp = Path(tempfile.mkdtemp(prefix="tinydeploy-q-"))
    out = tmp / f"{Path(args.model).stem[:64]}_{args.quantize}.onnx"
    rep = q.quantize(args.model, args.calibration, out, args.quantize, "int8", True,
                     max_weights_bytes=max_weights_bytes)
    q.print_report(rep)
    return str(out)


def _print_run(res: dict) -> None:
    print(f"{printable(res['model'])} on {res['board']}: outputs {'match' if res['outputs_match'] else 'DIFFER'} "
          f"(max abs error {res['max_abs_error']:.3g}, max rel error {res['max_rel_error']:.3g}, "
          f"tolerance {res['tolerance']}{' ' + res['tolerance_unit'] if res.get('tolerance_unit') else ''})")
    lat, mem = res["latency"], res["memory"]
    if lat.get("instructions") is not None:
        print(f"latency {lat['instructions']:,} instructions per inference (exact, QEMU -icount)"
              + (f", >= {lat['median_ms']:.2f} ms at the board's clock" if lat.get("median_ms") else ""))
    elif lat.get("median_ms") is not None:
        print(f"latency {lat['median_ms']:.4f} ms median of {lat['runs']} runs")
    elif res.get("emulated"):
        print("latency not measured: emulated run (user-mode QEMU says nothing about speed)")
    print(f"memory: arena {mem['arena_bytes']:,} B (lower bound {mem['lower_bound_bytes']:,} B), "
          f"weights {mem['weights_bytes']:,} B")
    if "flash_bytes" in mem:
        print(f"firmware: flash {mem['flash_bytes']:,} of {mem['flash_limit_bytes']:,} B, RAM {mem['ram_bytes']:,} "
              f"of {mem['ram_limit_bytes']:,} B, stack used {mem['stack_used_bytes']:,} B")
    if res.get("energy"):
        e = res["energy"]
        rails = ", ".join(f"{printable(k)} {v:.3f} W" for k, v in e["mean_power_w"].items())
        print(f"energy: {e['joules_per_inference'] * 1000:.4g} mJ per inference ({e['inferences_per_joule']:.4g} "
              f"inferences/J); mean power {e['total_mean_power_w']:.3f} W ({rails}) over {e['window_s']:.2f} s, "
              f"{e['samples']} samples")
    if res.get("remote"):
        r = res["remote"]
        print(f"ran on {r['target']} ({r['machine']}) in {r['dir']}"
              + (" (removed afterwards)" if r["dir_removed"] else ""))


def _print_summary(s: dict) -> None:
    print(f"{printable(s['model'])} -> {printable(s['outdir'])} ({s['board']})")
    print(f"  layers {s['layers']}, MACs {s['macs']:,}, weights {s['weights_bytes']:,} B")
    print(f"  arena {s['arena_bytes']:,} B (lower bound {s['lower_bound_bytes']:,} B)")
    for n in s["notes"]:
        print(f"  note: {n}")
    fw = s.get("firmware")
    if fw:
        print(f"  firmware {s['elf']}: flash {fw['flash_used_bytes']:,} of {fw['flash_bytes']:,} B, "
              f"RAM {fw['ram_used_bytes']:,} of {fw['ram_bytes']:,} B (stack reserve {fw['stack_reserved_bytes']:,} B)")
    print(f"  files: {', '.join(s['files'])}")
