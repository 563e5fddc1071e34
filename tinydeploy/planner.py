"""Static memory planning: every runtime tensor gets an offset in one arena.

1. Buffers: a view (Reshape...) shares its input's buffer; an elementwise op writes in place
   when its input's buffer dies there (and is not a graph input or output). A node kernel
   selection folded into a later kernel (its kernel is None and it is no view: the input
   Transpose a first-layer kernel reads through, schedule/first.py) writes nothing.
2. Lifetimes: a buffer lives from the step that writes it to the last step that reads it (what
   the step's kernel takes: its arguments); graph inputs from step 0, graph outputs to the end.
   Kernel scratch lives for its one step.
3. Lower bound: the largest total size of buffers live during any one step. No plan can be
   smaller; the arena is reported next to it.
4. Placement: greedy by size (largest first, lowest offset that fits beside everything it
   overlaps in time). A few orders are tried and the smallest arena kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tinydeploy import ir
from tinydeploy.ops import REGISTRY, Kernel


@dataclass
class Buffer:
    id: int
    size: int
    start: int
    end: int
    tensors: list[str] = field(default_factory=list)
    pinned: bool = False          # holds a graph input or output: never written in place
    offset: int = -1


@dataclass
class Plan:
    offsets: dict[str, int]       # runtime tensor name -> arena offset (scratch: "#scratch<k>")
    arena_bytes: int
    lower_bound: int
    buffers: list[Buffer]


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def plan_memory(g: ir.Graph, kernels: list[Kernel | None], alignment: int = 16) -> Plan:
    steps = len(g.nodes)
    owner: dict[str, Buffer] = {}
    buffers: list[Buffer] = []

    def new_buffer(names: list[str], size: int, start: int) -> Buffer:
        b = Buffer(len(buffers), _align(max(size, 1), alignment), start, start, list(names))
        buffers.append(b)
        for nm in names:
            owner[nm] = b
        return b

    for name in g.inputs:
        new_buffer([name], g.t(name).nbytes, 0).pinned = True
    for k, (n, kern) in enumerate(zip(g.nodes, kernels)):
        d = REGISTRY[n.op]
        if kern is None and not d.view:
            continue
        for i in _reads(n, kern):
            if i and i in owner:
                owner[i].end = max(owner[i].end, k)
        x = n.inputs[0] if n.inputs else ""
        if d.view and x in owner:
            b = owner[x]
            b.tensors.append(n.outputs[0])
            owner[n.outputs[0]] = b
            continue
        if (d.inplace and x in owner and not owner[x].pinned and owner[x].end == k
                and not any(t in g.outputs for t in owner[x].tensors)   # outputs are pinned only below
                and _last_use(g, kernels, owner[x], k) and g.t(x).nbytes == g.t(n.outputs[0]).nbytes):
            b = owner[x]
            b.tensors.append(n.outputs[0])
            owner[n.outputs[0]] = b
            continue
        for o in n.outputs:
            if o:
                new_buffer([o], g.t(o).nbytes, k)
        if kern is not None and kern.scratch_bytes:
            new_buffer([f"#scratch{k}"], kern.scratch_bytes, k)
    for name in g.outputs:
        if name in owner:
            owner[name].end = max(steps - 1, owner[name].end)
            owner[name].pinned = True

    lower = 0
    for k in range(max(steps, 1)):
        lower = max(lower, sum(b.size for b in buffers if b.start <= k <= b.end))

    best = None
    for order in (lambda b: (-b.size, b.start, b.id), lambda b: (b.start, -b.size, b.id),
                  lambda b: (-(b.end - b.start), -b.size, b.id)):
        total = _place(sorted(buffers, key=order))
        if best is None or total < best[0]:
            best = (total, {b.id: b.offset for b in buffers})
        if total == lower:
            break
    total, offs = best
    for b in buffers:
        b.offset = offs[b.id]
    offsets = {nm: b.offset for b in buffers for nm in b.tensors}
    return Plan(offsets, total, lower, buffers)


def _reads(n: ir.Node, kern: Kernel | None) -> list[str]:
    """What step n reads: its kernel's arguments (a kernel may read through a folded node), a
    view's input."""
    return n.inputs if kern is None else kern.args


def _last_use(g: ir.Graph, kernels: list[Kernel | None], b: Buffer, k: int) -> bool:
    """No tensor of buffer b is read after step k (checked over the whole schedule)."""
    names = set(b.tensors)
    return not any(names.intersection(_reads(n, kern)) for n, kern in zip(g.nodes[k + 1:], kernels[k + 1:]))


def _place(order: list[Buffer]) -> int:
    placed: list[Buffer] = []
    total = 0
    for b in order:
        busy = sorted((p.offset, p.offset + p.size) for p in placed if p.start <= b.end and b.start <= p.end)
        off = 0
        for lo, hi in busy:
            if off + b.size <= lo:
                break
            off = max(off, hi)
        b.offset = off
        placed.append(b)
        total = max(total, off + b.size)
    return total
