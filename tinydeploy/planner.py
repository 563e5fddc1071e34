"""Static memory planning: every runtime tensor gets an offset in one arena.

1. Buffers: a view (Reshape...) shares its input's buffer; an elementwise op writes in place
   when one of its same-size inputs dies there (and is not a graph input or output). Tensors a
   kernel computes inside another (the layers of a patch-based chain, Kernel.fused) get none,
   nor does a node selection folded into a later kernel (its kernel is None and it is no view:
   the input Transpose a first-layer kernel reads through, schedule/first.py).
2. Lifetimes: a buffer lives from the step that writes it to the last step that reads it (what
   the step's kernel takes: its arguments); graph inputs from step 0, graph outputs to the end.
   Kernel scratch lives for its one step.
3. Lower bound: the per-layer bound, the largest total size of the tensors live during any one
   step when every layer's inputs and outputs exist whole (views and elementwise in-place ops
   as in 1, no kernel scratch). The arena is reported next to it; it can be smaller where
   kernels overwrite their input (Kernel.alias) or run layers patch by patch.
4. Kernel aliasing: a kernel that may write its output over its input 0 (Kernel.alias = d, the
   output at byte d of the input's buffer; it reads what it needs first) gets its output
   buffer anchored there when that input dies at its step: the two are placed together and
   may share bytes at that one step.
5. Placement: activations greedy by size (largest first, lowest offset that fits beside
   everything it overlaps in time; anchored buffers as one group); a few orders are tried and
   the smallest arena kept. Scratch of a fixed size is placed either with the activations, like
   them, or afterwards in the holes, whichever arena is smaller. Then the scratch kernels can size
   (`fit(kernel, room)`, e.g. a tile) goes into the largest hole under the peak at its step,
   where the peak is the activations' or, where larger, what one step needs with that kernel's
   smallest scratch; above the peak only where fragmentation leaves no hole.
6. The report says per step what is live and why (Plan.report; model.c prints it).

Two requests of the library form (codegen/project.py Api) change the rules:
- State pairs (in, out): a model that carries state as an input/output pair keeps it in the
  arena between runs, so the state input's buffer lives for the whole run. The state output
  shares that buffer (no copy after the run) when the step that writes it is the first after
  the last read of the state, or an in-place step reading it; else it gets its own buffer and
  the run copies it back.
- Scratch apart: the kernels' scratch goes into a second arena (each scratch lives for its one
  step, so that arena is the largest scratch; kernels that can size theirs take their
  smallest), e.g. a small fast RAM, and the arena holds the tensors alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

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
    scratch: bool = False
    anchor: tuple[int, int] | None = None    # (buffer id, byte offset in it) this one is placed at


@dataclass
class Plan:
    offsets: dict[str, int]       # runtime tensor name -> arena offset (scratch: "#scratch<k>")
    arena_bytes: int
    lower_bound: int
    buffers: list[Buffer]
    report: list[list[tuple[str, int, int, str]]] = field(default_factory=list)  # per step: (tensor, offset, bytes, why)
    aliased: set[int] = field(default_factory=set)    # steps whose kernel writes over its input
    notes: list[str] = field(default_factory=list)    # what the planner chose and why (patch-based chains)
    fixed_scratch: bool = False   # some kernel's scratch has one size (placed with the activations or in holes)
    scratch_bytes: int = 0        # the scratch arena (scratch apart), else 0
    apart: frozenset = frozenset()            # names whose offset is in the scratch arena
    state_aliased: frozenset = frozenset()    # state outputs sharing their state input's bytes

    def step_bytes(self, k: int) -> int:
        """The arena bytes live at step k (buffers that share bytes counted once)."""
        return _covered((off, off + size) for _, off, size, _ in self.report[k])

    @property
    def peak_step(self) -> int:
        """The step with the most bytes live (the first of them)."""
        totals = [self.step_bytes(k) for k in range(len(self.report))]
        return max(range(len(totals)), key=lambda k: (totals[k], -k)) if totals else 0


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _reads(n: ir.Node, kern: Kernel | None) -> list[str]:
    """What step n reads: its kernel's arguments (a kernel may read through a folded node), a
    view's input; a node folded into a later kernel reads nothing itself."""
    if kern is not None:
        return [a for a in kern.args if not a.startswith("#")]
    return n.inputs if REGISTRY[n.op].view else []


