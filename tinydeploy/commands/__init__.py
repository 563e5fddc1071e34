"""The verbs of the command line, one module each: `add_parser(sub)` declares its options,
`main(args, ctx)` does it (through tinydeploy.flow and the layers below) and prints. cli.py only
assembles the parser from this list and turns errors into one line and an exit code."""
from __future__ import annotations

import importlib

# verb modules in the order `tinydeploy --help` lists them
VERBS = ["build", "run", "validate", "report", "inspect_model", "quantize", "measure", "deploy", "flash", "doctor",
         "listing", "bench", "tune"]


def modules():
    return [importlib.import_module(f"tinydeploy.commands.{v}") for v in VERBS]
