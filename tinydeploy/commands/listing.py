"""`tinydeploy boards` and `tinydeploy ops`: what tinydeploy knows, from its data and registry."""
from __future__ import annotations

from tinydeploy.commands.common import Context


def add_parser(sub) -> None:
    sub.add_parser("boards", help="list the known boards")
    sub.add_parser("ops", help="list the supported ONNX operators")


def main(args, ctx: Context) -> int:
    if args.cmd == "boards":
        from tinydeploy.targets.boards import load_all
        for b in load_all().values():
            mem = f"  RAM {b.ram_bytes // 1024} KB, flash {b.flash_bytes // 1024} KB" if b.ram_bytes else ""
            regions = "".join(f", {r['name']} {r['bytes'] // 1024} KB {r['kind']}" for r in b.memory_regions)
            print(f"{b.id:<16} {b.name}  [target {b.target}, runs via {b.runner}]{mem}{regions}")
        return 0
    import onnx
    from tinydeploy.ops import REGISTRY
    names = sorted(op for op in REGISTRY if onnx.defs.has(op))   # internal ops such as Copy are not ONNX ops
    print(f"{len(names)} ONNX operators: " + ", ".join(names))
    return 0
