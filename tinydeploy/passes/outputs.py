"""separate_outputs: every graph output gets a buffer of its own."""
from __future__ import annotations

from tinydeploy import ir


def separate_outputs(g: ir.Graph) -> None:
    """Every graph output gets a buffer of its own: outputs that are graph inputs, constants or
    listed twice are copied."""
    seen = set()
    for k, name in enumerate(list(g.outputs)):
        t = g.t(name)
        if name in seen or name in g.inputs or t.is_const:
            y = g.fresh_name(f"{name}_out{k}")
            g.tensors[y] = ir.Tensor(y, t.shape, t.dtype)
            g.nodes.append(ir.Node("Copy", f"output_copy_{k}", [name], [y]))
            g.outputs[k] = y
        seen.add(g.outputs[k])
