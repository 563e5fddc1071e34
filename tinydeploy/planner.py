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

Two requests of the library form (codegen/project.py Api) change the rules:
- State pairs (in, out): a model that carries state as an input/output pair keeps it in the
  arena between runs, so the state input's buffer lives for the whole run. The state output
  shares that buffer (no copy after the run) when the step that writes it is the first after
  the last read of the state, or an in-place step reading it; else it gets its own buffer and
  the run copies it back.
- Scratch apart: the kernels' scratch goes into a second arena (each scratch lives for its one
  step, so that arena is the largest scratch), e.g. a small fast RAM, and the arena holds the
  tensors alone.
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
    scratch_bytes: int = 0        # the scratch arena (scratch apart), else 0
    apart: frozenset = frozenset()            # names whose offset is in the scratch arena
    aliased: frozenset = frozenset()          # state outputs sharing their state input's bytes


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def plan_memory(g: ir.Graph, kernels: list[Kernel | None], alignment: int = 16,
                states: tuple[tuple[str, str], ...] = (), scratch_apart: bool = False) -> Plan:
    steps = len(g.nodes)
    owner: dict[str, Buffer] = {}
    buffers: list[Buffer] = []
    state_of = {o: i for i, o in states}       # state output -> its state input
    aliased, apart = set(), []

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
        alias = (n.outputs[0] if len(n.outputs) == 1 and n.outputs[0] in state_of and not d.view
                 and _can_alias(g, kernels, n, d, owner[state_of[n.outputs[0]]], k) else "")
        if alias:       # the new state is written over the old one: no copy after the run
            owner[state_of[alias]].tensors.append(alias)
            owner[alias] = owner[state_of[alias]]
            aliased.add(alias)
        elif d.view and x in owner:
            b = owner[x]
            b.tensors.append(n.outputs[0])
            owner[n.outputs[0]] = b
            continue
        elif (d.inplace and x in owner and not owner[x].pinned and owner[x].end == k
                and not any(t in g.outputs for t in owner[x].tensors)   # outputs are pinned only below
                and _last_use(g, kernels, owner[x], k) and g.t(x).nbytes == g.t(n.outputs[0]).nbytes):
            b = owner[x]
            b.tensors.append(n.outputs[0])
            owner[n.outputs[0]] = b
            continue
        else:
            for o in n.outputs:
                if o:
                    new_buffer([o], g.t(o).nbytes, k)
        if kern is not None and kern.scratch_bytes:
            if scratch_apart:
                apart.append(Buffer(-1, _align(kern.scratch_bytes, alignment), k, k, [f"#scratch{k}"]))
            else:
                new_buffer([f"#scratch{k}"], kern.scratch_bytes, k)
    # graph outputs, and the state inputs (their bytes carry the state to the next run), live to the end
    for name in [*g.outputs, *(i for i, _ in states)]:
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
    offsets.update({b.tensors[0]: 0 for b in apart})     # each scratch alone in its step
    return Plan(offsets, total, lower, buffers, max((b.size for b in apart), default=0),
                frozenset(b.tensors[0] for b in apart), frozenset(aliased))


def _can_alias(g: ir.Graph, kernels: list[Kernel | None], n: ir.Node, d, b: Buffer, k: int) -> bool:
    """Step k (node n) may write its one output over buffer b (a state input): the output has
    b's size, nothing reads b after step k, and step k reads b not at all or only as the first
    operand of an operator that works in place."""
    if g.t(n.outputs[0]).nbytes != g.t(b.tensors[0]).nbytes or not _last_use(g, kernels, b, k):
        return False
    reads = [j for j, i in enumerate(_reads(n, kernels[k])) if i in b.tensors]
    return not reads or (reads == [0] and d.inplace)


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
