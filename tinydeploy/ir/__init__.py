"""A small typed graph: the form every pass, the planner and the code generator work on.

Tensors carry a static shape and a numpy dtype; constants carry their data. Nodes are kept in a
valid topological order (the schedule). Names are the ONNX names, which are untrusted: they are
only ever printed through `codegen.cfmt` helpers, never pasted into C or paths directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class QuantParams:
    """Affine quantisation: real = scale * (q - zero_point); per tensor or per `axis`."""
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None = None


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    data: np.ndarray | None = None       # set for constants (weights)
    quant: QuantParams | None = None
    layout: str | None = None            # e.g. "NCHW" where known; informational

    @property
    def is_const(self) -> bool:
        return self.data is not None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


@dataclass
class Node:
    op: str
    name: str
    inputs: list[str]                    # "" marks an omitted optional input
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    onnx_op: str | None = None           # original ONNX op type, kept for comments after rewrites

    def __post_init__(self):
        if self.onnx_op is None:
            self.onnx_op = self.op


@dataclass
class Graph:
    tensors: dict[str, Tensor]
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    notes: list[str] = field(default_factory=list)   # things the summary should tell the user
    # names handed out for tensors that live outside the graph (the build-time constants kernels
    # make, tinydeploy/ops/registry.py Kernel.consts), so that every name stays unique
    reserved: set[str] = field(default_factory=set)

    def t(self, name: str) -> Tensor:
        return self.tensors[name]

    def consumers(self, name: str) -> list[Node]:
        return [n for n in self.nodes if name in n.inputs]

    def producer(self, name: str) -> Node | None:
        for n in self.nodes:
            if name in n.outputs:
                return n
        return None

    def replace_uses(self, old: str, new: str) -> None:
        """Every node that reads tensor `old` reads `new` instead."""
        for n in self.nodes:
            n.inputs = [new if i == old else i for i in n.inputs]

    def single_consumer(self, name: str) -> Node | None:
        """The only node that reads runtime tensor `name` (once; not a graph output), else None."""
        if name in self.outputs:
            return None
        users = self.consumers(name)
        return users[0] if len(users) == 1 and users[0].inputs.count(name) == 1 else None

    def const(self, name: str) -> np.ndarray | None:
        """The data of an optional constant input ("" or missing gives None)."""
        if not name:
            return None
        t = self.tensors.get(name)
        return None if t is None else t.data

    def fresh_name(self, base: str) -> str:
        name, i = base, 1
        while name in self.tensors or name in self.reserved:
            name, i = f"{base}_{i}", i + 1
        return name

    def reserve_name(self, base: str) -> str:
        """A fresh name, kept from every later fresh_name, for a tensor outside the graph."""
        name = self.fresh_name(base)
        self.reserved.add(name)
        return name

    def prune(self) -> None:
        """Drop nodes whose outputs nobody needs, then tensors nothing refers to."""
        needed = set(self.outputs)
        kept = []
        for n in reversed(self.nodes):
            if any(o in needed for o in n.outputs):
                kept.append(n)
                needed.update(i for i in n.inputs if i)
        self.nodes = kept[::-1]
        used = set(self.inputs) | set(self.outputs)
        for n in self.nodes:
            used.update(i for i in n.inputs if i)
            used.update(n.outputs)
        self.tensors = {k: v for k, v in self.tensors.items() if k in used}
