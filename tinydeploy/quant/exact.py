"""tinydeploy's exact 8-bit reference: the arithmetic of docs/quantization.md, in numpy.

Every integer operator the QDQ pass (tinydeploy/quant/) makes is defined here once more,
independently of the C kernels and of onnxruntime, so that each kernel variant (the portable
reference, the Cortex-M4 DSP kernels, any SIMD kernel to come) can be held against it bit for
bit on any machine: the results do not depend on the CPU this runs on. Integer steps are exact
(int64, or float64 where every value is an integer below 2**53); the float32 steps the
definition keeps (the requantisation of QConv/QDense, average pooling, Softmax, Quantize /
DequantizeLinear) are done in numpy float32, one IEEE operation at a time in the order the
definition gives, which is what the C kernels compile to (`-std=c99`: no contraction into FMA).

`run_model(path, feeds)` evaluates a whole model: the graph as the QDQ pass leaves it, integer
operators by the functions below, every other operator (data movement, float islands) by onnx's
own reference evaluator, whose meaning is the ONNX specification's. Float islands are therefore
not bit-exact with the C (a float32 `expf` may differ by an ulp); graphs of integer operators and
data movement, the usual form of 8-bit models, are.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tinydeploy import ir
from tinydeploy.errors import TinydeployError

_EXACT_F64 = 2 ** 53     # float64 holds every integer below this exactly


# ---- the two requantisations ---------------------------------------------------------------

def requant_exact(acc, m, s, zy: int, lo: int, hi: int) -> np.ndarray:
    """clamp(zy + round_half_even(acc * m / 2**s), lo, hi), in exact integer arithmetic
    (QAdd, QRequantize, QMaxPool with a change of scale, QGlobalMaxPool)."""
    acc = np.asarray(acc, np.int64)
    m = np.asarray(m, np.int64)
    s = np.asarray(s, np.int64)
    if acc.size and int(np.abs(acc).max()) * int(np.abs(m).max(initial=1)) >= 2 ** 62:
        raise ValueError("requant_exact: |acc * m| must stay below 2**62")
    p = acc * m
    q = p >> s
    rem = p & ((np.int64(1) << s) - 1)
    half = np.int64(1) << (s - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(np.int64)
    return np.clip(q + zy, lo, hi)


def requant_f32(acc, m, s, zy: int, lo: int, hi: int) -> np.ndarray:
    """The float32 requantisation of QConv and QDense: v = float32(acc) * r with
    r = float32(m) * 2**-s (exactly the float32 s_x * s_w / s_y), clamped to [lo - zy, hi - zy],
    rounded half to even, plus zy."""
    r = (np.asarray(m, np.int64).astype(np.float32) * np.ldexp(np.float32(1.0), -np.asarray(s, np.int64))
         .astype(np.float32)).astype(np.float32)
    v = np.asarray(acc, np.int64).astype(np.float32) * r
    v = np.clip(v, np.float32(lo - zy), np.float32(hi - zy)).astype(np.float32)
    return np.rint(v).astype(np.int64) + zy


# ---- what a float evaluation rounds ---------------------------------------------------------
# Next to its result, each operator gives `real`: the value the rounding acts on, in output LSBs
# before the zero point (acc * s_x * s_w / s_y for a convolution), computed in float64 from the
# exact integers; and `margin`: a bound on how far a float32 evaluation of the same ONNX graph
# (DequantizeLinear -> float32 op -> QuantizeLinear, any summation order) can stray from it.
# Where tinydeploy and such an evaluation differ by one LSB and `real` lies within `margin` of
# k + 1/2, the two sit on either side of a rounding tie: neither is wrong. That is how a result
# is told apart from a fault (reference.layerwise).

_ULP = 2.0 ** -24        # float32 unit roundoff


class Exact(tuple):
    """(y, real, margin) of one operator; real and margin are None for operators that do not
    round (data movement, max pooling without a change of scale)."""

    def __new__(cls, y, real=None, margin=None):
        return super().__new__(cls, (y, real, margin))


def _real(acc, mag, m, s, terms: int, shape) -> tuple[np.ndarray, np.ndarray]:
    """real = acc * r, margin = (terms + 4) ulps of the summed magnitudes, r = m * 2**-s."""
    r = np.asarray(m, np.float64) * np.ldexp(1.0, -np.asarray(s, np.int64))
    return (acc * r).reshape(shape), (mag * np.abs(r) * (terms + 4) * _ULP).reshape(shape)


# ---- sliding windows -----------------------------------------------------------------------

def _as_nchw(x: np.ndarray) -> np.ndarray:
    return x[:, :, None, :] if x.ndim == 3 else x


def _taps(geo: dict, oh: int, ow: int):
    """For each kernel tap (ky, kx): the input rows and columns it reads for every output
    position, and which of them lie inside the input (taps in the padding read nothing)."""
    iy = np.arange(oh) * geo["SH"] - geo["PT"]
    ix = np.arange(ow) * geo["SW"] - geo["PL"]
    for ky in range(geo["KH"]):
        ry = iy + ky * geo["DH"]
        vy = (ry >= 0) & (ry < geo["H"])
        for kx in range(geo["KW"]):
            rx = ix + kx * geo["DW"]
            vx = (rx >= 0) & (rx < geo["W"])
            yield ky, kx, np.clip(ry, 0, geo["H"] - 1), np.clip(rx, 0, geo["W"] - 1), vy[:, None] & vx[None, :]


def _window_geometry(node: ir.Node, g: ir.Graph, kernel_shape) -> dict:
    from tinydeploy.ops import window_2d
    p = window_2d(node, g, kernel_shape)
    xs, ys = p.pop("xs"), p.pop("ys")
    p.update(H=xs[2], W=xs[3], OH=ys[2], OW=ys[3])
    return p


def patches(node: ir.Node, g: ir.Graph, x: np.ndarray, kernel_shape, fill: int) -> np.ndarray:
    """What each output position of a 2-D window operator reads: [n, taps (row-major), C, OH * OW],
    `fill` where a tap lies in the padding (im2col with the kernel taps outermost)."""
    geo = _window_geometry(node, g, kernel_shape)
    x4 = _as_nchw(x).astype(np.int64)
    cols = [np.where(valid, x4[:, :, ry[:, None], rx[None, :]], fill).reshape(x4.shape[0], x4.shape[1], -1)
            for _, _, ry, rx, valid in _taps(geo, geo["OH"], geo["OW"])]
    return np.stack(cols, axis=1)


# ---- integer operators -----------------------------------------------------------------------

def qconv(node: ir.Node, g: ir.Graph, x: np.ndarray) -> Exact:
    """acc = bias' + sum (x - zx) w' over the taps inside the input (zx only where the pass
    kept it in the loop: with padding and a nonzero zx; otherwise it is in bias'), then the
    float32 requantisation per output channel."""
    q = node.attrs["_q"]
    w = g.t(node.inputs[1]).data.astype(np.int64)
    b = g.t(node.inputs[2]).data.astype(np.int64)
    m, s = g.t(node.inputs[3]).data, g.t(node.inputs[4]).data
    geo = _window_geometry(node, g, list(w.shape[2:]))
    y_shape = g.t(node.outputs[0]).shape
    zx_loop = q["zx"] if q["zp_in_loop"] else 0
    x4 = _as_nchw(x).astype(np.int64) - zx_loop
    n, c = x4.shape[:2]
    mo = w.shape[0]
    grp = int(node.attrs.get("group", 1))
    cg, mg = c // grp, mo // grp
    kk = cg * geo["KH"] * geo["KW"]
    if kk * 255 * 255 >= _EXACT_F64:
        raise TinydeployError("exact reference: reduction too long for exact float64 sums")
    oh, ow = geo["OH"], geo["OW"]
    acc = np.zeros((n, grp, mg, oh * ow), np.float64)
    mag = np.zeros_like(acc)
    # |x - zx| of the real input: the magnitudes a float evaluation sums (zx folded or not)
    xg = x4.reshape(n, grp, cg, geo["H"], geo["W"]).astype(np.float64)
    xa = np.abs(xg + zx_loop - q["zx"])
    wg = w.reshape(grp, mg, cg, geo["KH"], geo["KW"]).astype(np.float64)
    for ky, kx, ry, rx, valid in _taps(geo, oh, ow):
        xs = xg[:, :, :, ry[:, None], rx[None, :]] * valid            # [n, grp, cg, oh, ow]
        acc += np.matmul(wg[:, :, :, ky, kx], xs.reshape(n, grp, cg, oh * ow))
        xas = xa[:, :, :, ry[:, None], rx[None, :]] * valid
        mag += np.matmul(np.abs(wg[:, :, :, ky, kx]), xas.reshape(n, grp, cg, oh * ow))
    acc = acc.reshape(n, mo, oh * ow).astype(np.int64) + b[None, :, None]
    mc, sc = m[None, :, None], s[None, :, None]
    y = requant_f32(acc, mc, sc, q["zy"], q["lo"], q["hi"])
    return Exact(y.reshape(y_shape), *_real(acc, mag.reshape(acc.shape), mc, sc, kk, y_shape))


def qdense(node: ir.Node, g: ir.Graph, x: np.ndarray) -> Exact:
    """acc = bias' + x . w'^T (zx folded into bias'), float32 requantisation per column."""
    q = node.attrs["_q"]
    w = g.t(node.inputs[1]).data.astype(np.float64)                  # [N, K]
    b = g.t(node.inputs[2]).data.astype(np.int64)
    m, s = g.t(node.inputs[3]).data, g.t(node.inputs[4]).data
    k = w.shape[1]
    if k * 255 * 255 >= _EXACT_F64:
        raise TinydeployError("exact reference: reduction too long for exact float64 sums")
    x2 = x.reshape(-1, k).astype(np.float64)
    acc = (x2 @ w.T).astype(np.int64) + b[None, :]
    mag = np.abs(x2 - q["zx"]) @ np.abs(w.T)
    yshape = g.t(node.outputs[0]).shape
    y = requant_f32(acc, m[None, :], s[None, :], q["zy"], q["lo"], q["hi"])
    return Exact(y.reshape(yshape), *_real(acc, mag, m[None, :], s[None, :], k, yshape))


def qadd(node: ir.Node, g: ir.Graph, a: np.ndarray, b: np.ndarray) -> Exact:
    """y = requant_exact((a - za) * Ma + (b - zb) * Mb, 1, S), numpy broadcasting."""
    q = node.attrs["_q"]
    va, vb = (a.astype(np.int64) - q["za"]) * q["ma"], (b.astype(np.int64) - q["zb"]) * q["mb"]
    y = requant_exact(va + vb, 1, q["s"], q["zy"], q["lo"], q["hi"])
    unit = 2.0 ** -q["s"]
    return Exact(y, (va + vb) * unit, (np.abs(va) + np.abs(vb)) * unit * 3 * _ULP)


def qrequantize(node: ir.Node, g: ir.Graph, x: np.ndarray) -> Exact:
    q = node.attrs["_q"]
    v = x.astype(np.int64) - q["zx"]
    y = requant_exact(v, q["m"], q["s"], q["zy"], q["lo"], q["hi"])
    real = v * (q["m"] * 2.0 ** -q["s"])
    return Exact(y, real, np.abs(real) * 3 * _ULP)


def _pool_windows(node: ir.Node, g: ir.Graph, x: np.ndarray):
    geo = _window_geometry(node, g, node.attrs["kernel_shape"])
    x4 = _as_nchw(x)
    return geo, x4.reshape(-1, geo["H"], geo["W"])


def qmaxpool(node: ir.Node, g: ir.Graph, x: np.ndarray) -> Exact:
    """The integer maximum over the taps inside the input; requantised exactly when the output's
    scale or zero point differs from the input's, else only clamped."""
    q = node.attrs["_q"]
    geo, xp = _pool_windows(node, g, x)
    lo_t = int(np.iinfo(x.dtype).min)
    acc = np.full((xp.shape[0], geo["OH"], geo["OW"]), lo_t, np.int64)
    for _, _, ry, rx, valid in _taps(geo, geo["OH"], geo["OW"]):
        acc = np.where(valid, np.maximum(acc, xp[:, ry[:, None], rx[None, :]].astype(np.int64)), acc)
    oshape = g.t(node.outputs[0]).shape
    if q["identity"]:
        return Exact(np.clip(acc, q["lo"], q["hi"]).reshape(oshape))
    return _requant_max(acc - q["zx"], q, oshape)


def _requant_max(v: np.ndarray, q: dict, shape) -> Exact:
    y = requant_exact(v, q["m"], q["s"], q["zy"], q["lo"], q["hi"])
    real = v * (q["m"] * 2.0 ** -q["s"])
    return Exact(y.reshape(shape), real.reshape(shape), (np.abs(real) * 3 * _ULP).reshape(shape))


def _avg_constants(node: ir.Node, x_dtype, window: int) -> tuple[np.ndarray, np.float32, np.float32]:
    """The float32 constants of average pooling: DQ[b], the dequantised value of the byte b
    (s_x * (x - zx), indexed by the byte as the C's 256-entry table is), s_y, and the global
    factor R = s_x / (s_y * window)."""
    q = node.attrs["_q"]
    xs, ys = np.float32(q["xs"]), np.float32(q["ys"])
    vals = np.arange(256, dtype=np.int64).astype(np.uint8).view(np.dtype(x_dtype)).astype(np.int64)
    dq = (xs * (vals - q["zx"]).astype(np.float32)).astype(np.float32)
    r = np.float32(xs / np.float32(ys * np.float32(window)))
    return dq, ys, r


def _global_avg(acc: np.ndarray, r: np.float32, zy: int, lo: int, hi: int) -> np.ndarray:
    """rint(float32(acc) * R) + zy, clamped: a global average pool's float32 step."""
    v = np.rint((acc.astype(np.float32) * r).astype(np.float32)) + np.float32(zy)
    return np.clip(v, lo, hi).astype(np.int64)


def _avg_real(total, mag, count, q: dict, terms: int):
    """The exact average in output LSBs, and its float32 margin."""
    k = float(np.float32(q["xs"])) / float(np.float32(q["ys"]))
    return total * k / count, mag * k / count * (terms + 4) * _ULP


def qavgpool(node: ir.Node, g: ir.Graph, x: np.ndarray) -> Exact:
    """Float32, in the order the definition gives: the dequantised window summed tap by tap
    (rows, then columns), divided by the count (taps inside the input; the kernel size with
    count_include_pad), divided by s_y, rounded half to even, plus zy. A window covering the
    whole unpadded input is a global average: integer sum, one float32 factor."""
    q = node.attrs["_q"]
    geo, xp = _pool_windows(node, g, x)
    kk = geo["KH"] * geo["KW"]
    dq, ys, r = _avg_constants(node, x.dtype, kk)
    oshape = g.t(node.outputs[0]).shape
    xi = xp.astype(np.int64)
    exact_sum = np.zeros((xp.shape[0], geo["OH"], geo["OW"]), np.int64)
    mag = np.zeros(exact_sum.shape, np.int64)
    for _, _, ry, rx, valid in _taps(geo, geo["OH"], geo["OW"]):
        v = np.where(valid, xi[:, ry[:, None], rx[None, :]] - q["zx"], 0)
        exact_sum += v
        mag += np.abs(v)
    if (geo["KH"], geo["KW"]) == (geo["H"], geo["W"]) and not any((geo["PT"], geo["PL"], geo["PB"], geo["PR"])):
        y = _global_avg(exact_sum, r, q["zy"], q["lo"], q["hi"])
        return Exact(y.reshape(oshape), *(a.reshape(oshape) for a in _avg_real(exact_sum, mag, kk, q, kk)))
    idx = xi & 0xFF                                    # the table is indexed by the byte
    total = np.zeros(exact_sum.shape, np.float32)
    count = np.zeros((geo["OH"], geo["OW"]), np.int64)
    for _, _, ry, rx, valid in _taps(geo, geo["OH"], geo["OW"]):
        total = (total + np.where(valid, dq[idx[:, ry[:, None], rx[None, :]]], np.float32(0))).astype(np.float32)
        count += valid
    if node.attrs.get("count_include_pad", 0):
        count[:] = kk
    count = np.where(count > 0, count, 1)
    v = (total / count.astype(np.float32)).astype(np.float32)
    v = np.rint((v / ys).astype(np.float32)) + np.float32(q["zy"])
    y = np.clip(v, q["lo"], q["hi"]).astype(np.int64)
    return Exact(y.reshape(oshape), *(a.reshape(oshape) for a in _avg_real(exact_sum, mag, count, q, kk)))


def qglobalpool(node: ir.Node, g: ir.Graph, x: np.ndarray) -> Exact:
    """Average: integer sum minus HW * zx, times R in float32, rounded, plus zy. Max: the integer
    maximum minus zx, requantised exactly."""
    q = node.attrs["_q"]
    nc = x.shape[0] * x.shape[1]
    xs = x.reshape(nc, -1).astype(np.int64)
    hw = xs.shape[1]
    oshape = g.t(node.outputs[0]).shape
    if node.op == "QGlobalMaxPool":
        return _requant_max(xs.max(axis=1) - q["zx"], q, oshape)
    acc = xs.sum(axis=1) - hw * q["zx"]
    y = _global_avg(acc, _avg_constants(node, x.dtype, hw)[2], q["zy"], q["lo"], q["hi"])
    real, margin = _avg_real(acc, np.abs(xs - q["zx"]).sum(axis=1), hw, q, hw)
    return Exact(y.reshape(oshape), real.reshape(oshape), margin.reshape(oshape))


def qsoftmax(node: ir.Node, g: ir.Graph, x: np.ndarray) -> Exact:
    """e_k = table[x_k - max + 255]; sum of the e_k in float32 in index order; p_k = e_k / sum;
    y_k = rint(p_k / s_y) + zy, clamped (all float32; quant.softmax_table)."""
    q = node.attrs["_q"]
    ax = node.attrs["axis"]
    table = np.array(q["table"], np.float32)
    xm = np.moveaxis(x.astype(np.int64), ax, -1)
    d = xm - xm.max(axis=-1, keepdims=True)
    e = table[d + 255]
    total = np.zeros(e.shape[:-1], np.float32)
    for k in range(e.shape[-1]):
        total = (total + e[..., k]).astype(np.float32)
    p = (e / total[..., None]).astype(np.float32)
    v = (p / np.float32(q["ys"])).astype(np.float32)
    y = np.clip(np.rint(v) + np.float32(q["zy"]), q["lo"], q["hi"]).astype(np.int64)
    # the graph's meaning: the softmax of the real inputs, divided by s_y
    e64 = np.exp(d * float(np.float32(q["xs"])))
    real = e64 / e64.sum(axis=-1, keepdims=True) / float(np.float32(q["ys"]))
    margin = np.abs(real) * (e.shape[-1] + 16) * _ULP
    return Exact(*(np.moveaxis(a, -1, ax) for a in (y, real, margin)))


def quantize_linear(node: ir.Node, g: ir.Graph, x: np.ndarray) -> Exact:
    """saturate(rint(x / scale) + zp) in float32; NaN gives the zero point."""
    from tinydeploy.quant.params import q_info
    info = q_info(g, node)
    lo, hi = (int(v) for v in (np.iinfo(info.dtype).min, np.iinfo(info.dtype).max))
    v = (np.rint((x.astype(np.float32) / info.s).astype(np.float32)) + np.float32(info.z)).astype(np.float32)
    v = np.where(np.isnan(v), np.float32(info.z), np.clip(v, lo, hi))
    real = x.astype(np.float64) / float(info.s)
    return Exact(v.astype(np.int64), real, np.abs(real) * 2 * _ULP)


def dequantize_linear(node: ir.Node, g: ir.Graph, x: np.ndarray) -> Exact:
    """float32(x - zp) * scale, per tensor or per channel of an axis."""
    from tinydeploy.quant.params import dq_info
    info = dq_info(g, node)
    xi = x.astype(np.int64)
    if info.axis is None:
        return Exact(((xi - info.z).astype(np.float32) * info.s).astype(np.float32))
    shape = [1] * x.ndim
    shape[info.axis] = -1
    zp = np.broadcast_to(info.zp, (x.shape[info.axis],)).reshape(shape)
    return Exact(((xi - zp).astype(np.float32) * info.scale.reshape(shape)).astype(np.float32))


# op -> function(node, graph, *runtime inputs); the integer operators of the QDQ pass and the
# Q/DQ kernels of float islands.
OPS = {"QConv": qconv, "QDense": qdense, "QAdd": qadd, "QRequantize": qrequantize,
       "QMaxPool": qmaxpool, "QAveragePool": qavgpool, "QGlobalAveragePool": qglobalpool,
       "QGlobalMaxPool": qglobalpool, "QSoftmax": qsoftmax,
       "QuantizeLinear": quantize_linear, "DequantizeLinear": dequantize_linear}
_RUNTIME_ARGS = {"QConv": 1, "QDense": 1, "QAdd": 2}     # leading inputs that are tensors, not constants


# ---- whole graphs ----------------------------------------------------------------------------

def _onnx_node(node: ir.Node, g: ir.Graph, values: dict) -> list[np.ndarray]:
    """A standard operator, by onnx's reference evaluator (the specification's meaning)."""
    import onnx
    from onnx.reference import ReferenceEvaluator
    if any(k.startswith("_") for k in node.attrs):
        raise TinydeployError(f"exact reference: node {node.name!r} carries private attributes")
    domain, _, op = node.op.rpartition(":")
    proto = onnx.helper.make_node(op, [i for i in node.inputs], list(node.outputs), domain=domain or None,
                                  **node.attrs)
    feeds = {i: values[i] for i in node.inputs if i}
    return [np.asarray(v) for v in ReferenceEvaluator(proto).run(None, feeds)]


def evaluate(g: ir.Graph, feeds: dict[str, np.ndarray], keep: bool = False,
             rounding: dict | None = None, override: dict | None = None,
             local: dict | None = None) -> dict[str, np.ndarray]:
    """Every tensor of `g` (the graph as the QDQ pass leaves it) for these inputs; with keep=False
    only the graph outputs are kept to the end. `rounding`, when given, receives for each output
    of a rounding operator its (real, margin) (see Exact). `override` (name -> value): each of
    those tensors, once computed, is replaced by the value given, so every later node reads it
    (a target's own tensors: each layer evaluated on the inputs the target gave it); `local`
    then receives what this reference computed for them."""
    values: dict[str, np.ndarray] = {}
    for name, t in g.tensors.items():
        if t.is_const:
            values[name] = t.data
    for name in g.inputs:
        values[name] = np.asarray(feeds[name])
    last_use = {}
    for k, n in enumerate(g.nodes):
        for i in n.inputs:
            last_use[i] = k
    for k, n in enumerate(g.nodes):
        fn = OPS.get(n.op)
        if fn is not None:
            nrt = _RUNTIME_ARGS.get(n.op, 1)
            y, real, margin = fn(n, g, *[values[i] for i in n.inputs[:nrt]])
            outs = [y]
            if rounding is not None and real is not None:
                rounding[n.outputs[0]] = (real, margin)
        else:
            outs = _onnx_node(n, g, values)
        for name, v in zip(n.outputs, outs):
            if name:
                values[name] = np.asarray(v).astype(g.t(name).dtype, copy=False)
                if override is not None and name in override:
                    if local is not None:
                        local[name] = values[name]
                    values[name] = np.asarray(override[name]).astype(g.t(name).dtype, copy=False)
        if not keep:
            for i in n.inputs:
                if last_use.get(i) == k and i not in g.outputs and not g.t(i).is_const:
                    values.pop(i, None)
    return values


def lowered_graph(path, input_shapes=None) -> ir.Graph:
    """The model as tinydeploy's integer operators see it: imported, then the QDQ pass."""
    from tinydeploy.frontend.importer import import_model
    from tinydeploy.quant.qdq import quantize_qdq
    g, _ = import_model(Path(path), input_shapes)
    quantize_qdq(g)
    return g


def run_model(path, feeds: dict[str, np.ndarray], input_shapes=None, graph: ir.Graph | None = None
              ) -> list[np.ndarray]:
    """The model's outputs for `feeds`, by the exact reference (graph outputs in order)."""
    g = graph if graph is not None else lowered_graph(path, input_shapes)
    values = evaluate(g, feeds)
    return [values[o] for o in g.outputs]
