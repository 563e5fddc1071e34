"""The 8-bit arithmetic's building blocks: multipliers, Q/DQ parameters, and what an operator's
QDQ match (tinydeploy/ops/*: `register(..., qdq=...)`) needs to turn a DQ -> op -> Q island into an
integer operator: the island's context (QCtx), per-channel weight parameters, the bias in
accumulator units, the requantisation multipliers as int32 constants, and the int32 overflow
check. docs/quantization.md defines the arithmetic; quant/qdq.py is the pass; quant/exact.py the
numpy reference."""
from __future__ import annotations

import functools
import math

import numpy as np

from tinydeploy import ir

QTYPES = (np.dtype(np.int8), np.dtype(np.uint8))


# --------------------------------------------------------------------------------------------
# Fixed-point requantisation (the C kernels implement exactly this)

def quantize_multiplier(r: float) -> tuple[int, int]:
    """(M, S) with r ~= M * 2**-S, 2**30 <= M < 2**31 and 1 <= S <= 62. Exact for any float32
    r in [2**-31, 2**30) (a float32 has 24 significant bits, M keeps 31). Smaller r lose low bits
    (M may reach 0: the output is then the zero point); larger r saturate every nonzero input."""
    r = float(r)
    if not (r > 0.0) or not math.isfinite(r):
        return 0, 1
    mant, exp = math.frexp(r)                      # r = mant * 2**exp, 0.5 <= mant < 1
    m = int(round(mant * (1 << 31)))
    if m == 1 << 31:
        m, exp = m >> 1, exp + 1
    s = 31 - exp
    if s > 62:
        m, s = int(round(m / 2.0 ** (s - 62))), 62
    if s < 1:
        m, s = (1 << 31) - 1, 1
    return m, s


# Where quantize_multiplier holds a float32 ratio well enough. Up from 2**30 it saturates. Below
# 2**-31 it keeps fewer bits, but there |acc * r| < 1 for every int32 accumulator, so what the lost
# bits can move is a rounding tie (per-channel ratios of dead channels in real models reach 1e-11);
# below the smallest normal float32 the ratio itself is not what float32 arithmetic computes.
RATIO_MIN, RATIO_MAX = 2.0 ** -126, 2.0 ** 30


def exact_ratios(*ratios) -> bool:
    """Whether every requantisation ratio lies where quantize_multiplier holds it exactly. An
    island whose ratios do not (scales of absurd magnitude) is left to run in float32 between its
    DequantizeLinear and QuantizeLinear kernels, which computes what the graph says."""
    v = np.concatenate([np.asarray(r, dtype=np.float64).reshape(-1) for r in ratios])
    return bool(np.all((v >= RATIO_MIN) & (v < RATIO_MAX)))


def ties_possible(acc_bound, m, s) -> bool:
    """Whether acc * m / 2**s can be exactly halfway between two integers for some
    |acc| <= acc_bound (per channel arrays broadcast). That needs acc * m = (2k + 1) 2**(s-1),
    i.e. v2(acc) = s - 1 - v2(m): impossible when |acc| < 2**(s - 1 - v2(m)). Kernels without
    possible ties may round half up (cheaper) with identical results."""
    for b, mm, ss in np.broadcast(np.asarray(acc_bound, dtype=object), np.asarray(m, dtype=object),
                                  np.asarray(s, dtype=object)):
        mm, ss = int(mm), int(ss)
        if mm == 0:
            continue
        tz = (mm & -mm).bit_length() - 1
        if ss - 1 - tz <= 0 or int(b) >= 1 << (ss - 1 - tz):
            return True
    return False


def qadd_ties(ta, tb, za: int, zb: int, ma: int, mb: int, s: int) -> bool:
    """Whether (a - za) * ma + (b - zb) * mb can be exactly halfway between two multiples of 2**s
    for some a of type `ta`, b of type `tb` (all 2**16 pairs tried). Kernels of a QAdd without
    ties may round half up (cheaper) with identical results."""
    if s < 1:
        return False
    a = np.arange(*_span(ta), dtype=np.int64)[:, None] - za
    b = np.arange(*_span(tb), dtype=np.int64)[None, :] - zb
    v = a * int(ma) + b * int(mb)
    return bool(np.any((v & ((1 << s) - 1)) == (1 << (s - 1))))


