"""`tinydeploy quantize`: onnxruntime's static quantiser behind a checked calibration reader,
with an accuracy report (tinydeploy/frontend/quantize.py)."""
from __future__ import annotations

from pathlib import Path

from tinydeploy.codegen.cfmt import printable
from tinydeploy.commands.common import Context, max_weights, print_json
from tinydeploy.errors import TinydeployError


def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="8-bit static quantisation by onnxruntime, with an accuracy report")
    p.add_argument("model")
    p.add_argument("--calibration", required=True, help=".npz/.npy file or a folder of them")
    p.add_argument("-o", "--output", required=True, help="quantised .onnx to write")
    p.add_argument("--activations", choices=["uint8", "int8"], default="uint8")
    p.add_argument("--weights", choices=["uint8", "int8"], default="int8")
    p.add_argument("--per-channel", action="store_true")
    p.add_argument("--reduce-range", action="store_true",
                   help="7-bit weights (onnxruntime's reduce_range): exact vpmaddubsw kernels on x86 without VNNI")
    p.add_argument("--method", choices=["minmax", "entropy", "percentile"], default="minmax")
    p.add_argument("--format", choices=["qdq", "qoperator"], default="qdq")
    p.add_argument("--json", action="store_true")
    max_weights(p)


def main(args, ctx: Context) -> int:
    from tinydeploy.frontend import quantize as q
    out = Path(args.output)
    if out.exists():
        raise TinydeployError(f"{printable(str(out))} exists; choose another -o (tinydeploy never overwrites "
                              "your files)")
    r = q.quantize(args.model, args.calibration, out, args.activations, args.weights, args.per_channel,
                   args.method, args.format, quiet=args.json, max_weights_bytes=ctx.max_weights_bytes,
                   reduce_range=args.reduce_range)
    print_json(r) if args.json else q.print_report(r)
    return 0
