"""The verifier: what a model must be before anything is compiled from it. It runs once, between
the import and the 8-bit lowering (pipeline.prepared_graph), on the graph as the model wrote it.

Two kinds of rules, every broken one reported at once, in one line, with the node's (sanitised)
name and the reason (`verify_graph` raises one TinydeployError):
  * the graph's invariants (`graph_problems`): it has outputs, every name is unique, every edge
    leads from a graph input, a constant or an earlier node, no tensor is empty and every size
    fits the target's C index types (kernels count elements in `int`, offsets in `long`);
  * each operator's own rules, which its module states next to its kernel
    (`register(..., verify=fn)`: fn(node, graph) -> a list of reasons): attributes against the
    inputs' shapes and types (Conv groups divide the channels and the weights agree, kernel_shape
    equals the weights, strides and dilations >= 1, pads >= 0, the window fits the padded input,
    axes in range, Q/DQ scales positive, finite and normal, ...).

The rules are those of the ONNX specification and of onnxruntime, which holds every result to
account: nothing it would refuse reaches code generation. The helpers below are what the
operators' rules share."""
from __future__ import annotations

import math

import numpy as np

from tinydeploy import ir
from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.ops.registry import REGISTRY

INT_MAX = 2**31 - 1           # C int: the kernels' loop counters and element indices
SHOWN = 8                     # problems listed in the message; the rest are counted


def verify_graph(g: ir.Graph, bytes_max: int = 2**63 - 1) -> None:
    """Raise one TinydeployError listing every problem of `g` (graph invariants, then each
    operator's rules); `bytes_max`: the largest byte offset the target's C `long` holds."""
    edges = edge_problems(g)
    problems = edges + size_problems(g, bytes_max)
    if not edges:   # operator rules follow the edges: only on a graph whose edges are sound
        problems += node_problems(g)
    if problems:
        shown = "; ".join(problems[:SHOWN])
        more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        raise TinydeployError(f"the model is invalid ({len(problems)} problem{'s' * (len(problems) != 1)}): "
                              f"{shown}{more}")


