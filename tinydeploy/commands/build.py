"""`tinydeploy build`: generate the C project for a board and compile it (firmware for
microcontrollers); `--quantize` first quantises with onnxruntime's quantiser."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tinydeploy import flow
from tinydeploy.commands.common import Context, model_options, optimize, print_summary, threads
from tinydeploy.errors import TinydeployError


def add_parser(sub) -> None:
    p = sub.add_parser("build", help="generate the C project and compile it")
    model_options(p)
    p.add_argument("--builder", choices=["pio", "make"], help="microcontroller boards: PlatformIO (default for "
                   "real boards, offline) or the generated Makefile")
    p.add_argument("--emulate", action="store_true", help="microcontroller boards: build for the QEMU machine "
                   "that stands in for the board, with the board's memory limits")
    p.add_argument("--quantize", choices=["uint8", "int8"], help="quantise first (onnxruntime, QDQ, per channel)")
    p.add_argument("--calibration", help="calibration data for --quantize (.npz/.npy or a folder)")
    threads(p)
    optimize(p)


def main(args, ctx: Context) -> int:
    if not args.quantize:
        r = flow.build(args.model, args.board, args.outdir, args.force, ctx.shapes, ctx.command,
                       emulate=args.emulate, builder=args.builder, threads=args.threads,
                       max_weights_bytes=ctx.max_weights_bytes, optimize=args.optimize)
        print_summary(r.summary)
        return 0
    from tinydeploy.frontend import quantize as q
    if not args.calibration:
        raise TinydeployError("--quantize needs --calibration DATA (.npz/.npy or a folder; see "
                              "models/make_calibration.py)")
    with tempfile.TemporaryDirectory(prefix="tinydeploy-q-") as tmp:   # removed also on errors
        model = Path(tmp) / f"{Path(args.model).stem[:64]}_{args.quantize}.onnx"
        rep = q.quantize(args.model, args.calibration, model, args.quantize, "int8", True,
                         max_weights_bytes=ctx.max_weights_bytes)
        q.print_report(rep)
        r = flow.build(model, args.board, args.outdir, args.force, ctx.shapes, ctx.command, emulate=args.emulate,
                       builder=args.builder, threads=args.threads, max_weights_bytes=ctx.max_weights_bytes,
                       optimize=args.optimize)
        shutil.copyfile(model, r.outdir / model.name)   # keep the model the C was made from
    print_summary(r.summary)
    return 0
