"""`tinydeploy inspect`: what is in a model, as imported, after the QDQ pass (tinydeploy/quant/):
8-bit models list the integer operators their Q -> op -> DQ islands become, and only what is
really unsupported is marked so. Other rewrites (passes.PASSES) are not applied."""
from __future__ import annotations

import numpy as np

from tinydeploy.codegen.cfmt import printable
from tinydeploy.frontend.importer import import_model
from tinydeploy.ops import REGISTRY, unsupported_nodes
from tinydeploy.ops.verify import verify_graph
from tinydeploy.quant.qdq import quantize_qdq


def inspect_model(path, input_shapes=None, max_weights_bytes=None) -> str:
    g, _ = import_model(path, input_shapes, max_weights_bytes)
    verify_graph(g)   # a malformed model is an error, as in build
    quantize_qdq(g)   # a no-op for float models
    bad = {id(n): why for n, why in unsupported_nodes(g)}
    rows = [("#", "op", "name", "output shape", "MACs", "params", "status")]
    total_macs = total_params = 0
    counted = set()
    for k, n in enumerate(g.nodes):
        d = REGISTRY.get(n.op)
        macs = 0
        if d is not None and id(n) not in bad:
            try:
                macs = d.macs(n, g)
            except Exception:
                macs = 0
        params = 0
        for i in n.inputs:
            if i and g.t(i).is_const and i not in counted:
                counted.add(i)
                params += g.t(i).size
        total_macs += macs
        total_params += params
        out = g.t(n.outputs[0]) if n.outputs and n.outputs[0] in g.tensors else None
        shape = "x".join(map(str, out.shape)) if out is not None else "-"
        status = "ok" if id(n) not in bad else f"UNSUPPORTED: {bad[id(n)]}"
        rows.append((str(k), printable(n.op, 24), printable(n.name, 32), shape, f"{macs:,}", f"{params:,}", status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("")
    for name in g.inputs:
        t = g.t(name)
        lines.append(f"input  {printable(name)}: {np.dtype(t.dtype).name} {list(t.shape)}")
    for name in g.outputs:
        t = g.t(name)
        lines.append(f"output {printable(name)}: {np.dtype(t.dtype).name} {list(t.shape)}")
    lines.append(f"{len(g.nodes)} nodes, {total_macs:,} MACs, {total_params:,} parameters")
    for note in g.notes:
        lines.append(f"note: {note}")
    if bad:
        ops = sorted({printable(n.op) for n in g.nodes if id(n) in bad})
        lines.append(f"unsupported operators: {', '.join(ops)}")
    else:
        lines.append("all operators are supported")
    return "\n".join(lines)


def add_parser(sub) -> None:
    from tinydeploy.commands.common import max_weights
    p = sub.add_parser("inspect", help="operator table, shapes, MACs, parameters, unsupported operators")
    p.add_argument("model")
    p.add_argument("--input-shape", action="append", metavar="NAME=1x3x224x224")
    max_weights(p)


def main(args, ctx) -> int:
    print(inspect_model(args.model, ctx.shapes, ctx.max_weights_bytes))
    return 0