def _last_reader(g: ir.Graph, kernels: list[Kernel | None], names: set[str]) -> int:
    last = -1
    for k, (n, kern) in enumerate(zip(g.nodes, kernels)):
        if names.intersection(_reads(n, kern)):
            last = k
    return last


class _Builder:
    """The buffers of one plan. kernel_level: also kernels' fused layers and aliasing (else the
    per-layer view of the lower bound)."""

    def __init__(self, g: ir.Graph, kernels: list[Kernel | None], alignment: int, kernel_level: bool,
                 alias_steps: set[int] | None = None, states: tuple[tuple[str, str], ...] = ()):
        self.g, self.kernels, self.alignment = g, kernels, alignment
        self.owner: dict[str, Buffer] = {}
        self.buffers: list[Buffer] = []
        self.aliased: set[int] = set()
        self.state_aliased: set[str] = set()
        state_of = {o: i for i, o in states}       # state output -> its state input
        chained = {s for k in kernels if k is not None for s in k.fused}
        fused = chained if kernel_level else set()
        steps = len(g.nodes)
        for name in g.inputs:
            self._new([name], g.t(name).nbytes, 0).pinned = True
        for k, (n, kern) in enumerate(zip(g.nodes, kernels)):
            d = REGISTRY[n.op]
            # the per-layer view: a patch-based chain's layers (fused ones and its last) as layers
            layer = not kernel_level and (k in chained or (kern is not None and bool(kern.fused)))
            if kern is None and not d.view and not layer:
                continue                              # folded into a later kernel, which reads through it
            reads = n.inputs if layer else _reads(n, kern)
            for i in reads:
                if i and i in self.owner:
                    self.owner[i].end = max(self.owner[i].end, k)
            if k in fused:
                continue                              # computed inside a later kernel: no buffer
            x = n.inputs[0] if n.inputs else ""
            out0 = n.outputs[0] if len(n.outputs) == 1 else ""
            if out0 in state_of and not d.view and self._state_alias(n, kern, d, self.owner[state_of[out0]], k):
                self._share(out0, self.owner[state_of[out0]])   # the new state over the old: no copy after the run
                self.state_aliased.add(out0)
                continue
            if d.view and x in self.owner:
                self._share(n.outputs[0], self.owner[x])
                continue
            if d.inplace and self._inplace(n, k):
                continue
            if kern is not None and kern.fused:
                x = kern.args[0]
            if (kernel_level and kern is not None and kern.alias is not None and (alias_steps is None or k in alias_steps)
                    and self._dies_here(x, k, inputs_ok=bool(kern.fused))
                    and kern.alias + g.t(n.outputs[0]).nbytes <= g.t(x).nbytes):
                b = self._new([n.outputs[0]], g.t(n.outputs[0]).nbytes, k)
                b.anchor = (self.owner[x].id, kern.alias)
                self.aliased.add(k)
                continue
            outs = n.outputs if not (kern is not None and kernel_level and kern.fused) else \
                [a for a in kern.args if a in n.outputs]
            for o in outs:
                if o:
                    self._new([o], g.t(o).nbytes, k)
        # graph outputs, and the state inputs (their bytes carry the state to the next run), live to the end
        for name in [*g.outputs, *(i for i, _ in states)]:
            if name in self.owner:
                self.owner[name].end = max(steps - 1, self.owner[name].end)
                self.owner[name].pinned = True

    def _state_alias(self, n: ir.Node, kern: Kernel | None, d, b: Buffer, k: int) -> bool:
        """Step k (node n) may write its one output over buffer b (a state input): the output has
        b's size, nothing reads b after step k, and step k reads b not at all or only as the first
        operand of an operator that works in place."""
        if self.g.t(n.outputs[0]).nbytes != self.g.t(b.tensors[0]).nbytes or \
                _last_reader(self.g, self.kernels, set(b.tensors)) > k:
            return False
        reads = [j for j, i in enumerate(_reads(n, kern)) if i in b.tensors]
        return not reads or (reads == [0] and d.inplace)

    def _new(self, names: list[str], size: int, start: int) -> Buffer:
        b = Buffer(len(self.buffers), _align(max(size, 1), self.alignment), start, start, list(names))
        self.buffers.append(b)
        for nm in names:
            self.owner[nm] = b
        return b

    def _share(self, name: str, b: Buffer) -> None:
        b.tensors.append(name)
        self.owner[name] = b

    def _dies_here(self, x: str, k: int, inputs_ok: bool = False) -> bool:
        """Tensor x's buffer can be overwritten by step k: its last reader is k, it holds no graph
        output, nor a graph input unless `inputs_ok` (a patch-based chain writes only into the
        source rows it no longer reads; every inference starts from a fresh copy of its inputs)."""
        b = self.owner.get(x)
        return (b is not None and (not b.pinned or inputs_ok) and b.end == k
                and not any(t in self.g.outputs for t in b.tensors)
                and _last_reader(self.g, self.kernels, set(b.tensors)) <= k)

    def _inplace(self, n: ir.Node, k: int) -> bool:
        """An elementwise op writes over the first same-size input that dies at its step."""
        out = n.outputs[0]
        for x in n.inputs:
            if x and self._dies_here(x, k) and self.g.t(x).nbytes == self.g.t(out).nbytes:
                self._share(out, self.owner[x])
                return True
        return False


