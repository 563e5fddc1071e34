"""Data movement: views (Reshape, Flatten, Squeeze, Unsqueeze), Transpose, Concat, Split, Slice,
Pad, Gather with constant indices, Expand, and Copy (inserted where an output needs its own buffer)."""
from __future__ import annotations

import numpy as np

from tinydeploy import ir
from tinydeploy.codegen.cfmt import c_float
from tinydeploy.ops.registry import Kernel, dtype_tag, float_only, register
from tinydeploy.ops.elementwise import broadcast_loops
from tinydeploy.ops.verify import axes_problems, axis_problem, input_axis, ints, shape


def _any_dtype(node, g):
    return None


def _verify_view(node, g) -> list[str]:
    """A view keeps the element count (the output is the input's bytes under another shape)."""
    x, y = shape(g, node.inputs[0]), shape(g, node.outputs[0])
    if x is None or y is None or int(np.prod(x, dtype=np.int64)) == int(np.prod(y, dtype=np.int64)):
        return []
    return [f"turns {int(np.prod(x, dtype=np.int64))} elements ({'x'.join(map(str, x))}) into "
            f"{int(np.prod(y, dtype=np.int64))} ({'x'.join(map(str, y))})"]


for _op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
    register(_op, view=True, check=_any_dtype, verify=_verify_view, moves="first")(lambda node, g: None)


def _dropout_check(node, g):
    if len(node.outputs) > 1 and node.outputs[1] and g.consumers(node.outputs[1]):
        return "mask output used"
    if len(node.inputs) > 2 and node.inputs[2]:   # training_mode: the pass would drop a real dropout
        t = g.const(node.inputs[2])
        if t is None:
            return "non-constant training_mode"
        if t.size and bool(t.reshape(-1)[0]):
            return "training mode"
    return None


# Identity and inference-mode Dropout are removed by passes.remove_identities; registering them
# as views lets the support check (which runs before the passes) accept them.
register("Identity", view=True, check=_any_dtype, moves="first")(lambda node, g: None)
register("Dropout", view=True, check=_dropout_check)(lambda node, g: None)


def coalesce(dims: list[int], strides: list[int]) -> tuple[list[int], list[int]]:
    """Merge adjacent loop levels where the inner one continues the outer one in memory."""
    od, os_ = [], []
    for n, s in zip(dims, strides):
        if n == 1:
            continue
        if od and os_[-1] == s * n:
            od[-1] *= n
            os_[-1] = s
        else:
            od.append(n)
            os_.append(s)
    return (od, os_) if od else ([1], [0])


def strided_copy(node, g, x: str, y: str, dims, strides, base: int, desc: str) -> Kernel:
    dims, strides = coalesce(list(dims), list(strides))
    return Kernel("strided_copy", dtype_tag(g.t(y).dtype), {"dims": dims, "strides": strides, "base": base},
                  [x, y], desc=desc)


def _contig_strides(shape) -> list[int]:
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= n
    return st[::-1]


def _verify_transpose(node, g) -> list[str]:
    r = len(g.t(node.inputs[0]).shape)
    perm = ints(node, "perm", list(range(r - 1, -1, -1)))
    if sorted(perm) != list(range(r)):
        return [f"perm {perm} is not a permutation of the {r} axes"]
    return []


@register("Transpose", check=_any_dtype, verify=_verify_transpose, moves="first")
def emit_transpose(node: ir.Node, g: ir.Graph) -> Kernel:
    x = g.t(node.inputs[0])
    perm = list(node.attrs.get("perm", range(len(x.shape) - 1, -1, -1)))
    st = _contig_strides(x.shape)
    return strided_copy(node, g, node.inputs[0], node.outputs[0], [x.shape[p] for p in perm],
                        [st[p] for p in perm], 0, f"perm {perm} of {list(x.shape)}")


@register("Expand", check=_any_dtype, moves="first")
def emit_expand(node: ir.Node, g: ir.Graph) -> Kernel:
    y = g.t(node.outputs[0])
    dims, (sx,) = broadcast_loops(y.shape, [g.t(node.inputs[0]).shape])
    return strided_copy(node, g, node.inputs[0], node.outputs[0], dims, sx, 0, f"to {list(y.shape)}")


def _slice_params(node, g):
    x = g.t(node.inputs[0])
    vals = [g.const(i) if i else None for i in node.inputs[1:5]] + [None] * (4 - len(node.inputs[1:5]))
    starts, ends, axes, steps = vals
    r = len(x.shape)
    axes = list(range(len(starts))) if axes is None else [int(a) + r if a < 0 else int(a) for a in axes]
    steps = [1] * len(axes) if steps is None else [int(s) for s in steps]
    first, step = [0] * r, [1] * r
    for a, s, e, st in zip(axes, starts, ends, steps):
        first[a], _, step[a] = slice(int(s), int(e), st).indices(x.shape[a])
    return first, step


