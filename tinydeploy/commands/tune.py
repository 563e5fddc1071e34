"""`tinydeploy tune`: measure kernel candidates per layer shape and keep the fastest in the
target's tuning database (tinydeploy/schedule/tuner.py)."""
from __future__ import annotations

import argparse

from tinydeploy.commands.common import Context, labgrid_place, max_weights, place_board


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure kernel candidates per layer shape, keep the fastest in the "
                       "target's tuning database")
    p.add_argument("models", nargs="+")
    p.add_argument("--board", help="board id (default host; with --lg-place the place's board)")
    p.add_argument("--db", help="tuning database file (default tinydeploy/schedule/tuning/<target>-<isa>.json)")
    p.add_argument("--jobs", type=int, help="parallel candidate builds (default: CPU count)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="skip layer shapes already in the database (default; --no-resume measures them again)")
    p.add_argument("--seconds", type=float, default=0.2, help="time budget per candidate timing (default 0.2 s)")
    p.add_argument("--ssh", metavar="USER@HOST", help="measure on this Linux board over ssh")
    p.add_argument("--port", type=int, help="ssh port")
    p.add_argument("--identity", help="ssh private key")
    p.add_argument("--emulate", action="store_true",
                   help="a Linux board (rpi4, jetson-*) with no board at hand: rank the candidates by their exact "
                        "instructions per inference under user-mode QEMU (not by time)")
    labgrid_place(p, "instead of --ssh: measure on")
    max_weights(p)


def main(args, ctx: Context) -> int:
    from tinydeploy.schedule.tuner import tune
    if not args.lg_place:
        tune(args.models, args.board or "host", args.db, args.jobs, args.resume, args.seconds, args.ssh, args.port,
             args.identity, max_weights_bytes=ctx.max_weights_bytes, emulate=args.emulate)
        return 0
    from tinydeploy import flow
    from tinydeploy.errors import TinydeployError
    from tinydeploy.runners import farm
    from tinydeploy.targets import boards
    if args.ssh or args.emulate:
        raise TinydeployError(f"--lg-place and {'--ssh' if args.ssh else '--emulate'} both say where to measure: "
                              "give one")
    with farm.hold(args.lg_place, None, args.lg_coordinator, args.lg_wait, say=flow.progress) as place:
        board = place_board(place, args.board)
        # a Linux board through the place's NetworkService (ssh); anything else tune() refuses itself
        target, port = place.ssh_target if boards.get_board(board).is_linux else (None, None)
        tune(args.models, board, args.db, args.jobs, args.resume, args.seconds, target, args.port or port,
             args.identity, max_weights_bytes=ctx.max_weights_bytes)
    return 0