def _groups(buffers: list[Buffer]) -> list[list[tuple[Buffer, int]]]:
    """Anchored buffers as groups: [(buffer, offset relative to the group)], root first."""
    by_id = {b.id: b for b in buffers}
    rel: dict[int, tuple[int, int]] = {}

    def root(b: Buffer) -> tuple[int, int]:
        if b.id not in rel:
            if b.anchor is None:
                rel[b.id] = (b.id, 0)
            else:
                r, off = root(by_id[b.anchor[0]])
                rel[b.id] = (r, off + b.anchor[1])
        return rel[b.id]

    groups: dict[int, list[tuple[Buffer, int]]] = {}
    for b in buffers:
        r, off = root(b)
        groups.setdefault(r, []).append((b, off))
    out = []
    for members in groups.values():
        low = min(off for _, off in members)
        out.append([(b, off - low) for b, off in members])
    return out


def _place(groups: list[list[tuple[Buffer, int]]]) -> int:
    placed: list[Buffer] = []
    total = 0
    for grp in groups:
        ids = {b.id for b, _ in grp}
        cands = {0}
        for b, rel in grp:
            for p in placed:
                if p.start <= b.end and b.start <= p.end:
                    cands.add(max(0, p.offset + p.size - rel))
        for off in sorted(cands):
            if all(not (p.start <= b.end and b.start <= p.end and p.offset < off + rel + b.size
                        and off + rel < p.offset + p.size)
                   for b, rel in grp for p in placed if p.id not in ids):
                break
        for b, rel in grp:
            b.offset = off + rel
            placed.append(b)
            total = max(total, b.offset + b.size)
    return total


def _place_best(buffers: list[Buffer], floor: int) -> int:
    groups = _groups(buffers)

    def size(grp):
        return max(rel + b.size for b, rel in grp)

    def start(grp):
        return min(b.start for b, _ in grp)

    def span(grp):
        return max(b.end for b, _ in grp) - start(grp)

    best = None
    for order in (lambda x: (-size(x), start(x), x[0][0].id), lambda x: (start(x), -size(x), x[0][0].id),
                  lambda x: (-span(x), -size(x), x[0][0].id)):
        total = _place(sorted(groups, key=order))
        if best is None or total < best[0]:
            best = (total, {b.id: b.offset for b in buffers})
        if total == floor:
            break
    total, offs = best
    for b in buffers:
        b.offset = offs[b.id]
    return total


def _holes(buffers: list[Buffer], step: int, limit: int) -> list[tuple[int, int]]:
    """Free byte ranges [lo, hi) below `limit` at `step`."""
    busy = sorted((b.offset, b.offset + b.size) for b in buffers if b.start <= step <= b.end)
    out, cur = [], 0
    for lo, hi in busy:
        if lo > cur:
            out.append((cur, lo))
        cur = max(cur, hi)
    if cur < limit:
        out.append((cur, limit))
    return out


