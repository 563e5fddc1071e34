"""Turning untrusted model strings and numbers into safe, deterministic C text.

Everything a model supplies (tensor and node names, doc strings) reaches generated C only
through these functions: `c_comment` for comments, `c_ident` for identifiers.
"""
from __future__ import annotations

import math
import re

import numpy as np

_UNSAFE = re.compile(r"[^\x20-\x7e]")


def printable(s: str, limit: int = 120) -> str:
    """A one-line, ASCII-only rendering of an untrusted string, for messages."""
    s = _UNSAFE.sub(lambda m: "\\x%02x" % ord(m.group()) if ord(m.group()) < 256 else "\\u%04x" % ord(m.group()), s)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def c_comment(s: str, limit: int = 100) -> str:
    """Text safe inside a /* */ comment: printable ASCII, no comment terminators, no trigraphs,
    no line-continuation backslash at the end."""
    s = printable(s, limit)
    s = s.replace("*/", "*_/").replace("/*", "/_*")
    while "??" in s:  # trigraphs are live under -std=c99 (??/ is a backslash)
        s = s.replace("??", "?_?")
    return s.rstrip("\\")


def c_ident(s: str, limit: int = 40) -> str:
    """A C identifier fragment: [A-Za-z0-9_], never empty. Callers add a unique prefix/suffix."""
    s = re.sub(r"[^A-Za-z0-9_]", "_", s)[:limit].strip("_")
    s = re.sub(r"_+", "_", s)
    return s or "x"


def c_float(v: float) -> str:
    """An exact float literal: 9 significant digits round-trip every float32."""
    v = float(v)
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "-INFINITY"
    s = "%.9g" % v
    if "e" not in s and "." not in s:
        s += ".0"
    return s + "f"


_C_TYPES = {
    np.dtype(np.float32): "float",
    np.dtype(np.int8): "int8_t",
    np.dtype(np.uint8): "uint8_t",
    np.dtype(np.int16): "int16_t",
    np.dtype(np.int32): "int32_t",
    np.dtype(np.int64): "int64_t",
}


def c_type(dtype) -> str:
    return _C_TYPES[np.dtype(dtype)]


def c_array_body(arr: np.ndarray, per_line: int = 8) -> str:
    """The initialiser list of a constant array, `per_line` values a line."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    if flat.dtype == np.float32:
        vals = [c_float(x) for x in flat.tolist()]
    elif flat.dtype == np.int64:
        vals = ["INT64_C(%d)" % x for x in flat.tolist()]
    elif flat.dtype == np.int32:
        vals = [("%d" % x) if x != -2**31 else "INT32_MIN" for x in flat.tolist()]
    else:
        vals = ["%d" % x for x in flat.tolist()]
    return ",\n".join("  " + ", ".join(vals[i:i + per_line]) for i in range(0, len(vals), per_line))


_ESC = [("\\%03o" % i) if (i < 32 or i > 126 or chr(i) in '"\\?') else chr(i) for i in range(256)]
# The same table for numpy, one 32-bit word per byte value: its escape left-aligned in 4 bytes,
# and which of those 4 bytes belong to it.
_ESC_WORD = np.array([list(e.ljust(4).encode()) for e in _ESC], np.uint8).view(np.uint32).reshape(256)
_ESC_KEEP = np.array([[c < len(e) for c in range(4)] for e in _ESC], np.bool_).view(np.uint32).reshape(256)
_CHUNK_LINES = 1 << 15   # lines escaped per numpy step (32 bytes a line: 1 MB of data, ~30 MB of work space)


def c_string_body(data, per_line: int = 32) -> str:
    """Bytes as concatenated C string literals (octal escapes are always 3 digits, so a following
    digit can never extend one). Used for large weight blobs: gcc parses a string ~12x faster
    than an initialiser list (measured: 5 M floats, 1.7 s vs 20 s and 0.3 vs 1.8 GB).

    One line per `per_line` bytes: two spaces, a literal; newlines between lines. Written by numpy
    a chunk of lines at a time (a 400 MB blob: seconds rather than a minute byte by byte): each
    byte is a row of 12 bytes, [line start '  "' + pad][its escape, padded][line end '"\\n' + pad],
    and a mask of the same shape keeps what belongs in the text, in row order."""
    buf = np.frombuffer(data, np.uint8)
    step = per_line * _CHUNK_LINES
    n = min(len(buf), step)
    rows = np.empty((n, 3), np.uint32)
    keep = np.zeros((n, 3), np.uint32)
    rows8, keep8 = rows.view(np.uint8), keep.view(np.bool_)
    rows8[:, 0:4] = np.frombuffer(b'  " ', np.uint8)
    rows8[:, 8:12] = np.frombuffer(b'"\n  ', np.uint8)
    pos = np.arange(n) % per_line            # chunks are whole lines: the same in every chunk
    keep8[:, 0:3] = (pos == 0)[:, None]
    keep8[:, 8:10] = (pos == per_line - 1)[:, None]
    parts = []
    for start in range(0, len(buf), step):
        b = buf[start:start + step]
        m = len(b)
        np.take(_ESC_WORD, b, out=rows[:m, 1])
        np.take(_ESC_KEEP, b, out=keep[:m, 1])
        keep8[m - 1, 8:10] = True            # the data's last byte ends a line
        parts.append(rows8[:m][keep8[:m]].tobytes()[:-1])   # without the line's newline: join adds them
    text = b"\n".join(parts)
    del parts
    return text.decode("ascii")
