"""`tinydeploy report`: one self-contained HTML file about the model compiled for a board (the
per-layer table, the arena over the schedule, flash and RAM against the board's limits, per-layer
cost with --profile); tinydeploy.report draws it, flow.report gathers what it needs."""
from __future__ import annotations

from tinydeploy import flow
from tinydeploy.codegen.cfmt import printable
from tinydeploy.commands.common import Context, max_weights


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="one HTML file: layers, kernels, the arena over the schedule, memory against "
                       "the board's limits, per-layer cost")
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--board", default="host", help="board id (see `tinydeploy boards`; default host)")
    p.add_argument("-o", "--output", metavar="HTML", help="the report (default build/<model>-<board>-report.html)")
    p.add_argument("--outdir", help="microcontrollers: the firmware build folder (default build/<model>-<board>)")
    p.add_argument("--input-shape", action="append", metavar="NAME=1x3x224x224",
                   help="pin an input's shape (repeatable); a symbolic batch dimension defaults to 1")
    p.add_argument("--profile", action="store_true", help="measure each layer's cost on the target (instructions "
                   "under QEMU for microcontrollers; microseconds on Linux boards) and draw it")
    p.add_argument("--emulate", action="store_true", help="with --profile: run a Linux board's build under qemu-aarch64")
    p.add_argument("--force", action="store_true", help="replace a file that is not a tinydeploy report, or write "
                   "into a folder tinydeploy did not create")
    max_weights(p)


def main(args, ctx: Context) -> int:
    path = flow.report(args.model, args.board, args.output, ctx.shapes, args.outdir, args.force, ctx.command,
                       profile=args.profile, emulate=args.emulate, max_weights_bytes=ctx.max_weights_bytes)
    print(f"report: {printable(str(path))}")
    return 0
