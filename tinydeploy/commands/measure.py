"""`tinydeploy measure`: a microcontroller already flashed with the model, over serial; Linux
boards on this machine, with --energy from a Jetson's power rails."""
from __future__ import annotations

from tinydeploy import flow
from tinydeploy.commands.common import Context, json_option, model_options, print_json, print_run


def add_parser(sub) -> None:
    p = sub.add_parser("measure", help="run against a board already flashed with the model, over serial; "
                       "Linux boards: on this machine, with --energy from a Jetson's power rails")
    model_options(p)
    p.add_argument("--port", help="microcontroller boards (required): serial port or pyserial URL "
                   "(socket://127.0.0.1:N for QEMU)")
    p.add_argument("--inputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, help="inferences to time (default: 1 on microcontrollers, about 1 s of "
                   "runs on Linux boards)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each answer (default 60)")
    p.add_argument("--energy", action="store_true", help="Jetson boards: sample the power rails of the board "
                   "manifest at 10 Hz during the timed runs; joules per inference")
    p.add_argument("--sysfs-root", default="/", help="where sysfs is mounted for --energy (default /)")
    p.add_argument("--emulate", action="store_true", help="Linux boards: run the board's binary here under QEMU")
    json_option(p)


def main(args, ctx: Context) -> int:
    res = flow.measure(args.model, args.board, args.port, args.inputs, args.seed, ctx.shapes, args.outdir,
                       args.force, ctx.command, quiet=args.json, runs=args.runs, timeout=args.timeout,
                       energy=args.energy, sysfs_root=args.sysfs_root, emulate=args.emulate,
                       max_weights_bytes=ctx.max_weights_bytes)
    print_json(res) if args.json else print_run(res)
    return 0 if res["outputs_match"] else 1
