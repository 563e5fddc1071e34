"""`tinydeploy run`: build (reusing an up-to-date build), run on the inputs, hold the outputs to
the references (tinydeploy.reference.check_outputs), time. Exit 0 match, 1 mismatch."""
from __future__ import annotations

from tinydeploy import flow
from tinydeploy.commands.common import Context, inputs, json_option, model_options, optimize, print_json, print_run, threads


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="build, run on inputs, compare with onnxruntime")
    model_options(p)
    threads(p)
    optimize(p)
    inputs(p)
    json_option(p)
    p.add_argument("--emulate", action="store_true", help="run a board's build here under QEMU")


def main(args, ctx: Context) -> int:
    res = flow.run(args.model, args.board, args.inputs, args.seed, ctx.shapes, args.outdir, args.force, ctx.command,
                   emulate=args.emulate, threads=args.threads, max_weights_bytes=ctx.max_weights_bytes,
                   optimize=args.optimize)
    print_json(res) if args.json else print_run(res)
    return 0 if res["outputs_match"] else 1
