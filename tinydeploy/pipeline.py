"""The whole compiler in one reading: import -> check -> passes -> lower -> plan -> codegen."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tinydeploy import ir, limits
from tinydeploy.codegen import project
from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.frontend.importer import import_model, sha256_file
from tinydeploy.ops import REGISTRY, Kernel, unsupported_nodes
from tinydeploy.ops.verify import verify_graph
from tinydeploy.passes import LOWER_8BIT, run_passes
from tinydeploy.schedule import select_kernels
from tinydeploy.planner import Plan, plan_memory
from tinydeploy.targets import Target

RUNTIME_DTYPES = {np.dtype(np.float32), np.dtype(np.int8), np.dtype(np.uint8)}


@dataclass
class Compiled:
    """The contract between the compiler and everything downstream (firmware, builds, runs,
    reports): the lowered graph, one kernel per node, the memory plan, the generated C, and the
    facts about them, so nothing downstream parses generated files back."""
    graph: ir.Graph
    kernels: list[Kernel | None]
    plan: Plan
    files: dict[str, str]
    macs: int
    weights_bytes: int
    sha256: str
    notes: list[str] = field(default_factory=list)
    model: str = "model"          # the model's file name (untrusted: print through cfmt.printable)

    @property
    def arena_bytes(self) -> int:
        return self.plan.arena_bytes

    @property
    def input_bytes(self) -> int:
        return sum(self.graph.t(n).nbytes for n in self.graph.inputs)

    @property
    def inputs_int8(self) -> bool:
        return all(np.dtype(self.graph.t(n).dtype) == np.int8 for n in self.graph.inputs)


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


def prepared_graph(path, input_shapes=None, max_weights_bytes: "int | limits.Budget | None" = None,
                   bytes_max: int = 2**63 - 1) -> ir.Graph:
    """import -> the verifier (every problem at once: ops/verify.py) -> 8-bit islands to integer
    operators -> support check (every unsupported operator at once) -> the other passes: the graph
    kernel lowering starts from. `bytes_max`: the target's largest tensor (Target.bytes_max)."""
    g, _ = import_model(path, input_shapes, max_weights_bytes)
    verify_graph(g, bytes_max)
    run_passes(g, [LOWER_8BIT], done=())
    check_supported(g)
    run_passes(g)
    return g


def compile_model(path, target: Target, input_shapes=None, command: str = "", board: str = "host",
                  threads: int = 1, max_weights_bytes: "int | limits.Budget | None" = None) -> Compiled:
    """`max_weights_bytes`: the weights budget (tinydeploy.limits; None: sized against this
    machine's memory). The import holds the model to it, and so does the C written here."""
    budget = limits.budget(max_weights_bytes)
    g = prepared_graph(path, input_shapes, budget, target.bytes_max)
    macs = sum(REGISTRY[n.op].macs(n, g) for n in g.nodes)
    kernels = select_kernels(g, lower(g), target, threads)   # fast conv/dense algorithms per layer
    plan = plan_memory(g, kernels, target.alignment)
    weights = {a: k.tensor(a, g) for k in kernels if k for a in k.args if k.tensor(a, g).is_const}
    weights_bytes = sum(t.nbytes for t in weights.values())
    if weights_bytes > budget.bytes:   # passes and kernel layouts can add to what the import held
        largest = max(weights, key=lambda w: (weights[w].nbytes, w))
        raise limits.refuse(f"the C would hold {len(weights)} weight tensor{'s' * (len(weights) != 1)}, "
                            f"{weights_bytes} bytes (largest {printable(largest, 60)!r}, "
                            f"{limits.human(weights[largest].nbytes)})", weights_bytes, budget)
    sha = sha256_file(Path(path))
    info = project.ModelInfo(Path(path).name, sha, command, board)
    files = project.generate(g, kernels, plan, info, target.isas, target.alignment, macs)
    return Compiled(g, kernels, plan, files, macs, weights_bytes, sha, g.notes, Path(path).name)