@functools.lru_cache(maxsize=256)
def qadd_int32(ta: str, tb: str, ty: str, za: int, zb: int, zy: int, ma: int, mb: int, s: int, lo: int,
               hi: int) -> tuple[int, int, int, int, int, int] | None:
    """The constants (ma', mb', ka, kb, c16, s') of a QAdd in int32 lanes (qadd_neon.c.j2's "int32"
    form), or None: p = (a - ka) ma' + (b - kb) mb' modulo 2^32, t = (p >> min(s', 16)) modulo
    2^16, t += c16 modulo 2^16, q = t >> (s' - 16) when s' > 16, y = clamp(q, lo, hi) with the
    type's saturation first. Every one of the 2^16 input pairs (a, b) is run through exactly that
    arithmetic here and must give the reference's y = clamp(rne(((a - za) ma + (b - zb) mb) / 2^s)
    + zy, lo, hi); the first s' (tried 16..30, then 15..1) and ma', mb' (within one of
    round(m 2^(s' - s))) that do are taken.
    `ta`, `tb`, `ty` are numpy dtype names."""
    if s < 1:
        return None
    a = np.arange(*_span(ta), dtype=np.int64)[:, None]
    b = np.arange(*_span(tb), dtype=np.int64)[None, :]
    v = (a - za) * ma + (b - zb) * mb
    q = v >> s
    r = v - (q << s)
    half = 1 << (s - 1)
    yref = np.clip(q + ((r > half) | ((r == half) & (q & 1 == 1))) + zy, lo, hi).ravel()
    tlo, thi = qrange(ty)
    inner, low, high = (yref > lo) & (yref < hi), yref == lo, yref == hi
    a_, b_ = np.broadcast_to(a, v.shape).ravel(), np.broadcast_to(b, v.shape).ravel()

    def wrap(x, bits):
        return (x + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))

    def run(ma2, mb2, ka, kb, c16, sp):
        p = wrap((a_ - ka) * ma2 + (b_ - kb) * mb2, 32)
        t = wrap(wrap(p >> min(sp, 16), 16) + c16, 16)
        return np.clip(np.clip(t >> max(sp - 16, 0), tlo, thi), lo, hi)

    near = np.array([(0, 0), (1, 0), (0, 1), (-1, 0), (0, -1), (1, 1), (-1, -1), (1, -1), (-1, 1)], np.int64)
    lo_mask, hi_mask = inner | high, inner | low
    for sp in list(range(16, 31)) + list(range(15, 0, -1)):      # where IC-like Adds find theirs first
        unit = 1 << min(sp, 16)
        m2 = np.array([round(ma * 2.0 ** (sp - s)), round(mb * 2.0 ** (sp - s))], np.int64) + near
        ok = (np.abs(m2) < 2 ** 31).all(1) & ((m2[:, 0] == 0) == (ma == 0)) & ((m2[:, 1] == 0) == (mb == 0))
        m2 = m2[ok]
        base = a_[None, :] * m2[:, :1] + b_[None, :] * m2[:, 1:]
        # per (ma', mb'): the constants c with floor((base + c) / 2^sp) = y (or beyond the clamp)
        lo_all = np.where(lo_mask, (yref << sp) - base, -(1 << 62)).max(1)
        hi_all = np.where(hi_mask, ((yref + 1) << sp) - base, 1 << 62).min(1)
        for (ma2, mb2), lo_c, hi_c in zip(m2.tolist(), lo_all.tolist(), hi_all.tolist()):
            if lo_c >= hi_c:
                continue
            # c = c16 unit - (ka ma' + kb mb'): ka, kb int16 with (-(ka ma' + kb mb') - lo_c) mod unit
            # below hi_c - lo_c
            ka = np.arange(-2 ** 15, 2 ** 15, dtype=np.int64)
            for kb in (0, 1, -1, 2, -2, 3, -3):
                k = ka * ma2 + kb * mb2
                hit = np.nonzero((-k - lo_c) % unit < hi_c - lo_c)[0]
                if hit.size == 0:
                    continue
                i = hit[np.argmin(np.abs(ka[hit] - za))]
                kk = int(k[i])
                c = lo_c + (-kk - lo_c) % unit
                c16 = wrap((c + kk) // unit, 16)
                cand = (int(ma2), int(mb2), int(ka[i]), kb, int(c16), sp)
                if np.array_equal(run(*cand), yref):
                    return cand
                break
    return None


def qadd_int32_folded(c: tuple[int, int, int, int, int, int]) -> tuple[int, int, int, int]:
    """qadd_int32's constants c = (ma', mb', ka, kb, c16, s') folded into one int32 expression
    (qadd_simd.c.j2's int32 form): (MA, MB, K, SH) with
        y = clamp(((a MA + b MB + K) mod 2^32) >> SH, type's range, then lo..hi)
    the same y as qadd_int32's arithmetic for every a, b (so, by its exhaustive check, the
    reference's). Why, with p = (a - ka) ma' + (b - kb) mb' = a ma' + b mb' - (ka ma' + kb mb')
    modulo 2^32 (products distribute over the ring):
      s' >= 16: adding c16 2^16 modulo 2^32 adds c16 to the high half modulo 2^16, which is
                (p >> 16) + c16 modulo 2^16 = t; then t >> (s' - 16) = p'' >> s'.
      s' < 16:  (p + c16 2^s') >> s' = (p >> s') + c16, and a wrap of 2^32 moves it by a multiple of
                2^(32 - s'), of 2^16: t is its low 16 bits; multiplying everything by 2^(16 - s')
                (modulo 2^32) puts those bits at 16..31, so t = p'' >> 16.
    Either way the result of the shift lies in int16, as t did."""
    ma2, mb2, ka, kb, c16, sp = c

    def wrap32(x: int) -> int:
        return (x + (1 << 31)) % (1 << 32) - (1 << 31)
    up = 1 << max(16 - sp, 0)
    k = -(ka * ma2 + kb * mb2) + c16 * (1 << min(sp, 16))
    return wrap32(ma2 * up), wrap32(mb2 * up), wrap32(k * up), max(sp, 16)


def _span(dtype) -> tuple[int, int]:
    lo, hi = qrange(dtype)
    return lo, hi + 1


def qrange(dtype) -> tuple[int, int]:
    info = np.iinfo(np.dtype(dtype))
    return int(info.min), int(info.max)


def quantize_value(v: float, scale: float, zp: int, dtype) -> int:
    """onnxruntime's QuantizeLinear of one float: saturate(nearbyint(v / scale) + zp)."""
    lo, hi = qrange(dtype)
    q = float(np.rint(np.float32(v) / np.float32(scale))) + zp
    return int(min(max(q, lo), hi))


# --------------------------------------------------------------------------------------------
# Reading Q / DQ nodes

class QInfo:
    """What a DequantizeLinear output is: src (integer tensor), per-tensor or per-axis params."""

    def __init__(self, src: str, scale: np.ndarray, zp: np.ndarray, axis: int | None, dtype, data=None):
        self.src, self.scale, self.zp, self.axis, self.dtype, self.data = src, scale, zp, axis, dtype, data

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1 and self.zp.size == 1

    @property
    def s(self) -> np.float32:
        return np.float32(self.scale.reshape(-1)[0])

    @property
    def z(self) -> int:
        return int(self.zp.reshape(-1)[0])


def _params(g: ir.Graph, node: ir.Node, x_dtype) -> tuple[np.ndarray, np.ndarray, int | None] | None:
    """(scale float32, zero point int64, axis or None) of a Q/DQ node with constant params."""
    scale = g.const(node.inputs[1]) if len(node.inputs) > 1 else None
    if scale is None or node.attrs.get("block_size", 0):
        return None
    zp = g.const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    if len(node.inputs) > 2 and node.inputs[2] and zp is None:
        return None
    if zp is None:
        zp = np.zeros(scale.shape, dtype=np.int64)
    scale = np.asarray(scale, dtype=np.float32)
    zp = np.asarray(zp).astype(np.int64)
    axis = None
    if scale.size > 1 or scale.ndim == 1 and zp.size > 1:
        axis = int(node.attrs.get("axis", 1))
    if scale.size > 1 or zp.size > 1:
        if scale.ndim != 1 or (zp.size > 1 and zp.shape != scale.shape):
            return None
    return scale.reshape(-1), zp.reshape(-1), axis


def dq_info(g: ir.Graph, node: ir.Node) -> QInfo | None:
    x = g.t(node.inputs[0])
    p = _params(g, node, x.dtype)
    if p is None:
        return None
    scale, zp, axis = p
    if axis is not None:
        axis %= max(len(x.shape), 1)
        if x.shape[axis] != scale.size:
            return None
    return QInfo(node.inputs[0], scale, zp, axis, np.dtype(x.dtype), x.data)


def q_info(g: ir.Graph, node: ir.Node) -> QInfo | None:
    """Per-tensor QuantizeLinear to int8/uint8 only (the form activations take)."""
    y = g.t(node.outputs[0])
    if np.dtype(y.dtype) not in QTYPES or node.attrs.get("saturate", 1) != 1:
        return None
    p = _params(g, node, y.dtype)
    if p is None or p[0].size != 1 or p[1].size != 1:
        return None
    return QInfo(node.outputs[0], p[0], p[1], None, np.dtype(y.dtype))


def dequantize_const(info: QInfo, shape) -> np.ndarray:
    """ONNX DequantizeLinear of constant data, in float32 like onnxruntime: (x - zp) * scale."""
    x = info.data.astype(np.int64)
    if info.axis is None:
        return ((x - info.z).astype(np.float32) * info.s).astype(np.float32)
    bshape = [1] * x.ndim
    bshape[info.axis] = -1
    return ((x - info.zp.reshape(bshape)).astype(np.float32) * info.scale.reshape(bshape)).astype(np.float32)


# --------------------------------------------------------------------------------------------
# The pass

# --------------------------------------------------------------------------------------------
# Quantisation schemes tinydeploy refuses (reported by ops.unsupported_nodes with the node name)

def scheme_problem(node: ir.Node, g: ir.Graph) -> str | None:
    """Why the quantisation scheme of Q/DQ (and dynamic-quantisation) node `node` is not
    supported, or None. The QDQ pass leaves such nodes alone, so they reach the support check."""
    if node.op in ("MatMulInteger", "ConvInteger"):
        return ("dynamic quantisation (an int32 accumulator whose scale is only known at run time) is not "
                "supported; quantise statically instead (tinydeploy quantize)")
    if node.op not in ("QuantizeLinear", "DequantizeLinear"):
        return None
    ints = [node.inputs[0] if node.op == "DequantizeLinear" else node.outputs[0]]
    if len(node.inputs) > 2 and node.inputs[2]:
        ints.append(node.inputs[2])
    for name in ints:
        t = g.tensors.get(name)
        if t is None:
            continue
        dt = np.dtype(t.dtype)
        if dt.name in ("int4", "uint4", "int2", "uint2"):
            return f"{dt.name[-1]}-bit ({dt.name}) quantisation is not supported (only 8-bit int8/uint8)"
        if dt.name.startswith("float8") or dt.name.startswith("float4"):
            return f"{dt.name} quantisation is not supported (only 8-bit integers int8/uint8)"
        if dt.kind in "iu" and dt.itemsize == 2:
            what = "activations" if not t.is_const else "weights"
            return f"16-bit ({dt.name}) {what} are not supported (only int8/uint8, and int32 biases)"
    if int(node.attrs.get("block_size", 0) or 0):
        return (f"blocked quantisation (block_size={node.attrs['block_size']}) is not supported "
                "(only per-tensor and per-channel scales)")
    for k, what in ((1, "scale"), (2, "zero point")):
        if len(node.inputs) > k and node.inputs[k] and g.const(node.inputs[k]) is None:
            return (f"{what} {node.inputs[k]!r} is not a constant (quantisation parameters must be known "
                    "at build time)")
    return None


class QCtx:
    def __init__(self, g: ir.Graph):
        self.g = g
        self.deq: dict[str, QInfo] = {}
        for n in g.nodes:
            if n.op == "DequantizeLinear" and scheme_problem(n, g) is None:
                info = dq_info(g, n)
                if info is not None:
                    self.deq[n.outputs[0]] = info

    def runtime(self, name: str) -> QInfo | None:
        """The per-tensor 8-bit integer tensor behind float tensor `name`, if it is a DQ of one."""
        info = self.deq.get(name)
        if info is None or info.data is not None or not info.per_tensor or info.dtype not in QTYPES:
            return None
        return info

    def const(self, name: str) -> QInfo | None:
        info = self.deq.get(name)
        return info if info is not None and info.data is not None else None


def sole_use(g: ir.Graph, name: str, user: ir.Node) -> bool:
    """Whether `user` is the only reader of tensor `name` (read once, not a graph output): an
    island may then swallow the node that makes it."""
    if name in g.outputs:
        return False
    users = g.consumers(name)
    return len(users) == 1 and users[0] is user and user.inputs.count(name) == 1


def channel_params(info: QInfo, n_out: int, axis: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-output-channel (scale, zp) arrays of a weight DQ, when its axis is the output axis."""
    if info.axis is None:
        return np.full(n_out, info.s, np.float32), np.full(n_out, info.z, np.int64)
    if info.axis != axis or info.scale.size != n_out:
        return None
    zp = info.zp if info.zp.size == n_out else np.full(n_out, info.zp[0], np.int64)
    return info.scale.astype(np.float32), zp


def weights_minus_zp(w: np.ndarray, zp_w: np.ndarray, bshape) -> np.ndarray:
    """w - zp_w, kept in the weight type when the zero point is 0, else int16."""
    if not np.any(zp_w):
        return np.ascontiguousarray(w)
    return np.ascontiguousarray((w.astype(np.int32) - zp_w.reshape(bshape)).astype(np.int16))


BIAS_ROUNDING_MAX_LSB = 2.0 ** -10   # how far rounding a bias to accumulator units may move an output


def bias_acc(g: ir.Graph, ctx: QCtx, name: str, n_out: int, acc_scale: np.ndarray, beta: float = 1.0,
             r: np.ndarray | None = None) -> np.ndarray | None:
    """The bias in accumulator units (real / (s_x * s_w[c])), int64 [n_out]; None when it does not
    fit them: not finite or beyond int64, or, given the requantisation ratios `r` (output LSBs
    per accumulator unit), when rounding it moves an output by more than BIAS_ROUNDING_MAX_LSB
    (a bias whose scale is far from s_x * s_w: the island then stays float32, as the graph says)."""
    if not name:
        return np.zeros(n_out, np.int64)
    info = ctx.const(name)
    if info is not None:
        b = info.data.reshape(-1).astype(np.int64)
        if b.size not in (1, n_out):
            return None
        b = np.broadcast_to(b, (n_out,))
        sb = np.broadcast_to(info.scale.astype(np.float32), (n_out,)) if info.scale.size in (1, n_out) else None
        zb = np.broadcast_to(info.zp, (n_out,)) if info.zp.size in (1, n_out) else None
        if sb is None or zb is None:
            return None
        if beta == 1.0 and np.array_equal(sb, acc_scale) and not np.any(zb):
            return b.copy()
        real = (b - zb).astype(np.float64) * sb.astype(np.float64) * beta
    else:
        data = g.const(name)
        if data is None or data.dtype.kind != "f" or data.size not in (1, n_out):
            return None
        real = np.broadcast_to(data.reshape(-1).astype(np.float64), (n_out,)) * beta
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        acc = np.where(acc_scale > 0, real / acc_scale.astype(np.float64), 0.0)
    if not np.all(np.isfinite(acc)) or np.abs(acc).max(initial=0.0) >= 2.0 ** 62:
        return None
    whole = np.rint(acc)
    if r is not None and (np.abs(acc - whole) * np.abs(np.asarray(r, np.float64))).max(initial=0.0) > BIAS_ROUNDING_MAX_LSB:
        return None
    return whole.astype(np.int64)


def add_multipliers(g: ir.Graph, base: str, r: np.ndarray) -> tuple[str, str]:
    ms = [quantize_multiplier(float(v)) for v in r.reshape(-1)]
    mname, sname = g.fresh_name(base + "_qmult"), g.fresh_name(base + "_qshift")
    g.tensors[mname] = ir.Tensor(mname, (len(ms),), np.dtype(np.int32), data=np.array([m for m, _ in ms], np.int32))
    g.tensors[sname] = ir.Tensor(sname, (len(ms),), np.dtype(np.int32), data=np.array([s for _, s in ms], np.int32))
    return mname, sname


def add_const(g: ir.Graph, base: str, data: np.ndarray) -> str:
    name = g.fresh_name(base)
    g.tensors[name] = ir.Tensor(name, tuple(data.shape), data.dtype, data=data)
    return name


def fit_int32(a: np.ndarray, w: np.ndarray | None = None, x_dtype=None, zp_x: int = 0) -> np.ndarray | None:
    """a as int32, or None when it, or an accumulator starting from it and adding
    sum |x - zp_x| * |w| over a row of w (worst case input), could leave the int32 range."""
    if a.size and (a.min() < -2**31 or a.max() >= 2**31):
        return None
    if w is not None:
        lo, hi = qrange(x_dtype)
        xmax = max(abs(lo), abs(hi), abs(lo - zp_x), abs(hi - zp_x))
        worst = np.abs(a.astype(np.int64)) + xmax * np.abs(w.reshape(a.size, -1).astype(np.int64)).sum(axis=1)
        if worst.max(initial=0) >= 2**31:
            return None
    return a.astype(np.int32)


def add_multiplier_pair(ra: float, rb: float) -> tuple[int, int, int]:
    """Ma, Mb, S with ra ~= Ma 2**-S, rb ~= Mb 2**-S, max(Ma, Mb) < 2**31, S <= 62."""
    top = max(ra, rb)
    if not (top > 0) or not math.isfinite(top):
        return 0, 0, 1
    _, exp = math.frexp(top)
    s = min(62, 31 - exp)
    if s < 1:
        return min((1 << 31) - 1, int(round(ra * 2))), min((1 << 31) - 1, int(round(rb * 2))), 1
    ma, mb = int(round(ra * 2.0 ** s)), int(round(rb * 2.0 ** s))
    ma, mb = min(ma, (1 << 31) - 1), min(mb, (1 << 31) - 1)
    return ma, mb, s


def softmax_table(x_scale: float, n: int) -> list[float]:
    """The float32 exponentials of QSoftmax: table[i] = float32(exp((i - 255 + b) * s_x)) computed
    in double, for the 256 possible values of x - max (i = x - max + 255). b = max(0, ln(FLT_MAX /
    n) - 5) / s_x shifts every entry by the same factor e^(b s_x), which cancels in e_k / sum but
    keeps entries from underflowing to 0 for large s_x and the sum of n entries finite."""
    xs = float(np.float32(x_scale))
    b = max(0.0, math.log(float(np.finfo(np.float32).max) / n) - 5.0) / xs
    table = [float(np.float32(math.exp((i - 255 + b) * xs))) for i in range(256)]
    return table
