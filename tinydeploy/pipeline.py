"""The whole compiler in one reading: import -> check -> passes -> lower -> plan -> codegen."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tinydeploy import ir
from tinydeploy.codegen import project
from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.importer import import_model, sha256_file
from tinydeploy.ops import REGISTRY, Kernel, unsupported_nodes
from tinydeploy.passes import run_passes
from tinydeploy.quant import quantize_qdq
from tinydeploy.select import select_kernels
from tinydeploy.planner import Plan, plan_memory
from tinydeploy.targets import Target

RUNTIME_DTYPES = {np.dtype(np.float32), np.dtype(np.int8), np.dtype(np.uint8)}


@dataclass
class Compiled:
    graph: ir.Graph
    kernels: list[Kernel | None]
    plan: Plan
    files: dict[str, str]
    macs: int
    weights_bytes: int
    sha256: str
    notes: list[str] = field(default_factory=list)


def check_supported(g: ir.Graph) -> None:
    """Raise one error that lists every unsupported operator, with counts and node names."""
    problems: "OrderedDict[str, list[str]]" = OrderedDict()
    for n, why in unsupported_nodes(g):
        key = printable(n.op) if why == "no kernel" else f"{printable(n.op)} ({why})"
        problems.setdefault(key, []).append(printable(n.name, 40))
    for name in g.inputs + g.outputs:
        t = g.t(name)
        if np.dtype(t.dtype) not in RUNTIME_DTYPES:
            problems.setdefault(f"graph input/output of type {np.dtype(t.dtype).name}", []).append(printable(name, 40))
    if problems:
        parts = []
        for key, names in problems.items():
            shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")
            parts.append(f"{key} x{len(names)} [{shown}]")
        raise TinydeployError("unsupported operators: " + "; ".join(parts))


def lower(g: ir.Graph) -> list[Kernel | None]:
    return [REGISTRY[n.op].emit(n, g) for n in g.nodes]


def compile_model(path, target: Target, input_shapes=None, command: str = "", board: str = "host",
                  threads: int = 1) -> Compiled:
    g, _ = import_model(path, input_shapes)
    # QDQ models: weights are DequantizeLinear outputs until this pass (also first in PASSES,
    # where it is then a no-op) turns them into integer operators or float constants.
    quantize_qdq(g)
    check_supported(g)
    run_passes(g)
    check_supported(g)
    macs = sum(REGISTRY[n.op].macs(n, g) for n in g.nodes)
    kernels = select_kernels(g, lower(g), target, threads)   # fast conv/dense algorithms per layer
    plan = plan_memory(g, kernels, target.alignment)
    sha = sha256_file(Path(path))
    info = project.ModelInfo(Path(path).name, sha, command, board)
    files = project.generate(g, kernels, plan, info, target.isas, target.alignment, macs)
    weights = {a for k in kernels if k for a in k.args if g.t(a).is_const}
    return Compiled(g, kernels, plan, files, macs, sum(g.t(w).nbytes for w in weights), sha, g.notes)
