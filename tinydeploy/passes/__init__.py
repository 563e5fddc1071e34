"""Graph rewrites, one per file, run in a declared order: each pass states what it needs (facts an
earlier pass established) and what it ensures, and `run_passes` checks that the order keeps every
promise. Together they take an imported ONNX graph to the form the kernels expect.

The pipeline (tinydeploy/pipeline.py) runs LOWER_8BIT first (8-bit islands become integer
operators: tinydeploy/quant/qdq.py), then the support check, then PASSES.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tinydeploy import ir
from tinydeploy.errors import TinydeployError
from tinydeploy.passes.activations import fuse_activations
from tinydeploy.passes.batchnorm import fold_batchnorm
from tinydeploy.passes.bias_add import fold_bias_add
from tinydeploy.passes.identities import remove_identities
from tinydeploy.passes.outputs import separate_outputs
from tinydeploy.passes.transposes import fold_transposes
from tinydeploy.passes.variadic import expand_variadic
from tinydeploy.quant.qdq import quantize_qdq


@dataclass(frozen=True)
class Pass:
    run: Callable[[ir.Graph], None]
    needs: tuple[str, ...] = ()
    ensures: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.run.__name__


def dead_code(g: ir.Graph) -> None:
    """Nodes whose outputs nobody needs, and tensors nothing refers to, go."""
    g.prune()


LOWER_8BIT = Pass(quantize_qdq, ensures=("8-bit islands are integer operators",))
PASSES = [
    Pass(remove_identities, ensures=("no Identity or Dropout",)),
    Pass(expand_variadic, ensures=("Sum/Max/Min have two inputs",)),
    Pass(dead_code, ensures=("no dead nodes",)),
    # BatchNorm folds into the Conv/Gemm before a following Add can become its bias
    Pass(fold_batchnorm, needs=("no Identity or Dropout",), ensures=("BatchNorm folded",)),
    Pass(fold_bias_add, needs=("BatchNorm folded",), ensures=("bias Adds folded",)),
    # an activation fuses into the last arithmetic node, the bias already inside it; 8-bit
    # clamps were taken by the 8-bit lowering first
    Pass(fuse_activations, needs=("bias Adds folded", "8-bit islands are integer operators"),
         ensures=("activations fused",)),
    Pass(fold_transposes, ensures=("transposes folded",)),
    Pass(separate_outputs, ensures=("outputs have their own buffers",)),
    Pass(dead_code, needs=("outputs have their own buffers",), ensures=("no dead nodes",)),
]


def run_passes(g: ir.Graph, passes: list[Pass] | None = None, done: tuple[str, ...] = LOWER_8BIT.ensures) -> ir.Graph:
    """Run `passes` (default PASSES) in order; `done`: facts already established."""
    have = set(done)
    for p in PASSES if passes is None else passes:
        missing = [n for n in p.needs if n not in have]
        if missing:
            raise TinydeployError(f"internal: pass {p.name} needs {missing} which no earlier pass ensures; "
                                  "this is a tinydeploy bug")
        p.run(g)
        have.update(p.ensures)
    return g
