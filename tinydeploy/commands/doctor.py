"""`tinydeploy doctor`: the versions and CPU features a bug report needs (tinydeploy/doctor.py)."""
from __future__ import annotations

from tinydeploy.commands.common import Context, print_json


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="versions of tinydeploy, Python and the reference stack, the CPU and its "
                       "features, the external tools, and whether the installed packages match constraints.txt")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def main(args, ctx: Context) -> int:
    from tinydeploy import doctor
    r = doctor.report()
    print_json(r) if args.json else print("\n".join(doctor.format_report(r)))
    return 0