def _live_bytes(buffers: list[Buffer], step: int) -> int:
    """Bytes the placed buffers live at `step` cover (anchored ones may share bytes)."""
    return _covered((b.offset, b.offset + b.size) for b in buffers if b.start <= step <= b.end)


def _covered(ranges) -> int:
    """Bytes covered by the byte ranges [lo, hi), overlaps counted once."""
    total, end = 0, 0
    for lo, hi in sorted(ranges):
        total, end = total + max(0, hi - max(lo, end)), max(end, hi)
    return total


def _live_peak(buffers: list[Buffer], steps: int) -> int:
    return max((sum(b.size for b in buffers if b.start <= k <= b.end) for k in range(max(steps, 1))), default=0)


def lower_bound(g: ir.Graph, kernels: list[Kernel | None], alignment: int = 16,
                states: tuple[tuple[str, str], ...] = ()) -> int:
    """The per-layer lower bound (module text, 3)."""
    return _live_peak(_Builder(g, kernels, alignment, kernel_level=False, states=states).buffers, len(g.nodes))


# A patch-based chain (Kernel.fused) is taken when it makes the arena smaller by at least this
# share, and adds at most this many instructions per MAC of the model (the candidate's estimate).
CHAIN_MIN_SAVING = 0.05
CHAIN_MAX_ADDED = 0.1


def plan_memory(g: ir.Graph, kernels: list[Kernel | None], alignment: int = 16,
                fit: Callable[[Kernel, int], bool] | None = None, chains: Callable | None = None,
                macs: int = 0, states: tuple[tuple[str, str], ...] = (), scratch_apart: bool = False) -> Plan:
    """The arena. `fit(kernel, room)`: sizes a kernel's scratch (e.g. its tile) to at most `room`
    bytes where it can (its smallest otherwise), after params["INPLACE"] says whether it writes
    over its input, and says whether it could (False: the scratch is placed like an activation). Kernels that may alias their input at no cost do so wherever the input dies;
    the others only where that makes the arena smaller. `chains(g, kernels)`: candidate kernel
    lists that run some layers patch by patch (each with .kernels, .added instructions, .desc);
    the one that saves the most is taken where it pays (CHAIN_MIN_SAVING, CHAIN_MAX_ADDED), and
    `kernels` is changed in place to it. `states`, `scratch_apart`: the library form's requests
    (module text). On return the kernels' parameters (scratch sizes, INPLACE) are the returned
    plan's, as `mismatches` checks: the trials size the kernels they share with `kernels` too."""
    opts = {"states": tuple(states), "apart": scratch_apart}
    plan = _plan_aliases(g, kernels, alignment, fit, opts)
    notes = []
    for _ in range(3 if chains else 0):
        best, tried = None, False
        for cand in chains(g, kernels):
            if cand.added > CHAIN_MAX_ADDED * macs:
                continue
            # a candidate shares the kernels outside its chain with `kernels`: planning it sizes
            # their scratch (fit) and sets their INPLACE for the trial's arena, not for `plan`
            trial = _plan_aliases(g, cand.kernels, alignment, fit, opts)
            tried = True
            if trial.arena_bytes <= plan.arena_bytes * (1 - CHAIN_MIN_SAVING) and (
                    best is None or (trial.arena_bytes, cand.added) < (best[1].arena_bytes, best[0].added)):
                best = (cand, trial)
        if best is None:
            if tried:       # the kernels' parameters as the kept plan has them
                plan = _plan_aliases(g, kernels, alignment, fit, opts)
            break
        cand, _ = best
        notes.append(f"{cand.desc}: arena {plan.arena_bytes:,} -> {best[1].arena_bytes:,} B "
                     f"(-{plan.arena_bytes - best[1].arena_bytes:,} B), about +{cand.added:,} instructions")
        kernels[:] = cand.kernels
        plan = _plan_aliases(g, kernels, alignment, fit, opts)
    plan.notes = notes
    bad = mismatches(plan, kernels)
    if bad:
        raise AssertionError(f"planner: kernels disagree with their plan: {'; '.join(bad)}")
    return plan