def short(name: str, limit: int = 64) -> str:
    """A long name's start and end (exported models' names often differ only at the end)."""
    text = printable(name, 10 * limit)
    return text if len(text) <= limit else text[:limit // 2 - 2] + "..." + text[-(limit - limit // 2 - 1):]


def where(node: ir.Node) -> str:
    return f"{printable(node.onnx_op or node.op, 40)} {short(node.name)!r}"


def tensor_name(name: str) -> str:
    return repr(short(name))


def graph_problems(g: ir.Graph, bytes_max: int = 2**63 - 1) -> list[str]:
    return edge_problems(g) + size_problems(g, bytes_max)


def edge_problems(g: ir.Graph) -> list[str]:
    """Outputs exist, input and node names are unique, every edge comes from a graph input, a constant or an
    earlier node."""
    out: list[str] = []
    if not g.outputs:
        out.append("the graph has no outputs (nothing to compute)")
    # (an output may be listed twice: ONNX and onnxruntime allow it, and each copy is written)
    dup = sorted({n for n in g.inputs if g.inputs.count(n) > 1})
    if dup:
        out.append(f"graph input {tensor_name(dup[0])} is listed {g.inputs.count(dup[0])} times")
    named: dict[str, int] = {}
    for n in g.nodes:
        named[n.name] = named.get(n.name, 0) + 1
    dup = sorted(k for k, v in named.items() if v > 1)
    if dup:
        out.append(f"{len(dup)} node name{'s are' if len(dup) > 1 else ' is'} used twice or more "
                   f"(first {tensor_name(dup[0])}, {named[dup[0]]} nodes); node names must be unique")
    known = set(g.inputs) | {k for k, t in g.tensors.items() if t.is_const}
    producer: dict[str, ir.Node] = {}
    for n in g.nodes:
        for i in n.inputs:
            if i and i not in known:
                why = "made by a later node" if any(i in m.outputs for m in g.nodes) else "made by no node"
                out.append(f"{where(n)} reads {tensor_name(i)}, which is {why} and is not a graph input "
                           "or a constant")
        for o in n.outputs:
            if not o:
                continue
            if o in producer or o in g.inputs or (o in g.tensors and g.t(o).is_const):
                out.append(f"{where(n)} writes {tensor_name(o)}, which "
                           + (f"{where(producer[o])} also writes" if o in producer else "is a graph input or a constant"))
            producer.setdefault(o, n)
            known.add(o)
    for o in g.outputs:
        if o not in known:
            out.append(f"graph output {tensor_name(o)} is made by no node and is not a graph input or a constant")
    return out


def size_problems(g: ir.Graph, bytes_max: int = 2**63 - 1) -> list[str]:
    """No tensor empty, none larger than the generated C's index types hold."""
    out: list[str] = []
    for name, t in g.tensors.items():
        if any(int(d) < 0 for d in t.shape):
            out.append(f"tensor {tensor_name(name)} has the shape {list(t.shape)}")
        elif t.size == 0 and not t.is_const:
            out.append(f"tensor {tensor_name(name)} is empty (shape {'x'.join(map(str, t.shape))}): tensors "
                       "with a dimension of 0 cannot be computed")
        elif t.size > INT_MAX:
            out.append(f"tensor {tensor_name(name)} has {t.size} elements ({'x'.join(map(str, t.shape))}); the "
                       f"generated C indexes elements with int, at most {INT_MAX}")
        elif t.nbytes > bytes_max:
            out.append(f"tensor {tensor_name(name)} is {t.nbytes} bytes; the target addresses at most {bytes_max}")
    return out


def node_problems(g: ir.Graph) -> list[str]:
    out = []
    for n in g.nodes:
        d = REGISTRY.get(n.op)
        if d is None:
            continue
        out.extend(f"{where(n)}: {why}" for why in d.verify(n, g))
    return out


# ---- what the operators' rules share ---------------------------------------------------------

def shape(g: ir.Graph, name: str) -> tuple[int, ...] | None:
    """The shape of an optional input ("" or unknown: None)."""
    t = g.tensors.get(name) if name else None
    return None if t is None else tuple(int(d) for d in t.shape)


def ints(node: ir.Node, name: str, default=None) -> list[int] | None:
    v = node.attrs.get(name, default)
    if v is None:
        return None
    return [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]


def axis_problem(axis: int, rank: int, what: str = "axis") -> str | None:
    if not -rank <= axis < rank:
        return f"{what} {axis} is out of range for a tensor of rank {rank} (must be in [{-rank}, {rank - 1}])"
    return None


def input_axis(node: ir.Node, g: ir.Graph, default: int = 0) -> tuple[tuple[int, ...], int, str | None]:
    """The first input's shape, the node's `axis` attribute, and what is wrong with that axis."""
    x = tuple(g.t(node.inputs[0]).shape)
    ax = int(node.attrs.get("axis", default))
    return x, ax, axis_problem(ax, len(x))


def axes_problems(axes: list[int], rank: int, what: str = "axes") -> list[str]:
    out = [p for a in axes if (p := axis_problem(a, rank, what[:-1] if what.endswith("s") else what))]
    norm = [a % rank for a in axes] if rank and not out else []
    if len(set(norm)) != len(norm):
        out.append(f"{what} {axes} name the same axis twice")
    return out


AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def window_problems(node: ir.Node, g: ir.Graph, kernel: list[int], pool: bool) -> list[str]:
    """A sliding window (Conv, MaxPool, AveragePool): kernel, strides, dilations and pads have one
    value per spatial axis (pads two) and sensible values, the window fits the padded input, and
    the output shape is the one the specification gives."""
    x, y = shape(g, node.inputs[0]), shape(g, node.outputs[0])
    out: list[str] = []
    if x is None or len(x) < 3:
        return [f"input of rank {len(x) if x is not None else '?'} (a sliding window needs N, C and at least "
                "one spatial axis)"]
    r = len(x) - 2
    auto = node.attrs.get("auto_pad", "NOTSET")
    if auto not in AUTO_PADS:
        out.append(f"auto_pad {printable(str(auto), 20)!r} is not one of {', '.join(AUTO_PADS)}")
    s, d, p = ints(node, "strides", [1] * r), ints(node, "dilations", [1] * r), ints(node, "pads", [0] * (2 * r))
    for what, v, n, lo in (("kernel_shape", kernel, r, 1), ("strides", s, r, 1), ("dilations", d, r, 1),
                           ("pads", p, 2 * r, 0)):
        if len(v) != n:
            out.append(f"{what} has {len(v)} values; the {r}-D input needs {n}")
        elif min(v) < lo:
            out.append(f"{what} {v} must all be >= {lo}")
    if out:
        return out
    if pool and auto == "NOTSET":
        for i in range(r):
            if p[i] >= kernel[i] or p[i + r] >= kernel[i]:
                out.append(f"pads {p} must be smaller than the kernel {kernel} on every axis (onnxruntime "
                           "refuses padding a whole window)")
                break
    expect = []
    for i in range(r):
        span = (kernel[i] - 1) * d[i] + 1
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            expect.append(-(-x[2 + i] // s[i]))
            continue
        padded = x[2 + i] + (0 if auto == "VALID" else p[i] + p[i + r])
        if span > padded:
            out.append(f"the window ({span} wide with dilation {d[i]}) is larger than the padded input "
                       f"({padded}) on spatial axis {i}")
            return out
        expect.append((padded - span) // s[i] + 1)
    ceil = bool(node.attrs.get("ceil_mode", 0)) if pool else False
    if y is not None and not ceil and list(y[2:]) != expect:
        out.append(f"output shape {'x'.join(map(str, y))} disagrees with the window: its spatial size must be "
                   f"{'x'.join(map(str, expect))}")
    return out


def scale_problems(scale: np.ndarray, what: str = "scale") -> list[str]:
    """Q/DQ scales: positive, finite and normal float32 numbers (0, NaN, infinities, negative and
    denormal scales have no meaning the 8-bit arithmetic can follow)."""
    s = np.asarray(scale, dtype=np.float64).reshape(-1)
    tiny = float(np.finfo(np.float32).tiny)
    bad = [v for v in s if not (math.isfinite(v) and v >= tiny)]
    if not bad:
        return []
    v = bad[0]
    kind = ("not a number" if math.isnan(v) else "infinite" if math.isinf(v) else "zero" if v == 0
            else "negative" if v < 0 else "denormal")
    return [f"{what} {v:g} is {kind}" + (f" ({len(bad)} of {s.size} values are bad)" if s.size > 1 else "")
            + "; scales must be positive, finite, normal numbers"]