def _slice_check(node, g):
    if any(i and g.const(i) is None for i in node.inputs[1:5]):
        return "non-constant starts/ends/axes/steps"
    return None


def _verify_slice(node, g) -> list[str]:
    r = len(g.t(node.inputs[0]).shape)
    vals = [g.const(i) if i else None for i in node.inputs[1:5]] + [None] * (4 - len(node.inputs[1:5]))
    starts, ends, axes, steps = (None if v is None else [int(x) for x in v.reshape(-1)] for v in vals)
    out = []
    if starts is not None and ends is not None and len(starts) != len(ends):
        out.append(f"{len(starts)} starts and {len(ends)} ends")
    n = len(starts) if starts is not None else None
    if axes is not None:
        out += axes_problems(axes, r)
        if n is not None and len(axes) != n:
            out.append(f"{len(axes)} axes for {n} starts")
    if steps is not None:
        if 0 in steps:
            out.append(f"steps {steps} hold a 0")
        if n is not None and len(steps) != n:
            out.append(f"{len(steps)} steps for {n} starts")
    return out


@register("Slice", check=_slice_check, verify=_verify_slice, moves="first")
def emit_slice(node: ir.Node, g: ir.Graph) -> Kernel:
    x, y = g.t(node.inputs[0]), g.t(node.outputs[0])
    first, step = _slice_params(node, g)
    st = _contig_strides(x.shape)
    base = sum(f * s for f, s in zip(first, st))
    return strided_copy(node, g, node.inputs[0], node.outputs[0], y.shape,
                        [s * k for s, k in zip(st, step)], base, f"{list(x.shape)} -> {list(y.shape)}")


def _verify_concat(node, g) -> list[str]:
    y = g.t(node.outputs[0])
    p = axis_problem(int(node.attrs.get("axis", 0)), len(y.shape))
    return [p] if p else []


@register("Concat", check=_any_dtype, verify=_verify_concat, moves="all")
def emit_concat(node: ir.Node, g: ir.Graph) -> Kernel:
    y = g.t(node.outputs[0])
    r = len(y.shape)
    ax = int(node.attrs["axis"]) % r
    outer = int(np.prod(y.shape[:ax], dtype=np.int64))
    inner = int(np.prod(y.shape[ax + 1:], dtype=np.int64))
    ins = [i for i in node.inputs if i and g.t(i).size > 0]
    chunks = [g.t(i).shape[ax] * inner for i in ins]
    return Kernel("concat", dtype_tag(y.dtype), {"outer": outer, "chunks": chunks, "total": y.shape[ax] * inner},
                  ins + [node.outputs[0]], desc=f"{len(ins)} tensors along axis {ax}")


def _verify_split(node, g) -> list[str]:
    x, ax, p = input_axis(node, g)
    if p:
        return [p]
    got = [shape(g, o) for o in node.outputs if o]
    if any(s is None or len(s) != len(x) for s in got) or sum(s[ax] for s in got) != x[ax]:
        return [f"the outputs do not add up to the input's {x[ax]} along axis {ax}"]
    return []


@register("Split", check=_any_dtype, verify=_verify_split)
def emit_split(node: ir.Node, g: ir.Graph) -> Kernel:
    x = g.t(node.inputs[0])
    r = len(x.shape)
    ax = int(node.attrs.get("axis", 0)) % r
    outer = int(np.prod(x.shape[:ax], dtype=np.int64))
    inner = int(np.prod(x.shape[ax + 1:], dtype=np.int64))
    chunks = [g.t(o).shape[ax] * inner for o in node.outputs]
    return Kernel("split", dtype_tag(x.dtype), {"outer": outer, "chunks": chunks, "total": x.shape[ax] * inner},
                  [node.inputs[0]] + node.outputs, desc=f"into {len(chunks)} along axis {ax}")


def _pad_check(node, g):
    if len(node.inputs) > 1 and any(i and g.const(i) is None for i in node.inputs[1:]):
        return "non-constant pads"
    if node.attrs.get("mode", "constant") not in ("constant", "edge", "reflect"):
        return f"mode {node.attrs.get('mode')}"
    return float_only(node, g)


