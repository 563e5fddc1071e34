"""Command line: `tinydeploy build|run|inspect|boards|bench|doctor|...`. Assembles the parser from
the verbs in tinydeploy/commands (one module each) and runs the chosen one. Every expected failure
is a TinydeployError: one line on stderr, exit code 2; anything else is an internal error, one
line and exit code 3 (TINYDEPLOY_DEBUG=1 shows the traceback)."""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from tinydeploy import __version__
from tinydeploy.codegen.cfmt import printable  # model file names reach the terminal only through it
from tinydeploy.errors import TinydeployError


class _Version(argparse.Action):
    """--version: tinydeploy's version, the reference stack's and the CPU features (for bug reports)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from tinydeploy import doctor
        print("\n".join(doctor.format_version(doctor.summary())))
        parser.exit()


def parser() -> argparse.ArgumentParser:
    from tinydeploy.commands import modules
    ap = argparse.ArgumentParser(prog="tinydeploy", description="ONNX models to static-memory C for MCUs, SBCs and the host.")
    ap.add_argument("--version", action=_Version, help=f"tinydeploy {__version__}: with the versions of onnx, "
                    "onnxruntime, numpy, ... and the CPU features that decide 8-bit results; then exit")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for m in modules():
        m.add_parser(sub)
        for name in sub.choices:
            sub.choices[name].set_defaults(_verb=sub.choices[name].get_default("_verb") or m)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    command = "tinydeploy " + " ".join(shlex.quote(a) for a in argv)
    try:
        return _dispatch(args, command)
    except TinydeployError as e:
        print(f"tinydeploy: error: {printable(str(e), 2000)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tinydeploy: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # the output went into a pipe that closed early (| head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # a bug in tinydeploy, not the user's input: still one line
        if os.environ.get("TINYDEPLOY_DEBUG"):
            raise
        print(f"tinydeploy: internal error: {type(e).__name__}: {printable(str(e), 200)} "
              "(set TINYDEPLOY_DEBUG=1 for the traceback and please report it)", file=sys.stderr)
        return 3


def _dispatch(args, command: str) -> int:
    from tinydeploy.commands.common import Context
    ctx = Context(command, {}, None)
    if args.cmd != "doctor":   # doctor first: it also reports a broken onnx or numpy install
        from tinydeploy import limits
        from tinydeploy.frontend import importer
        mwb = getattr(args, "max_weights_bytes", None)
        ctx = Context(command, importer.parse_shape_overrides(getattr(args, "input_shape", None)),
                      limits.parse_size(mwb) if mwb is not None else None)   # bytes, passed down explicitly
    return args._verb.main(args, ctx)
