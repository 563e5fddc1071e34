"""`tinydeploy tune`: measure kernel candidates per layer shape and keep the fastest in the
target's tuning database (tinydeploy/schedule/tuner.py)."""
from __future__ import annotations

import argparse

from tinydeploy.commands.common import Context, max_weights


def add_parser(sub) -> None:
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
    max_weights(p)


def main(args, ctx: Context) -> int:
    from tinydeploy.schedule.tuner import tune
    tune(args.models, args.board, args.db, args.jobs, args.resume, args.seconds, args.ssh, args.port,
         args.identity, max_weights_bytes=ctx.max_weights_bytes)
    return 0
