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


# The library form's prefix (`--name`): every exported symbol, macro and file of a model starts
# with it. Letters, digits and single underscores, a letter first; `td` is tinydeploy's own
# (the classic API and the image's model table), and the prefix must stay short enough that
# `<prefix>_<role>` names remain readable.
PREFIX_MAX = 32
_PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)*")


def c_prefix_problem(name: str) -> str | None:
    """Why `name` cannot be a model's C prefix, or None when it can."""
    if not _PREFIX.fullmatch(name) or len(name) > PREFIX_MAX:
        return (f"must be a C identifier of at most {PREFIX_MAX} characters: letters, digits and single "
                "underscores, a letter first")
    if name.lower() == "td" or name.lower().startswith("td_"):
        return "td and td_... are tinydeploy's own names"
    return None


def c_prefix(stem: str) -> str:
    """A model's default C prefix from an untrusted file stem: lower case, every run of other
    characters one underscore, a leading "m" before a digit, shortened at a word boundary;
    "m_" before a name tinydeploy keeps for itself."""
    s = re.sub(r"[^a-z0-9]+", "_", stem.lower()).strip("_") or "model"
    if s[0].isdigit():
        s = "m" + s
    if len(s) > PREFIX_MAX:
        s = s[:PREFIX_MAX]
        s = (s[:s.rindex("_")] if "_" in s[PREFIX_MAX // 2:] else s).strip("_")
    return f"m_{s}"[:PREFIX_MAX].strip("_") if c_prefix_problem(s) else s


_SECTION = re.compile(r"\.?[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*")


def c_section_problem(name: str) -> str | None:
    """Why `name` cannot be a linker section (a GCC section attribute and a linker-script
    pattern), or None: dot-separated words of letters, digits and underscores, at most 64
    characters, never one of the toolchain's own (.text, .data, .bss, .rodata and their
    subsections, which the linker script already places)."""
    if not _SECTION.fullmatch(name) or len(name) > 64:
        return "must be dot-separated words of letters, digits and underscores (e.g. .dtcm or .qspi.weights)"
    if name.split(".")[1 if name.startswith(".") else 0] in ("text", "data", "bss", "rodata", "stack", "isr_vector",
                                                              "ARM", "init", "fini"):
        return "names a section the linker script already places; choose a name of your own"
    return None


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


def c_double(v: float) -> str:
    """A double as a C99 hexadecimal literal: exact, whatever the value (0x1.8p-3, not a decimal
    that the compiler rounds back)."""
    v = float(v)
    if v == 0:
        return "0.0"
    mant, exp = v.hex().split("p")
    mant = mant.rstrip("0").rstrip(".")
    return f"{mant}p{exp}"


def c_add(expr: str, k: int) -> str:
    """`expr + k` with the constant folded into the operator: `x - 128` for k = -128 (never
    `x + -128`), plain `x` for k = 0."""
    k = int(k)
    return expr if k == 0 else f"{expr} + {k}" if k > 0 else f"{expr} - {-k}"


def c_plus(k: int) -> str:
    """The term ` + k` appended to an expression, folded the same way: ` - 128`, or nothing."""
    return c_add("", k)


def c_plusf(k: int) -> str:
    """` + k` for an integer-valued float constant: ` - 128.0f`, or nothing."""
    k = int(k)
    return "" if k == 0 else f" + {k}.0f" if k > 0 else f" - {-k}.0f"


def c_mul(expr: str, k: int) -> str:
    """`expr * k`, plain `expr` for k = 1."""
    return expr if int(k) == 1 else f"{expr} * {int(k)}"


def c_div(expr: str, d: int) -> str:
    """`expr / d`, plain `expr` for d = 1."""
    return expr if int(d) == 1 else f"{expr} / {int(d)}"


def c_ceil_div(expr: str, d: int) -> str:
    """`(expr + d - 1) / d` (expr >= 0), plain `expr` for d = 1."""
    d = int(d)
    return expr if d == 1 else f"({expr} + {d - 1}) / {d}"


def c_terms(*terms) -> str:
    """A sum written without its trivial parts: each term an expression string, an integer
    (the integers are added up), or a (k, expr) pair for expr * k (expr * 1 is expr, expr * 0
    nothing). c_terms("cc", (0, "ldc"), 8) is "cc + 8"; all terms vanishing gives "0"."""
    parts, const = [], 0
    for t in terms:
        if isinstance(t, (tuple, list)):
            k, e = int(t[0]), t[1]
            if k:
                parts.append(c_mul(e, k))
        elif isinstance(t, str):
            parts.append(t)
        else:
            const += int(t)
    out = " + ".join(parts)
    if not out:
        return str(const)
    return c_add(out, const)


def c_strided(base, strides, var: str = "i") -> str:
    """base + (long)i0 * s0 + (long)i1 * s1 + ... without the zero strides and the `* 1`."""
    return c_terms(base, *[(s, f"(long){var}{k}") for k, s in enumerate(strides)])


def c_hex32(v: int) -> str:
    """A 32-bit pattern as an unsigned hex literal (its halves and bytes stay readable)."""
    return "0x%08xu" % (int(v) % (1 << 32))


def c_pair16(v: int) -> str:
    """Two int16 halves both equal to v, as one 32-bit literal (the operand of SXTAB16 / SMLAD)."""
    h = int(v) % (1 << 16)
    return c_hex32(h * 0x10001)


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
