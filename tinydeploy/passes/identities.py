"""remove_identities: Identity and inference-mode Dropout pass their input through."""
from __future__ import annotations

from tinydeploy import ir


def remove_identities(g: ir.Graph) -> None:
    """Identity and inference-mode Dropout pass their input through."""
    for n in list(g.nodes):
        if n.op not in ("Identity", "Dropout") or (n.op == "Dropout" and len(n.outputs) > 1 and n.outputs[1]
                                                   and g.consumers(n.outputs[1])):
            continue
        x, y = n.inputs[0], n.outputs[0]
        if y in g.outputs:
            if x in g.inputs or x in g.outputs or g.t(x).is_const:
                n.op, n.inputs, n.outputs, n.attrs = "Copy", [x], [y], {}
                continue
            prod = g.producer(x)
            prod.outputs = [y if o == x else o for o in prod.outputs]
            g.replace_uses(x, y)
            g.tensors[y] = ir.Tensor(y, g.t(x).shape, g.t(x).dtype)
        else:
            g.replace_uses(y, x)
        g.nodes.remove(n)
