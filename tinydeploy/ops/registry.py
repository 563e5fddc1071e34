"""The operator registry (its face is tinydeploy/ops/__init__.py): what each ONNX operator needs to be checked, counted and emitted.

One module per operator family. Each registers an `OpDef` per ONNX op type it handles:
  verify(node, g) -> the reasons the node is not valid ONNX (attributes against its inputs' shapes
                     and types; ops/verify.py runs every operator's rules before anything else)
  check(node, g)  -> None when supported, else the reason (listed to the user with the node name)
  emit(node, g)   -> a `Kernel`: which kernel template family to instantiate, its compile-time
                     parameters, and the tensors passed to it (inputs first, then outputs)
  macs(node, g)   -> multiply-accumulates, for the summary
  view            -> the output is the input's bytes under another shape (no code, no copy)
  inplace         -> the output may share input 0's buffer (elementwise)
  epilogue        -> it can apply a following activation itself (passes: fuse_activations)
  moves           -> data movement that runs on 8-bit integers unchanged (the QDQ pass)
  qdq             -> its 8-bit form: turns DQ -> op [-> Relu/Clip] -> Q into an integer operator

Kernel templates live in firmware_templates/kernels/; codegen.kernels declares which ISA variants
exist for a (family, dtype), and `ref`, the portable reference, is what every ISA falls back to.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from tinydeploy import ir


@dataclass
class Kernel:
    """One layer's code: which template family renders it, with which compile-time parameters,
    reading and writing which tensors. Lowering and kernel selection leave the graph as the passes
    made it: the build-time arrays a kernel derives (weights re-laid or packed for it) are its own
    `consts`, and its run-time scratch is the argument SCRATCH (the planner's "#scratch<step>")."""
    family: str                     # template family, e.g. "conv2d"
    dtype: str                      # "f32", "s8", "u8"
    params: dict[str, Any]          # compile-time constants of this specialisation
    args: list[str]                 # tensor names: inputs (constants allowed) then outputs
    scratch_bytes: int = 0          # arena scratch the kernel needs while it runs
    desc: str = ""                  # one-line human description for the comment
    consts: dict[str, ir.Tensor] = field(default_factory=dict)   # build-time arrays it made, by name
    scratch_dtype: str = "float32"  # the C type its scratch argument points to
    # It may write its output at byte `alias` of input 0's buffer (it reads what it needs first;
    # the planner decides, and sets params["INPLACE"]); alias_free: at no cost in instructions.
    alias: int | None = None
    alias_free: bool = True
    fused: tuple[int, ...] = ()     # earlier steps it computes itself (their outputs get no buffer)
    # kernels it calls (a patch-based chain's layers): their args name their constants, "@in",
    # "@out" and "@scratch" for what the caller passes
    parts: list["Kernel"] = field(default_factory=list)

    def constants(self, g: ir.Graph) -> dict[str, ir.Tensor]:
        """Every constant it and its parts read, by name, in order of first use."""
        out = {}
        for k in [self] + self.parts:
            for a in k.args:
                if not a.startswith(("@", "#")) and a not in out and k.tensor(a, g).is_const:
                    out[a] = k.tensor(a, g)
        return out

    def tensor(self, name: str, g: ir.Graph, step: int | None = None) -> ir.Tensor:
        """An argument's tensor: one of the kernel's own constants, its scratch, or the graph's."""
        if name in self.consts:
            return self.consts[name]
        if name.startswith("#scratch"):
            dt = np.dtype(self.scratch_dtype)
            return ir.Tensor(name, (max(1, self.scratch_bytes // dt.itemsize),), dt)
        return g.t(name)


def new_const(g: ir.Graph, consts: dict, base: str, data: np.ndarray) -> str:
    """Keep `data` in `consts` (a kernel's own constants) under a fresh name; returns the name."""
    name = g.reserve_name(base)
    data = np.ascontiguousarray(data)
    consts[name] = ir.Tensor(name, tuple(data.shape), data.dtype, data=data)
    return name


def scratch_arg(step: int) -> str:
    """The argument that stands for layer `step`'s scratch (the planner places "#scratch<step>")."""
    return f"#scratch{step}"


@dataclass
class OpDef:
    op: str
    emit: Callable[[ir.Node, ir.Graph], Kernel | None]
    check: Callable[[ir.Node, ir.Graph], str | None] = lambda n, g: None
    verify: Callable[[ir.Node, ir.Graph], list[str]] = lambda n, g: []
    macs: Callable[[ir.Node, ir.Graph], int] = lambda n, g: 0
    view: bool = False
    inplace: bool = False
    epilogue: bool = False    # can take a following Relu/Clip/LeakyRelu as its epilogue (node.attrs["_act"])
    moves: str = ""           # data movement that runs on 8-bit integers as they are, between a DQ and a Q
                              # of equal parameters: "first" (input 0 is the data) or "all" (every input)


REGISTRY: dict[str, OpDef] = {}
# op -> QDQ matches, tried in order by the QDQ pass (quant/qdq.py): fn(ctx, node, yq, lo, hi) turns
# the island DQ -> node [-> Relu/Clip] -> Q into one integer node (or (node, nodes it replaces)),
# or returns None. An operator registers its own with register(..., qdq=fn); a pattern that
# starts at another operator's node (MatMul -> Add(bias) -> Q) with register_qdq.
QDQ_MATCHERS: dict[str, list[Callable]] = {}


def register(op: str, qdq: Callable | None = None, **kw):
    def deco(fn):
        REGISTRY[op] = OpDef(op, fn, **kw)
        if qdq is not None:
            register_qdq(op, qdq)
        return fn
    return deco


def register_qdq(op: str, match: Callable) -> None:
    QDQ_MATCHERS.setdefault(op, []).append(match)


def qdq_matchers(op: str) -> list[Callable]:
    return QDQ_MATCHERS.get(op, [])


def dtype_tag(dtype) -> str:
    return {np.dtype(np.float32): "f32", np.dtype(np.int8): "s8", np.dtype(np.uint8): "u8",
            np.dtype(np.int32): "s32"}.get(np.dtype(dtype), str(np.dtype(dtype)))


def float_only(node: ir.Node, g: ir.Graph, which=None) -> str | None:
    """The common check: the listed runtime tensors (default: all) must be float32."""
    names = which if which is not None else [i for i in node.inputs if i] + node.outputs
    for name in names:
        t = g.tensors.get(name)
        if t is not None and not t.is_const and t.dtype != np.float32:
            return f"{np.dtype(t.dtype).name} tensors are not supported"
    return None


def window_2d(node: ir.Node, g: ir.Graph, kernel_shape: list[int]) -> dict:
    """Sliding-window geometry of a Conv or pool as 2-D NCHW numbers (1-D windows get H = 1):
    input/output shapes, kernel, strides, dilations and the four pads, auto_pad resolved."""
    x, y = g.t(node.inputs[0]), g.t(node.outputs[0])
    rank = len(x.shape) - 2
    a = node.attrs
    k = list(kernel_shape)
    s = list(a.get("strides", [1] * rank))
    d = list(a.get("dilations", [1] * rank))
    pads = list(a.get("pads", [0] * (2 * rank)))
    xs, ys = list(x.shape), list(y.shape)
    auto = a.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        for i in range(rank):
            total = max(0, (ys[2 + i] - 1) * s[i] + (k[i] - 1) * d[i] + 1 - xs[2 + i])
            small, big = total // 2, total - total // 2
            pads[i], pads[i + rank] = (small, big) if auto == "SAME_UPPER" else (big, small)
    elif auto == "VALID":
        pads = [0] * (2 * rank)
    if rank == 1:
        xs.insert(2, 1), ys.insert(2, 1)
        k, s, d, pads = [1] + k, [1] + s, [1] + d, [0, pads[0], 0, pads[1]]
    return {"xs": xs, "ys": ys, "KH": k[0], "KW": k[1], "SH": s[0], "SW": s[1], "DH": d[0], "DW": d[1],
            "PT": pads[0], "PL": pads[1], "PB": pads[2], "PR": pads[3]}


def unsupported_nodes(g: ir.Graph) -> list[tuple[ir.Node, str]]:
    from tinydeploy.quant.params import scheme_problem
    out = []
    for n in g.nodes:
        why = scheme_problem(n, g)   # 4-bit, float8, 16-bit, blocked, run-time scales
        if why:
            out.append((n, why))
            continue
        d = REGISTRY.get(n.op)
        if d is None:
            out.append((n, "no kernel"))
            continue
        why = d.check(n, g)
        if why:
            out.append((n, why))
    return out
