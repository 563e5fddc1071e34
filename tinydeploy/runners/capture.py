"""Layer capture: every layer's outputs of one inference, taken from the capture build of the
same generated code (model.c with -DTD_CAPTURE calls td_capture() after each layer; `tinydeploy
validate`), and the cost of each layer on the target.

Where the tensors come from:
  * the host harness (natively, under qemu-aarch64, over ssh) keeps them as records after the
    outputs in OUT.bin (firmware_templates/host/main.c.j2): "TDL1", then step, output index,
    element type and size as 32-bit little-endian numbers, then the bytes;
  * microcontroller firmware (under QEMU or on a serial port) sends them one layer at a time
    through the protocol's `capture T%` (firmware_templates/mcu/harness.c; protocol.Device.capture).

Per-layer cost: microseconds (the host harness's -DTD_PROFILE timers) on Linux boards; the
firmware's work counter on microcontrollers: exact instructions under QEMU, DWT cycles on a real
Cortex-M board."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from tinydeploy.errors import TinydeployError

MAGIC = b"TDL1"
HEADER = struct.Struct("<4sIIII")      # magic, step, output index, element type, bytes
# element types: ONNX TensorProto numbering, as model.h's TD_FLOAT32, TD_UINT8, TD_INT8, TD_INT32
DTYPES = {1: np.dtype(np.float32), 2: np.dtype(np.uint8), 3: np.dtype(np.int8), 6: np.dtype(np.int32)}


@dataclass
class Capture:
    """One captured inference: the model's outputs, every layer's outputs by (step, output
    index) as flat arrays of their element type, and, when measured, each layer's cost."""
    outputs: list[np.ndarray]
    tensors: dict[tuple[int, int], np.ndarray]
    where: str = "here"
    emulated: bool = False
    costs: dict[int, float] = field(default_factory=dict)    # step -> cost in cost_unit
    cost_unit: str | None = None          # "us", "instructions", "cycles", "ticks"
    notes: list[str] = field(default_factory=list)


def as_array(dtype_code: int, data: bytes, source: str) -> np.ndarray:
    dt = DTYPES.get(dtype_code)
    if dt is None or len(data) % dt.itemsize:
        raise TinydeployError(f"{source} sent a layer tensor of unknown element type {dtype_code} or a size "
                              f"({len(data)} bytes) that is not a whole number of elements")
    return np.frombuffer(data, dt).copy()


def parse_records(raw: bytes, source: str = "the capture build") -> dict[tuple[int, int], np.ndarray]:
    """The records the host harness appends to OUT.bin after the outputs."""
    out, pos = {}, 0
    while pos < len(raw):
        if len(raw) - pos < HEADER.size:
            raise TinydeployError(f"{source}: the layer capture ends inside a record header (at byte {pos})")
        magic, step, index, dtype, n = HEADER.unpack_from(raw, pos)
        if magic != MAGIC:
            raise TinydeployError(f"{source}: no layer record at byte {pos} of the capture (is it a capture "
                                  "build, -DTD_CAPTURE?)")
        pos += HEADER.size
        if len(raw) - pos < n:
            raise TinydeployError(f"{source}: layer {step}'s record announces {n} bytes, {len(raw) - pos} follow")
        out[(step, index)] = as_array(dtype, raw[pos:pos + n], source)
        pos += n
    return out


def from_device(got: dict, source: str) -> dict[tuple[int, int], np.ndarray]:
    """protocol.Device.capture's tensors as arrays."""
    return {k: as_array(dt, data, source) for k, (dt, data) in got["tensors"].items()}


def cost_label(unit: str | None, emulated: bool) -> str:
    """How a per-layer cost is shown: what it counts and how far it can be trusted."""
    if unit == "instructions":
        return "instructions (exact, QEMU -icount)"
    if unit == "cycles":
        return "CPU cycles (DWT cycle counter)"
    if unit == "us":
        return "us (median, emulated: not the board's speed)" if emulated else "us (median)"
    return unit or ""
