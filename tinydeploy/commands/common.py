"""What the verbs share: their common options, the context main() hands them, and the printed
forms of build summaries and run reports. Every verb is one module in tinydeploy/commands with
`add_parser(sub)` (its options) and `main(args, ctx) -> exit code`."""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

from tinydeploy.codegen.cfmt import printable  # model file names reach the terminal only through it


@dataclass
class Context:
    command: str                 # the command line, for the generated files' headers
    shapes: dict                 # --input-shape, parsed
    max_weights_bytes: int | None


def model_options(p: argparse.ArgumentParser, several: bool = False) -> None:
    if several:
        p.add_argument("model", nargs="+", help="ONNX model file (several: one program with all of them)")
    else:
        p.add_argument("model", help="ONNX model file")
    p.add_argument("--board", default="host", help="board id (see `tinydeploy boards`; default host)")
    p.add_argument("--input-shape", action="append", metavar="NAME=1x3x224x224",
                   help="pin an input's shape (repeatable); a symbolic batch dimension defaults to 1")
    p.add_argument("-o", "--outdir", help="output folder (default build/<model>-<board>)")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder tinydeploy did not create")
    max_weights(p)


def max_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-weights-bytes", metavar="SIZE",
                   help="the most bytes of constants a model may make (its weights and what constant folding "
                   "computes), e.g. 2G or 512M (default: $TINYDEPLOY_MAX_WEIGHTS_BYTES, else this machine's "
                   "available memory / the build's memory per weight byte)")


def optimize(p: argparse.ArgumentParser) -> None:
    p.add_argument("--optimize", choices=["balanced", "speed", "size"], default="balanced",
                   help="microcontroller boards: what the 8-bit kernels may spend flash on. size: weights at one "
                   "byte each; balanced (default): int16 weights only where they save the most instructions per "
                   "byte, within 1/8 of the weights; speed: int16 weights wherever they are faster (up to 384 KiB "
                   "more flash)")


def labgrid_place(p: argparse.ArgumentParser, what: str) -> None:
    """--lg-place NAME (a board of a labgrid farm, tinydeploy/runners/farm.py) and its coordinator."""
    p.add_argument("--lg-place", metavar="NAME", help=f"{what} the board of this labgrid place, acquired through "
                   "the coordinator and released at the end (its tag board=<id> is the board; hil/LAB.md)")
    p.add_argument("--lg-coordinator", metavar="HOST:PORT",
                   help="the labgrid coordinator (default $LG_COORDINATOR, else 127.0.0.1:20408)")
    p.add_argument("--lg-wait", type=float, default=300.0, metavar="S",
                   help="seconds to wait while someone else holds the place (default 300)")


def place_board(place, board: str | None) -> str:
    """The board id of an acquired labgrid place (its tag board=<id>); --board, when given, must agree."""
    from tinydeploy.errors import TinydeployError
    tag = place.board
    if not tag:
        raise TinydeployError(f"labgrid place {printable(place.name)!r} has no tag board=<id> (labgrid-client -p "
                              f"{printable(place.name)} set-tags board=<id>)")
    if board is not None and board != tag:
        raise TinydeployError(f"labgrid place {printable(place.name)!r} holds board {printable(tag)}, not {board}: "
                              "drop --board or name another place")
    return tag


def threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="Linux boards: run each layer on up to N OpenMP threads (default 1)")


def inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--inputs", help=".npz (arrays named like the model inputs) or .npy (single input)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")


