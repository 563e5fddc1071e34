"""`tinydeploy build`: generate the C project for a board and compile it (firmware for
microcontrollers); `--quantize` first quantises with onnxruntime's quantiser. Several models, or
any of the library options (`--name`, `--arena`, the sections, `--state`, `--share-arena`,
`--package`), build the library form: each model's symbols, macros and files named after it, a
context per instance, and one program (harness binary or firmware) holding all of them."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tinydeploy import flow
from tinydeploy.commands.common import Context, model_options, optimize, print_library_summary, print_summary, threads
from tinydeploy.errors import TinydeployError


def add_parser(sub) -> None:
    p = sub.add_parser("build", help="generate the C project and compile it")
    model_options(p, several=True)
    p.add_argument("--builder", choices=["pio", "make"], help="microcontroller boards: PlatformIO (default for "
                   "real boards, offline) or the generated Makefile")
    p.add_argument("--emulate", action="store_true", help="microcontroller boards: build for the QEMU machine "
                   "that stands in for the board, with the board's memory limits")
    p.add_argument("--quantize", choices=["uint8", "int8"], help="quantise first (onnxruntime, QDQ, per channel)")
    p.add_argument("--calibration", help="calibration data for --quantize (.npz/.npy or a folder)")
    threads(p)
    optimize(p)
    g = p.add_argument_group("library form (one model or several in one program)")
    g.add_argument("--name", action="append", metavar="NAME", help="the prefix of the model's symbols, macros and "
                   "files (kws: kws_ctx_run(), KWS_ARENA_BYTES, kws_model.h); one per model, in order (default: "
                   "from the file names)")
    g.add_argument("--arena", choices=["static", "caller"], help="static (default): the model owns a static arena; "
                   "caller: every context brings its arena (its size and alignment are checked)")
    g.add_argument("--arena-section", metavar="SECTION", help="put the static arena in this linker section (e.g. "
                   ".dtcm; firmware: into the board's memory region of that name, else the main RAM)")
    g.add_argument("--weights-section", metavar="SECTION", help="put the weights in this linker section (e.g. "
                   ".qspi.weights: into the board's region QSPI, else the main flash)")
    g.add_argument("--scratch-section", metavar="SECTION", help="give the kernels' scratch a static arena of its "
                   "own in this section (e.g. a small fast RAM), apart from the activations")
    g.add_argument("--state", action="append", metavar="IN=OUT", help="a state the model carries from one run to "
                   "the next (an input and the output that feeds it), kept in the context; repeatable; "
                   "'auto': every input X_in with an output X_out")
    g.add_argument("--share-arena", action="store_true", help="several models: one arena for all (they never "
                   "run at the same time); the build reports the saving")
    g.add_argument("--package", action="store_true", help="also write each model as a PlatformIO library, a "
                   "CMake package, an Arduino library and a Zephyr module in package/<name>/")


def _states(values):
    if not values:
        return None
    if values == ["auto"]:
        return "auto"
    pairs = []
    for v in values:
        if v == "auto" or "=" not in v:
            raise TinydeployError(f"--state {v!r}: give IN=OUT (an input and output of the model), or --state auto alone")
        i, o = v.split("=", 1)
        pairs.append((i, o))
    return pairs


def _library(args) -> flow.Library | None:
    """The library options, or None when the build is the classic single-model one."""
    if not (len(args.model) > 1 or args.name or args.arena or args.arena_section or args.weights_section
            or args.scratch_section or args.state or args.share_arena or args.package):
        return None
    if args.threads != 1:
        raise TinydeployError("--threads is for the classic single-model build; leave it out with the library options")
    return flow.Library(args.name, args.arena or "static", args.arena_section, args.weights_section,
                        args.scratch_section, _states(args.state), args.share_arena, args.package)


def main(args, ctx: Context) -> int:
    lib = _library(args)
    if lib is not None:
        if args.quantize:
            raise TinydeployError("--quantize builds one classic model; quantise first (tinydeploy quantize) and build "
                                  "the quantised models with the library options")
        r = flow.build_library(args.model, args.board, args.outdir, lib, args.force, ctx.shapes, ctx.command,
                               emulate=args.emulate, builder=args.builder, max_weights_bytes=ctx.max_weights_bytes)
        print_library_summary(r.summary)
        return 0
    model = args.model[0]
    if not args.quantize:
        r = flow.build(model, args.board, args.outdir, args.force, ctx.shapes, ctx.command,
                       emulate=args.emulate, builder=args.builder, threads=args.threads,
                       max_weights_bytes=ctx.max_weights_bytes, optimize=args.optimize)
        print_summary(r.summary)
        return 0
    from tinydeploy.frontend import quantize as q
    if not args.calibration:
        raise TinydeployError("--quantize needs --calibration DATA (.npz/.npy or a folder; see "
                              "models/make_calibration.py)")
    with tempfile.TemporaryDirectory(prefix="tinydeploy-q-") as tmp:   # removed also on errors
        qmodel = Path(tmp) / f"{Path(model).stem[:64]}_{args.quantize}.onnx"
        rep = q.quantize(model, args.calibration, qmodel, args.quantize, "int8", True,
                         max_weights_bytes=ctx.max_weights_bytes)
        q.print_report(rep)
        r = flow.build(qmodel, args.board, args.outdir, args.force, ctx.shapes, ctx.command, emulate=args.emulate,
                       builder=args.builder, threads=args.threads, max_weights_bytes=ctx.max_weights_bytes,
                       optimize=args.optimize)
        shutil.copyfile(qmodel, r.outdir / qmodel.name)   # keep the model the C was made from
    print_summary(r.summary)
    return 0
