"""`tinydeploy validate`: the capture build of the model runs on the board (here, under QEMU, on
a serial port or over ssh), hands over every layer's outputs, and each is held against the
reference of the same tensor (tinydeploy.validate): a per-layer table with the first layer
beyond the tolerance and why. Exit 0 when the outputs match (as `run` judges them), 1 when not."""
from __future__ import annotations

import json
from pathlib import Path

from tinydeploy import flow
from tinydeploy.codegen.cfmt import printable
from tinydeploy.commands.common import Context, json_option, model_options


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="every layer's outputs on the target against the reference: which layer "
                       "differs, by how much and why")
    model_options(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--emulate", action="store_true", help="run a board's build here under QEMU")
    where.add_argument("--port", help="microcontroller already flashed with the validate build: its serial port "
                       "or a pyserial URL")
    where.add_argument("--ssh", metavar="USER@HOST[:PORT]", help="a Linux board over ssh (as `deploy`)")
    p.add_argument("--identity", metavar="KEY", help="with --ssh: private key to log in with")
    p.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                   help="with --ssh: extra ssh -o option (repeatable)")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--inputs", help=".npz (arrays named like the model inputs) or .npy (single input)")
    data.add_argument("--dataset", metavar="DIR", help="folder of .npz files (inputs by name, one sample or N, "
                      "optional `label`/`labels`): metrics over the set, top-1 agreement and accuracy")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--reference", default="oracle", choices=["oracle", "onnxruntime"],
                   help="what each layer is held to: oracle (default: onnxruntime for FP32; for 8-bit the graph "
                   "node by node and tinydeploy's exact reference) or onnxruntime (its default session; for 8-bit "
                   "models its fused kernels, which differ by CPU)")
    p.add_argument("--profile", action="store_true", help="each layer's cost on the target: instructions under "
                   "QEMU, DWT cycles on a Cortex-M board, microseconds on Linux boards")
    p.add_argument("--report", metavar="HTML", help="also write the report (`tinydeploy report`) with these results")
    p.add_argument("--timeout", type=float, help="seconds to wait for each answer from a board")
    json_option(p)


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def print_table(res: dict) -> None:
    first = res["first_divergent_layer"]
    print(f"{printable(res['model'])} on {res['board']} ({res['where']}), each layer against the "
          f"{'oracle' if res['reference'] == 'oracle' else 'onnxruntime default session'}"
          + (f", {res['samples']} samples" if res["samples"] > 1 else ""))
    prof = res.get("profile")
    head = (f"   {'step':>4}  {'op':<18} {'tensor (ONNX)':<32} {'shape':<16} {'max|err|':>9} {'LSB':>4} "
            f"{'ident%':>7} {'cosine':>9} {'rel L2':>9} {'SNR dB':>7}")
    print(head + (f" {prof['unit']:>12}" if prof else ""))
    for r in res["layers"]:
        mark = ">> " if first and r["step"] == first["step"] and r["tensor"] == first["tensor"] else "   "
        name = r["name"] or r["tensor"]
        # converters from TensorFlow join the fused ops' names with ';': the first is the layer's own
        name = printable(name.split(";")[0] or name, 200)
        name = name if len(name) <= 32 else "..." + name[-29:]
        shape = "x".join(map(str, r["shape"]))
        if r.get("within_tolerance") is None and "max_abs_error" not in r:
            line = f"{mark}{r['step']:>4}  {printable(r['op'], 18):<18} {name:<32} {shape:<16} {'(not compared)':>9}"
        else:
            snr = "inf" if r.get("snr_db") is None and r.get("max_abs_error") == 0 else _num(r.get("snr_db"), ".1f")
            ident = _num(None if r.get("identical_fraction") is None else 100 * r["identical_fraction"], ".2f")
            line = (f"{mark}{r['step']:>4}  {printable(r['op'], 18):<18} {name:<32} {shape:<16} "
                    f"{_num(r.get('max_abs_error'), '.3g'):>9} {_num(r.get('max_lsb'), 'd'):>4} {ident:>7} "
                    f"{_num(r.get('cosine'), '.6f'):>9} {_num(r.get('rel_l2'), '.2e'):>9} {snr:>7}")
        if prof:
            line += f" {_num(r.get('cost'), ',.0f'):>12}"
        print(line)
    out = res["outputs"]
    print(f"outputs {'match' if res['outputs_match'] else 'DIFFER'} (max abs error {out['max_abs_error']:.3g}"
          f"{' LSB' if out.get('tolerance_unit') == 'LSB' else ''}, tolerance {out['tolerance']})")
    if first:
        print(f">> first layer beyond the tolerance: step {first['step']} ({printable(first['op'], 40)}, "
              f"{printable(first['name'] or first['tensor'], 100)!r})"
              + (f" in sample {printable(first['sample'], 80)}" if first.get("sample") else ""))
        if first.get("why"):
            print(f"   why: {printable(first['why'], 400)}")
    else:
        print("every layer is within the tolerance (8-bit: 1 LSB; float: relative 1e-4, norm-wise)")
    if prof:
        print(f"per-layer cost: {prof['what']}; total {prof['total']:,.0f}")
    ds = res.get("dataset")
    if ds:
        acc = ds["accuracy"]
        print(f"data set: {ds['samples']} samples, outputs match in {ds['outputs_match']}; first output: L2r "
              f"{_num(ds['l2r'], '.3g')}, MAE {_num(ds['mae'], '.3g')}, RMSE {_num(ds['rmse'], '.3g')}, cosine "
              f"{_num(ds['cosine'], '.6f')}; top-1 agreement {100 * ds['top1_agreement']:.1f}%"
              + (f"; accuracy {100 * acc['target']:.1f}% (reference {100 * acc['reference']:.1f}%, "
                 f"{acc['labelled']} labelled)" if acc else ""))


def main(args, ctx: Context) -> int:
    if args.report:         # before the work: a path that cannot take the report is refused at once
        from tinydeploy import report
        report.check_path(Path(args.report), args.force)
    res = flow.validate(args.model, args.board, args.inputs, args.dataset, args.seed, ctx.shapes, args.outdir,
                        args.force, ctx.command, quiet=args.json, emulate=args.emulate, port=args.port,
                        ssh=args.ssh, identity=args.identity, ssh_options=args.ssh_option, profile=args.profile,
                        reference_kind=args.reference,
                        max_weights_bytes=ctx.max_weights_bytes, timeout=args.timeout)
    summary = res.pop("summary")
    if args.report:
        from tinydeploy import report
        path = report.write(Path(args.report), flow.report_facts(summary, args.board, capture_build=True),
                            validation=res, force=args.force)
        if not args.json:
            print(f"report: {printable(str(path))}")
    print(json.dumps(res)) if args.json else print_table(res)
    return 0 if res["outputs_match"] else 1