def json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def json_safe(obj):
    """`obj` with every infinity and NaN made null: JSON has neither (Python's json would write
    Infinity and NaN, which other parsers refuse)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def print_json(obj) -> None:
    print(json.dumps(json_safe(obj), allow_nan=False))


def print_run(res: dict) -> None:
    print(f"{printable(res['model'])} on {res['board']}: outputs {'match' if res['outputs_match'] else 'DIFFER'} "
          f"(max abs error {res['max_abs_error']:.3g}, max rel error {res['max_rel_error']:.3g}, "
          f"tolerance {res['tolerance']}{' ' + res['tolerance_unit'] if res.get('tolerance_unit') else ''})")
    if res.get("exact_reference"):
        ex = res["exact_reference"]
        print("  8-bit: " + ("bit for bit with tinydeploy's exact reference" if ex["identical"] else
                             f"DIFFERS from tinydeploy's exact reference by {ex['max_lsb']} LSB (a tinydeploy bug: "
                             "please report it)"))
    if res.get("note"):
        print(f"  note: {printable(res['note'], 400)}")
    if res.get("onnxruntime_fast") and res["onnxruntime_fast"]["max_lsb"]:
        f = res["onnxruntime_fast"]
        print(f"  onnxruntime's fast session: {f['max_lsb']:g} LSB off ({printable(f['note'], 300)})")
    lat, mem = res["latency"], res["memory"]
    if lat.get("fma_lanes") is not None:
        print(f"latency {lat['instructions']:,} instructions per inference (exact, counted under user-mode QEMU; "
              f"{lat['simd_fp_instructions']:,} SIMD/FP, {lat['fma_lanes']:,} FMA lanes)")
    elif lat.get("instructions") is not None:
        print(f"latency {lat['instructions']:,} instructions per inference (exact, QEMU -icount)"
              + (f", >= {lat['median_ms']:.2f} ms at the board's clock" if lat.get("median_ms") else ""))
    elif lat.get("median_ms") is not None:
        print(f"latency {lat['median_ms']:.4f} ms median of {lat['runs']} runs")
    elif res.get("emulated"):
        print("latency not measured: emulated run (user-mode QEMU says nothing about speed)")
    print(f"memory: arena {mem['arena_bytes']:,} B (lower bound {mem['lower_bound_bytes']:,} B), "
          f"weights {mem['weights_bytes']:,} B")
    if "flash_bytes" in mem:
        print(f"firmware: flash {mem['flash_bytes']:,} of {mem['flash_limit_bytes']:,} B, RAM {mem['ram_bytes']:,} "
              f"of {mem['ram_limit_bytes']:,} B, stack used {mem['stack_used_bytes']:,} B")
    if res.get("energy"):
        e = res["energy"]
        rails = ", ".join(f"{printable(k)} {v:.3f} W" for k, v in e["mean_power_w"].items())
        print(f"energy: {e['joules_per_inference'] * 1000:.4g} mJ per inference ({e['inferences_per_joule']:.4g} "
              f"inferences/J); mean power {e['total_mean_power_w']:.3f} W ({rails}) over {e['window_s']:.2f} s, "
              f"{e['samples']} samples")
    if res.get("remote"):
        r = res["remote"]
        print(f"ran on {r['target']} ({r['machine']}) in {r['dir']}"
              + (" (removed afterwards)" if r["dir_removed"] else ""))


def print_summary(s: dict) -> None:
    print(f"{printable(s['model'])} -> {printable(s['outdir'])} ({s['board']})")
    print(f"  layers {s['layers']}, MACs {s['macs']:,}, weights {s['weights_bytes']:,} B")
    print(f"  arena {s['arena_bytes']:,} B (lower bound {s['lower_bound_bytes']:,} B)")
    if s.get("weights_layout"):
        print(f"  {s['weights_layout']}")
    for n in s["notes"]:
        print(f"  note: {n}")
    fw = s.get("firmware")
    if fw:
        print(f"  firmware {s['elf']}: flash {fw['flash_used_bytes']:,} of {fw['flash_bytes']:,} B, "
              f"RAM {fw['ram_used_bytes']:,} of {fw['ram_bytes']:,} B (stack reserve {fw['stack_reserved_bytes']:,} B)")
    print(f"  files: {', '.join(s['files'])}")


def print_library_summary(s: dict) -> None:
    """`build`'s summary of the library form: each model, the arenas (shared: with the saving),
    and for firmware flash and RAM per model and in all, against the board."""
    print(f"{len(s['models'])} model{'s' * (len(s['models']) > 1)} -> {printable(s['outdir'])} ({s['board']})")
    for m in s["models"]:
        states = "".join(f"; state {printable(i, 40)} <- {printable(o, 40)} ({'aliased, no copy' if a else 'copied'})"
                         for i, o, a in m["states"])
        scratch = f", scratch arena {m['scratch_bytes']:,} B" if m["scratch_bytes"] else ""
        print(f"  {m['name']} ({printable(m['model'])}): layers {m['layers']}, MACs {m['macs']:,}, weights "
              f"{m['weights_bytes']:,} B, arena {m['arena_bytes']:,} B{' (the caller' + chr(39) + 's)' if m['arena'] == 'caller' else ''} "
              f"(lower bound {m['lower_bound_bytes']:,} B){scratch}{states}")
        for n in m["notes"]:
            print(f"    note: {n}")
    if s["share_arena"]:
        print(f"  one arena shared by the models: {s['arena_bytes']:,} B instead of {s['separate_arena_bytes']:,} B "
              f"(saves {s['shared_saving_bytes']:,} B)")
    fw = s.get("firmware")
    if fw:
        print(f"  firmware {s['elf']}: flash {fw['flash_used_bytes']:,} of {fw['flash_bytes']:,} B, "
              f"RAM {fw['ram_used_bytes']:,} of {fw['ram_bytes']:,} B (stack reserve {fw['stack_reserved_bytes']:,} B)")
        for name, r in fw.get("regions", {}).items():
            print(f"    {name}: {r['used_bytes']:,} of {r['bytes']:,} B")
        if fw.get("models") and fw.get("regions"):
            print("    per model, the memories above included:")
        for name, m in fw.get("models", {}).items():
            print(f"    {name}: flash {m['flash_bytes']:,} B, RAM {m['ram_bytes']:,} B"
                  + (" (harness, port, C library, model table)" if name == "shared" else ""))
    print(f"  files: {', '.join(s['files'])}")