def mismatches(plan: Plan, kernels: list[Kernel | None]) -> list[str]:
    """Where the kernels, as their parameters have them now (as the C will run them), disagree
    with the plan: scratch larger than its planned bytes or ending past its arena, a kernel
    writing over its input (params["INPLACE"]) at a step the plan did not anchor, or the reverse."""
    size = {nm: b.size for b in plan.buffers for nm in b.tensors}
    out = []
    for k, kern in enumerate(kernels):
        if kern is None:
            continue
        if kern.alias is not None and bool(kern.params.get("INPLACE")) != (k in plan.aliased):
            out.append(f"step {k} ({kern.family}) INPLACE={kern.params.get('INPLACE')}, planned {k in plan.aliased}")
        name = f"#scratch{k}"
        if not kern.scratch_bytes:
            continue
        apart = name in plan.apart
        arena = plan.scratch_bytes if apart else plan.arena_bytes
        have = arena if apart else size.get(name, 0)
        off = plan.offsets.get(name, 0)
        if name not in plan.offsets or kern.scratch_bytes > have or off + kern.scratch_bytes > arena:
            out.append(f"step {k} ({kern.family}) scratch {kern.scratch_bytes} B at {off}, planned "
                       f"{have if name in plan.offsets else 'none'} in an arena of {arena} B")
    return out


def _plan_aliases(g: ir.Graph, kernels: list[Kernel | None], alignment: int, fit, opts: dict) -> Plan:
    """The plan with the kernels' aliasing decided: free ones wherever possible, costly ones where
    they make the arena smaller."""
    costly = [k for k, kern in enumerate(kernels) if kern is not None and kern.alias is not None and not kern.alias_free]
    enabled = {k for k, kern in enumerate(kernels) if kern is not None and kern.alias is not None and kern.alias_free}
    best = _plan(g, kernels, alignment, fit, enabled, opts)
    for k in costly:
        trial = _plan(g, kernels, alignment, fit, enabled | {k}, opts)
        if k in trial.aliased and trial.arena_bytes < best.arena_bytes:
            enabled.add(k)
            best = trial
    if costly:      # the kernels' parameters as the chosen plan has them
        best = _plan(g, kernels, alignment, fit, enabled, opts)
    return best


def _plan(g: ir.Graph, kernels: list[Kernel | None], alignment: int, fit, enabled: set[int], opts: dict) -> Plan:
    """Scratch of one size (kernels fit cannot size) goes either into the holes after the
    activations are placed, or is placed with them, like them: whichever arena is smaller (the
    one chosen is computed last, so that the kernels' sized scratch is as it has it)."""
    with_acts = _plan_once(g, kernels, alignment, fit, enabled, True, opts)
    if not with_acts.fixed_scratch:
        return with_acts
    in_holes = _plan_once(g, kernels, alignment, fit, enabled, False, opts)
    if in_holes.arena_bytes <= with_acts.arena_bytes:
        return in_holes
    return _plan_once(g, kernels, alignment, fit, enabled, True, opts)


