"""Activations as data: what a fused epilogue computes, not how it is written in C.

The fusion pass (passes/fuse_activations.py) folds a Relu, Clip or LeakyRelu that follows a
convolution, dense layer or binary op into that node as `node.attrs["_act"]`, an Activation.
Everything downstream asks it what it needs: the kernel templates a C expression over `v`
(`c_expr`), the register-blocked micro-kernels their vector steps (`vector_steps`), the tuning
database a stable name (`name`), the exact reference its values (`apply`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from tinydeploy.codegen.cfmt import c_float

FUSABLE_ONNX = ("Relu", "LeakyRelu", "Clip")   # ONNX operators an epilogue can take over


@dataclass(frozen=True)
class Activation:
    kind: str = "linear"            # "linear", "relu", "clip", "leaky_relu"
    lo: float | None = None         # clip: bounds (float32 values), None where unbounded
    hi: float | None = None
    alpha: float | None = None      # leaky_relu: the slope below zero

    @staticmethod
    def of(op: str, attrs: dict, lo: float | None = None, hi: float | None = None) -> "Activation":
        """The activation an ONNX Relu, LeakyRelu or Clip (with its constant bounds) computes."""
        if op == "Relu":
            return Activation("relu")
        if op == "LeakyRelu":
            return Activation("leaky_relu", alpha=float(attrs.get("alpha", 0.01)))
        if op == "Clip":
            return Activation("clip", None if lo is None else float(lo), None if hi is None else float(hi))
        raise KeyError(op)

    @property
    def is_linear(self) -> bool:
        return self.kind == "linear"

    def c_expr(self, v: str = "v") -> str:
        """A C expression of the activated float `v`."""
        if self.kind == "relu":
            return f"({v} > 0.0f ? {v} : 0.0f)"
        if self.kind == "leaky_relu":
            return f"({v} >= 0.0f ? {v} : {c_float(self.alpha)} * {v})"
        e = v
        if self.kind == "clip":
            if self.lo is not None:
                e = f"({e} < {c_float(self.lo)} ? {c_float(self.lo)} : {e})"
            if self.hi is not None:
                e = f"({e} > {c_float(self.hi)} ? {c_float(self.hi)} : {e})"
        return e

    def vector_steps(self) -> list[tuple[str, str]] | None:
        """The activation as steps the micro-kernels apply in vector registers: ("relu", ""),
        ("lo", bound), ("hi", bound); [] for none; None when it has no exact vector form (the
        drivers' scalar epilogue then applies c_expr)."""
        if self.kind == "linear":
            return []
        if self.kind == "relu":
            return [("relu", "")]
        if self.kind == "clip":
            return ([("lo", c_float(self.lo))] if self.lo is not None else []) + \
                   ([("hi", c_float(self.hi))] if self.hi is not None else [])
        return None

    @property
    def name(self) -> str:
        """A stable name for layer signatures (the tuning database keys): linear, relu,
        clip lo 0.0f hi 6.0f, or act <hash of the C expression>."""
        steps = self.vector_steps()
        if steps == []:
            return "linear"
        if steps == [("relu", "")]:
            return "relu"
        if steps is not None:
            return "clip" + "".join(f" {kind} {val}" for kind, val in steps)
        return "act " + hashlib.sha256(self.c_expr().encode()).hexdigest()[:10]

    def apply(self, x: np.ndarray) -> np.ndarray:
        """The activation of float32 values, as the C computes it."""
        x = np.asarray(x, np.float32)
        if self.kind == "relu":
            return np.where(x > 0, x, np.float32(0))
        if self.kind == "leaky_relu":
            return np.where(x >= 0, x, (np.float32(self.alpha) * x).astype(np.float32))
        if self.kind == "clip":
            if self.lo is not None:
                x = np.where(x < np.float32(self.lo), np.float32(self.lo), x)
            if self.hi is not None:
                x = np.where(x > np.float32(self.hi), np.float32(self.hi), x)
        return x


LINEAR = Activation()
