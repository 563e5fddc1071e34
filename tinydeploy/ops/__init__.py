"""Operator registry: what each ONNX operator needs to be checked, counted and emitted.

One module per operator family. Each registers an `OpDef` per ONNX op type it handles:
  verify(node, g) -> why the node is not valid ONNX (ops/verify.py runs them all before compiling)
  check(node, g)  -> None when supported, else the reason (listed to the user with the node name)
  emit(node, g)   -> a `Kernel`: which kernel template family to instantiate, its compile-time
                     parameters, and the tensors passed to it (inputs first, then outputs)
  macs(node, g)   -> multiply-accumulates, for the summary
  view            -> the output is the input's bytes under another shape (no code, no copy)
  inplace         -> the output may share input 0's buffer (elementwise)

Kernel templates live in firmware_templates/kernels/; codegen.kernels declares which ISA variants
exist for a (family, dtype), and `ref`, the portable reference, is what every ISA falls back to.
"""
from __future__ import annotations

from tinydeploy.ops.registry import (REGISTRY, Kernel, OpDef, dtype_tag, float_only, register,  # noqa: F401
                                     unsupported_nodes, window_2d)
# Importing the families fills REGISTRY.
from tinydeploy.ops import conv, dense, elementwise, pool, reduce, shape  # noqa: E402,F401
from tinydeploy.ops import quantized  # noqa: E402,F401  (integer kernels of the QDQ pass)