def _plan_once(g: ir.Graph, kernels: list[Kernel | None], alignment: int, fit, enabled: set[int],
               fixed_with_acts: bool, opts: dict) -> Plan:
    steps = len(g.nodes)
    bld = _Builder(g, kernels, alignment, kernel_level=True, alias_steps=enabled, states=opts["states"])
    for k, kern in enumerate(kernels):
        if kern is not None and kern.alias is not None:
            kern.params = dict(kern.params, INPLACE=k in bld.aliased)
    acts = bld.buffers
    # fit(k, 0) first: a kernel's scratch as an earlier plan sized it (e.g. none) does not count
    need = [k for k, kern in enumerate(kernels) if kern is not None and (
        (fit is not None and fit(kern, 0)) or kern.scratch_bytes or kern.params.get("INPLACE"))]
    if opts["apart"]:       # every scratch alone in its step, in an arena of its own
        for k in need:
            if fit is not None:
                fit(kernels[k], 0)
        apart = [k for k in need if kernels[k].scratch_bytes]
        peak = _place_best(acts, _live_peak(acts, steps))
        plan = Plan({nm: b.offset for b in acts for nm in b.tensors} | {f"#scratch{k}": 0 for k in apart},
                    peak, lower_bound(g, kernels, alignment, opts["states"]), acts, aliased=set(bld.aliased),
                    scratch_bytes=max((_align(kernels[k].scratch_bytes, alignment) for k in apart), default=0),
                    apart=frozenset(f"#scratch{k}" for k in apart), state_aliased=frozenset(bld.state_aliased))
        plan.report = _report(g, kernels, acts)
        return plan
    # scratch whose size the kernel can change (fit says so) goes into the holes afterwards
    sized = [k for k in need if fit is not None and fit(kernels[k], 0)]
    fixed = [k for k in need if k not in sized and kernels[k].scratch_bytes]
    if fixed_with_acts:
        for k in fixed:
            acts.append(Buffer(len(acts), _align(kernels[k].scratch_bytes, alignment), k, k, [f"#scratch{k}"],
                               scratch=True))
    peak = _place_best(acts, _live_peak(acts, steps))
    for k in sized:       # the arena the smallest scratch allows: each kernel then sizes its own up to it
        peak = max(peak, _live_bytes(acts, k) + _align(kernels[k].scratch_bytes, alignment))
    scratch: list[Buffer] = []
    for k in ([] if fixed_with_acts else fixed) + sized:
        kern = kernels[k]
        if k in sized:
            holes = _holes(acts + scratch, k, peak)
            fit(kern, max((hi - lo for lo, hi in holes), default=0) // alignment * alignment)
        if not kern.scratch_bytes:
            continue
        size = _align(kern.scratch_bytes, alignment)
        lo = next(lo for lo, hi in _holes(acts + scratch, k, 1 << 40) if hi - lo >= size)
        scratch.append(Buffer(len(acts) + len(scratch), size, k, k, [f"#scratch{k}"], offset=lo, scratch=True))
        peak = max(peak, lo + size)
    buffers = acts + scratch
    if scratch:
        # the arena ends where its last buffer does: a kernel whose scratch was cut below its
        # smallest to fill a fragmented hole (q8.fit_gemm) may leave the planned peak unused
        peak = min(peak, max(b.offset + b.size for b in buffers))
    offsets = {nm: b.offset for b in buffers for nm in b.tensors}
    plan = Plan(offsets, peak, lower_bound(g, kernels, alignment, opts["states"]), buffers, aliased=set(bld.aliased),
                state_aliased=frozenset(bld.state_aliased))
    plan.fixed_scratch = bool(fixed)
    plan.report = _report(g, kernels, buffers)
    return plan


def _report(g: ir.Graph, kernels: list[Kernel | None], buffers: list[Buffer]) -> list[list[tuple[str, int, int, str]]]:
    """Per step: every live buffer as (its first tensor, offset, bytes, why it is live)."""
    out = []
    for k, n in enumerate(g.nodes):
        rows = []
        for b in sorted((b for b in buffers if b.start <= k <= b.end), key=lambda b: b.offset):
            name = b.tensors[0]
            if b.scratch:
                why = "scratch of this layer"
            elif any(t in n.outputs for t in b.tensors) and b.start == k:
                why = "written here" + (" over its input" if b.anchor is not None else "")
            elif any(t in n.inputs for t in b.tensors) or (kernels[k] is not None and any(
                    t in kernels[k].args for t in b.tensors)):
                why = "read here" + (", last use" if b.end == k and not b.pinned else "")
            elif b.pinned and b.start == 0 and any(t in g.inputs for t in b.tensors):
                why = f"graph input, read at step {_last_reader(g, kernels, set(b.tensors))}"
            elif b.pinned and any(t in g.outputs for t in b.tensors):
                why = "graph output"
            else:
                nxt = next((j for j in range(k + 1, len(g.nodes)) if set(b.tensors).intersection(g.nodes[j].inputs)), b.end)
                why = f"kept for step {nxt}"
            rows.append((name, b.offset, b.size, why))
        out.append(rows)
    return out
