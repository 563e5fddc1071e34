"""fold_transposes: Transpose(Transpose(x)) composes; a Transpose that moves only size-1 dimensions is a view."""
from __future__ import annotations

from tinydeploy import ir


def _is_view_transpose(shape, perm) -> bool:
    """True when the permutation keeps every dimension larger than 1 in its order."""
    big = [p for p in perm if shape[p] != 1]
    return big == sorted(big)


def fold_transposes(g: ir.Graph) -> None:
    """Transpose(Transpose(x)) composes into one; a Transpose that moves only size-1 dimensions
    (e.g. the NHWC->NCHW input Transpose of a 1-channel model) becomes a zero-copy view."""
    changed = True
    while changed:
        changed = False
        for n in g.nodes:
            if n.op != "Transpose":
                continue
            x = g.t(n.inputs[0])
            perm = list(n.attrs.get("perm", range(len(x.shape) - 1, -1, -1)))
            prod = g.producer(n.inputs[0])
            if prod is not None and prod.op == "Transpose" and g.single_consumer(n.inputs[0]) is n:
                p0 = list(prod.attrs.get("perm", range(len(x.shape) - 1, -1, -1)))
                n.attrs["perm"] = [p0[p] for p in perm]
                n.inputs = [prod.inputs[0]]
                g.nodes.remove(prod)
                changed = True
                break
            if _is_view_transpose(x.shape, perm):
                n.op, n.attrs = "Reshape", {}
                n.inputs = n.inputs[:1]
                changed = True
                break