def _pad_amounts(node, g) -> tuple[list[int], list[int]] | None:
    """(before, after) padding per axis, from the attribute (opset < 11) or the constant inputs."""
    r = len(g.t(node.inputs[0]).shape)
    pads = node.attrs.get("pads")
    if pads is None:
        c = g.const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
        if c is None:
            return None
        pads = [int(v) for v in c.reshape(-1)]
    axes = list(range(r))
    if len(node.inputs) > 3 and node.inputs[3]:
        c = g.const(node.inputs[3])
        if c is None:
            return None
        axes = [int(a) for a in c.reshape(-1)]
    if len(pads) != 2 * len(axes) or axes_problems(axes, r):
        return None
    begin, end = [0] * r, [0] * r
    for k, a in enumerate(axes):
        begin[a % r], end[a % r] = int(pads[k]), int(pads[k + len(axes)])
    return begin, end


def _verify_pad(node, g) -> list[str]:
    """pads for every padded axis; reflect pads at most the axis size - 1 and edge pads only
    non-empty axes (onnxruntime refuses the others)."""
    x = g.t(node.inputs[0]).shape
    if len(node.inputs) > 3 and node.inputs[3] and g.const(node.inputs[3]) is not None:
        bad = axes_problems([int(a) for a in g.const(node.inputs[3]).reshape(-1)], len(x))
        if bad:
            return bad
    amounts = _pad_amounts(node, g)
    if amounts is None:
        return [] if _pad_check(node, g) else ["pads do not give a before and an after amount for every padded axis"]
    mode = node.attrs.get("mode", "constant")
    for a, (b, e) in enumerate(zip(*amounts)):
        if mode == "reflect" and max(b, e) > x[a] - 1:
            return [f"reflect pads {b} and {e} on axis {a}, which has {x[a]} elements: at most {x[a] - 1}"]
    return []


@register("Pad", check=_pad_check, verify=_verify_pad)
def emit_pad(node: ir.Node, g: ir.Graph) -> Kernel:
    x, y = g.t(node.inputs[0]), g.t(node.outputs[0])
    r = len(x.shape)
    begin, end = _pad_amounts(node, g)
    value = 0.0
    if len(node.inputs) > 2 and node.inputs[2]:
        value = float(g.const(node.inputs[2]).reshape(-1)[0]) if g.const(node.inputs[2]).size else 0.0
    else:
        value = float(node.attrs.get("value", 0.0))
    mode = node.attrs.get("mode", "constant")
    maps = []   # per axis: input index for each output index, -1 = the constant value
    for a in range(r):
        n = x.shape[a]
        idx = []
        for o in range(y.shape[a]):
            i = o - begin[a]
            if 0 <= i < n:
                idx.append(i)
            elif mode == "constant":
                idx.append(-1)
            elif mode == "edge":
                idx.append(min(max(i, 0), n - 1))
            else:  # reflect
                period = 2 * (n - 1) if n > 1 else 1
                i = abs(i) % period if period else 0
                idx.append(period - i if i >= n else i)
        maps.append(idx)
    return Kernel("pad", dtype_tag(y.dtype), {"maps": maps, "strides": _contig_strides(x.shape),
                  "value": c_float(value)}, [node.inputs[0], node.outputs[0]],
                  desc=f"{mode} {list(x.shape)} -> {list(y.shape)}")


def _gather_check(node, g):
    if g.const(node.inputs[1]) is None:
        return "non-constant indices"
    return None


def _verify_gather(node, g) -> list[str]:
    x, ax, p = input_axis(node, g)
    if p:
        return [p]
    idx = g.const(node.inputs[1])
    if idx is None:
        return []
    n = x[ax % len(x)]
    bad = [int(i) for i in idx.reshape(-1) if not -n <= int(i) < n]
    return [f"index {bad[0]} is out of range for axis {ax} of size {n}"] if bad else []


@register("Gather", check=_gather_check, verify=_verify_gather, moves="first")
def emit_gather(node: ir.Node, g: ir.Graph) -> Kernel:
    x = g.t(node.inputs[0])
    r = len(x.shape)
    ax = int(node.attrs.get("axis", 0)) % r
    idx = [int(i) % x.shape[ax] for i in g.const(node.inputs[1]).reshape(-1)]   # in range: verified
    return Kernel("gather", dtype_tag(x.dtype),
                  {"outer": int(np.prod(x.shape[:ax], dtype=np.int64)), "n": x.shape[ax],
                   "inner": int(np.prod(x.shape[ax + 1:], dtype=np.int64)), "idx": idx},
                  [node.inputs[0], node.outputs[0]], desc=f"{len(idx)} of {x.shape[ax]} along axis {ax}")


@register("Copy", check=_any_dtype)
def emit_copy(node: ir.Node, g: ir.Graph) -> Kernel:
    y = g.t(node.outputs[0])
    return strided_copy(node, g, node.inputs[0], node.outputs[0], [y.size], [1], 0, f"{y.size} elements")
