"""A seeded mutation fuzzer of tinydeploy over the MLPerf Tiny models (issue 12).

Each mutant is one of the eight models (int8 and fp32 ONNX) with one to three mutations, each
a JSON recipe that replays exactly (`apply`):

    attribute  a node's attribute set to a boundary value, lengthened, shortened, removed or added
    shape      a graph input's or output's dimension changed
    dtype      a graph input's, output's or initializer's element type changed
    initializer  values made NaN, infinite, 0, negative, denormal or huge; data cut or lengthened;
               a scalar made a vector
    name       a node or tensor renamed (everywhere, or in one place only), names duplicated
    structure  a node removed, duplicated, moved, rewired or given another operator; an output
               removed or added; an initializer made a graph input; the opset changed
    bytes      the serialised model with bits flipped, bytes inserted or the end cut off

and is run as `tinydeploy run --json` would run it (in-process, in worker processes that import
tinydeploy once), its C compiled with gcc under AddressSanitizer and UBSan. Every outcome must be
one of:

    exit 0   the outputs match (JSON whose outputs_match is true)
    exit 1   a mismatch, explained (outputs_match false, with the errors)
    exit 2   one `tinydeploy: error:` line on stderr and nothing else but progress lines

Anything else is a failure, counted by kind: internal (exit 3), hang, sanitizer (the model
binary failed), codegen (C that does not compile), reference (onnxruntime refused what
tinydeploy accepted: a gap in the verifier), noise (stray stderr lines), badjson.

    python3 tests/modelfuzz.py --minutes 30 [--seed S] [--jobs 2] [--corpus tests/fuzz_corpus.json]

runs on demand for a time (or --mutants N); every failure it finds, and the first mutants of
each verdict, are added to the corpus, which tests/test_fuzz.py replays as regression tests.
Nothing of the models is stored: a corpus entry is the model's name and the recipes."""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MLPERF = REPO.parent / "shared" / "models" / "mlperf_tiny"
CORPUS = HERE / "fuzz_corpus.json"
MODELS = {   # name -> weight of its choice (small models more often: compile time)
    "kws_dscnn_int8": 4, "kws_dscnn_fp32": 2, "ad_autoencoder_int8": 3, "ad_autoencoder_fp32": 2,
    "ic_resnet8_int8": 3, "ic_resnet8_fp32": 1, "vww_mobilenetv1_int8": 1, "vww_mobilenetv1_fp32": 1,
}
FAILURES = ("internal", "hang", "sanitizer", "codegen", "reference", "noise", "badjson", "multiline")
TIMEOUT_S = 300.0

HOSTILE = ["", "x" * 300, "a\nb", "\x1b[31mred", "close*/ int evil; /*", "??/", "n\x00ul", "\u202e\U0001f642",
           "../../etc/passwd", "%s%n", "Conv", "input_1"]
INT_VALUES = [0, -1, 1, 2, 3, 7, 64, 1000, 2**31 - 1, 2**31, -2**31, 2**40]
FLOAT_VALUES = [0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e30, 1e-40, 1e-45, 0.5, 3.0]
STRING_VALUES = ["", "FOO", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID", "constant", "reflect", "edge", "wrap",
                 "\xff\xfe"]
NEW_ATTRS = ["group", "axis", "kernel_shape", "pads", "strides", "dilations", "auto_pad", "ceil_mode", "perm",
             "keepdims", "alpha", "beta", "transA", "transB", "mode", "count_include_pad", "size", "axes"]
OPS = ["Relu", "Sigmoid", "Tanh", "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Conv", "ConvTranspose",
       "MaxPool", "AveragePool", "GlobalAveragePool", "MatMul", "Gemm", "Softmax", "LogSoftmax", "Reshape",
       "Transpose", "Identity", "Flatten", "Concat", "LRN", "BatchNormalization", "Abs", "Exp", "Log",
       "QuantizeLinear", "DequantizeLinear", "Clip", "PRelu", "ReduceMean", "Squeeze", "Unsqueeze", "Pad", "Erf"]


# ---- recipes ------------------------------------------------------------------------------------

def _choice(r: random.Random, seq):
    return seq[r.randrange(len(seq))]


def propose(r: random.Random, m) -> dict:
    """One mutation recipe for model `m` (an onnx.ModelProto), drawn with `r`."""
    import onnx
    g = m.graph
    kind = _choice(r, ["attribute"] * 6 + ["shape", "dtype"] + ["initializer"] * 6 + ["name"] * 2
                   + ["structure"] * 4 + ["bytes"])
    if kind == "attribute":
        idx = [i for i, n in enumerate(g.node) if n.attribute] or [0]
        i = _choice(r, idx)
        node = g.node[i]
        how = r.random()
        if not node.attribute or how < 0.04:
            name = _choice(r, NEW_ATTRS)
            return {"op": "attr_set", "node": i, "attr": name,
                    "value": _choice(r, [_choice(r, INT_VALUES), [_choice(r, INT_VALUES)] * r.randint(1, 4),
                                         _choice(r, STRING_VALUES), 2.0])}
        a = _choice(r, list(node.attribute))
        if how < 0.14:
            return {"op": "attr_del", "node": i, "attr": a.name}
        v = onnx.helper.get_attribute_value(a)
        if a.type == onnx.AttributeProto.INT:
            new = _choice(r, INT_VALUES + [v + 1, v - 1, v * 2])
        elif a.type == onnx.AttributeProto.INTS:
            v = list(v)
            c = r.random()
            if c < 0.2 or not v:
                new = v + [_choice(r, INT_VALUES)]
            elif c < 0.35:
                new = v[:-1]
            else:
                k = r.randrange(len(v))
                new = v[:k] + [_choice(r, INT_VALUES + [v[k] + 1, v[k] - 1, v[k] * 2])] + v[k + 1:]
        elif a.type == onnx.AttributeProto.FLOAT:
            new = _choice(r, FLOAT_VALUES + [v * 2, -v])
        elif a.type == onnx.AttributeProto.STRING:
            new = _choice(r, STRING_VALUES)
        elif a.type == onnx.AttributeProto.FLOATS:
            new = [_choice(r, FLOAT_VALUES) for _ in range(max(1, len(v)))]
        else:
            return {"op": "attr_del", "node": i, "attr": a.name}
        return {"op": "attr_set", "node": i, "attr": a.name, "value": new}
    if kind == "shape":
        which = "input" if r.random() < 0.7 else "output"
        vis = [vi for vi in (g.input if which == "input" else g.output) if vi.name not in {t.name for t in g.initializer}]
        if not vis:
            return {"op": "opset", "version": 12}
        k = r.randrange(len(vis))
        dims = vis[k].type.tensor_type.shape.dim
        if not dims:
            return {"op": "opset", "version": 12}
        d = r.randrange(len(dims))
        old = dims[d].dim_value
        return {"op": "dim", "which": which, "index": k, "dim": d,
                "value": _choice(r, [0, 1, 2, 3, old + 1, old * 2, max(1, old - 1), 2**31, -1, "N"])}
    if kind == "dtype":
        c = r.random()
        types = [onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
                 onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BOOL, onnx.TensorProto.FLOAT,
                 onnx.TensorProto.STRING, 0, 99]
        if c < 0.5 and len(g.initializer):
            return {"op": "init_dtype", "index": r.randrange(len(g.initializer)), "type": _choice(r, types)}
        which = "input" if c < 0.8 else "output"
        return {"op": "io_dtype", "which": which, "index": 0, "type": _choice(r, types)}
    if kind == "initializer":
        if not len(g.initializer):
            return {"op": "opset", "version": 11}
        k = r.randrange(len(g.initializer))
        small = [i for i, x in enumerate(g.initializer) if 0 < _numel(x) <= 4]
        if small and r.random() < 0.5:   # scales, zero points, shapes: where the fragile values are
            k = _choice(r, small)
        how = _choice(r, ["value"] * 4 + ["scale"] * 3 + ["truncate", "extend", "vector", "dims"])
        if how == "value":
            return {"op": "init_value", "index": k, "value": _choice(r, FLOAT_VALUES + INT_VALUES + ["random"]),
                    "where": _choice(r, ["all", "one"]), "seed": r.randrange(2**31)}
        if how == "scale":   # values that keep the model valid: the arithmetic at other magnitudes
            return {"op": "init_scale", "index": k, "factor": _choice(r, [2.0, 0.5, -1.0, 1e-3, 1e3, 1e-20, 1e20, 3.7])}
        if how == "vector":
            return {"op": "init_vector", "index": k, "n": _choice(r, [0, 2, 3, 64])}
        if how == "dims":
            return {"op": "init_dims", "index": k, "dims": [_choice(r, [0, 1, 2, 3, 10, 64])
                                                            for _ in range(r.randint(0, 4))]}
        return {"op": "init_" + how, "index": k, "bytes": _choice(r, [1, 4, 16, 1000])}
    if kind == "name":
        c = r.random()
        if c < 0.35:
            return {"op": "rename_node", "node": r.randrange(len(g.node)), "to": _choice(r, HOSTILE + ["@dup"])}
        tensors = sorted({x for n in g.node for x in list(n.input) + list(n.output) if x})
        return {"op": "rename_tensor", "tensor": _choice(r, tensors), "to": _choice(r, HOSTILE + ["@other"]),
                "everywhere": c < 0.75}
    if kind == "structure":
        c = _choice(r, ["delete", "duplicate", "move", "rewire", "optype", "drop_output", "add_output",
                        "init_input", "opset", "domain"])
        i = r.randrange(len(g.node))
        if c == "delete":
            return {"op": "node_delete", "node": i}
        if c == "duplicate":
            return {"op": "node_duplicate", "node": i}
        if c == "move":
            return {"op": "node_move", "node": i, "to": r.randrange(len(g.node))}
        if c == "rewire":
            tensors = sorted({x for n in g.node for x in n.output if x} | {x.name for x in g.input})
            node = g.node[i]
            return {"op": "rewire", "node": i, "input": r.randrange(max(1, len(node.input))),
                    "to": _choice(r, tensors)}
        if c == "optype":
            return {"op": "optype", "node": i, "to": _choice(r, OPS)}
        if c == "drop_output":
            return {"op": "drop_output"}
        if c == "add_output":
            outs = sorted({x for n in g.node for x in n.output if x})
            return {"op": "add_output", "tensor": _choice(r, outs)}
        if c == "init_input":
            return {"op": "init_input", "index": r.randrange(max(1, len(g.initializer)))}
        if c == "domain":
            return {"op": "domain", "node": i, "to": _choice(r, ["com.microsoft", "ai.onnx", "x.y"])}
        return {"op": "opset", "version": _choice(r, [1, 6, 7, 10, 11, 12, 14, 18, 21, 99])}
    return {"op": "bytes", "how": _choice(r, ["flip", "insert", "cut", "zero"]), "seed": r.randrange(2**31),
            "count": _choice(r, [1, 2, 8, 64])}


def _numel(t) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n


def apply(m, recipe: dict):
    """Applies one recipe to the ModelProto `m` in place; returns `m`, or the mutated bytes for a
    byte-level recipe. A recipe that does not apply to this model does nothing."""
    import numpy as np
    from onnx import helper, numpy_helper
    g = m.graph
    op = recipe["op"]
    node = g.node[recipe["node"] % len(g.node)] if "node" in recipe and len(g.node) else None
    if op == "attr_set":
        v = recipe["value"]
        for a in list(node.attribute):
            if a.name == recipe["attr"]:
                node.attribute.remove(a)
        if isinstance(v, str):
            v = v.encode("utf-8", "surrogateescape") if v != "\xff\xfe" else b"\xff\xfe"
        if isinstance(v, list) and v and isinstance(v[0], int):
            v = [int(x) if -2**63 <= x < 2**63 else 0 for x in v]
        if isinstance(v, int) and not -2**63 <= v < 2**63:
            v = 0
        node.attribute.append(helper.make_attribute(recipe["attr"], v))
    elif op == "attr_del":
        for a in list(node.attribute):
            if a.name == recipe["attr"]:
                node.attribute.remove(a)
    elif op == "dim":
        vis = [vi for vi in (g.input if recipe["which"] == "input" else g.output)
               if vi.name not in {t.name for t in g.initializer}]
        if vis:
            dims = vis[recipe["index"] % len(vis)].type.tensor_type.shape.dim
            if dims:
                d = dims[recipe["dim"] % len(dims)]
                v = recipe["value"]
                d.Clear()
                if isinstance(v, str):
                    d.dim_param = v
                else:
                    d.dim_value = v
    elif op == "io_dtype":
        vis = list(g.input if recipe["which"] == "input" else g.output)
        if vis:
            vis[recipe["index"] % len(vis)].type.tensor_type.elem_type = recipe["type"]
    elif op == "init_dtype":
        if len(g.initializer):
            g.initializer[recipe["index"] % len(g.initializer)].data_type = recipe["type"]
    elif op.startswith("init_") and len(g.initializer):
        k = recipe["index"] % len(g.initializer)
        t = g.initializer[k]
        try:
            a = numpy_helper.to_array(t).copy()
        except Exception:
            return m
        if op == "init_value":
            v = recipe["value"]
            rng = np.random.default_rng(recipe["seed"])
            if v == "random":
                new = rng.standard_normal(a.shape) * 10 if a.dtype.kind == "f" else rng.integers(-300, 300, a.shape)
            else:
                new = np.full(a.shape, v, dtype=np.float64 if isinstance(v, float) else object)
            if recipe["where"] == "one" and a.size:
                i = int(rng.integers(a.size))
                flat = a.reshape(-1)
                src = np.asarray(new).reshape(-1)
                with np.errstate(all="ignore"):
                    flat[i] = _cast(src[i:i + 1], a.dtype)[0]
                new = flat.reshape(a.shape)
            else:
                with np.errstate(all="ignore"):
                    new = _cast(np.asarray(new), a.dtype).reshape(a.shape)
            t.CopyFrom(numpy_helper.from_array(np.asarray(new, dtype=a.dtype), t.name))
        elif op == "init_scale":
            with np.errstate(all="ignore"):
                new = _cast(a.astype(np.float64) * recipe["factor"], a.dtype)
            t.CopyFrom(numpy_helper.from_array(np.asarray(new, dtype=a.dtype).reshape(a.shape), t.name))
        elif op == "init_vector":
            n = recipe["n"]
            flat = a.reshape(-1)
            new = np.resize(flat, n) if flat.size else np.zeros(n, a.dtype)
            t.CopyFrom(numpy_helper.from_array(new.astype(a.dtype), t.name))
        elif op == "init_dims":
            del t.dims[:]
            t.dims.extend(recipe["dims"])
        elif op == "init_truncate":
            raw = numpy_helper.from_array(a, t.name).raw_data
            t.CopyFrom(numpy_helper.from_array(a, t.name))
            t.raw_data = raw[:max(0, len(raw) - recipe["bytes"])]
        elif op == "init_extend":
            t.CopyFrom(numpy_helper.from_array(a, t.name))
            t.raw_data = t.raw_data + bytes(recipe["bytes"])
    elif op == "rename_node":
        to = recipe["to"]
        if to == "@dup":
            other = g.node[(recipe["node"] + 1) % len(g.node)]
            to = other.name
        node.name = to
    elif op == "rename_tensor":
        old = recipe["tensor"]
        to = recipe["to"]
        if to == "@other":
            names = sorted({x for n in g.node for x in n.output if x and x != old})
            to = names[len(names) // 2] if names else "x"
        if recipe["everywhere"]:
            for n in g.node:
                n.input[:] = [to if x == old else x for x in n.input]
                n.output[:] = [to if x == old else x for x in n.output]
            for coll in (g.input, g.output, g.value_info, g.initializer):
                for x in coll:
                    if x.name == old:
                        x.name = to
        else:
            for n in g.node:
                if old in n.input:
                    n.input[:] = [to if x == old else x for x in n.input]
                    break
    elif op == "node_delete":
        g.node.remove(node)
    elif op == "node_duplicate":
        g.node.insert(recipe["node"] % len(g.node), node.__class__.FromString(node.SerializeToString()))
    elif op == "node_move":
        copy = node.__class__.FromString(node.SerializeToString())
        g.node.remove(node)
        g.node.insert(recipe["to"] % (len(g.node) + 1), copy)
    elif op == "rewire":
        if len(node.input):
            node.input[recipe["input"] % len(node.input)] = recipe["to"]
    elif op == "optype":
        node.op_type = recipe["to"]
    elif op == "drop_output":
        if len(g.output):
            del g.output[0]
    elif op == "add_output":
        g.output.append(helper.make_empty_tensor_value_info(recipe["tensor"]))
    elif op == "init_input":
        if len(g.initializer):
            t = g.initializer[recipe["index"] % len(g.initializer)]
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    elif op == "domain":
        node.domain = recipe["to"]
    elif op == "opset":
        for o in m.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = recipe["version"]
    elif op == "bytes":
        data = bytearray(m.SerializeToString())
        rng = random.Random(recipe["seed"])
        n = recipe["count"]
        if recipe["how"] == "flip":
            for _ in range(n):
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
        elif recipe["how"] == "insert":
            i = rng.randrange(len(data))
            data[i:i] = bytes(rng.randrange(256) for _ in range(n))
        elif recipe["how"] == "zero":
            i = rng.randrange(len(data))
            data[i:i + n] = bytes(len(data[i:i + n]))
        else:
            data = data[:rng.randrange(len(data))]
        return bytes(data)
    return m


def _cast(a, dtype):
    import numpy as np
    a = np.asarray(a)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        f = np.asarray(a, dtype=np.float64)
        f = np.where(np.isfinite(f), f, 0.0)
        return np.clip(np.rint(f), info.min, info.max).astype(dtype)
    if np.dtype(dtype).kind == "b":
        return np.asarray(a, dtype=np.float64) != 0
    return np.asarray(a, dtype=np.float64).astype(dtype)


def mutant(model_name: str, recipes: list[dict]) -> bytes:
    """The mutant's bytes: the model with the recipes applied in order."""
    import onnx
    m = onnx.load_model(str(MLPERF / f"{model_name}.onnx"))
    for rec in recipes:
        out = apply(m, rec)
        if isinstance(out, bytes):
            return out
    return m.SerializeToString()


def draw(r: random.Random) -> tuple[str, list[dict]]:
    """A model and one to three recipes, drawn with `r`."""
    import onnx
    names = list(MODELS)
    model = r.choices(names, weights=[MODELS[n] for n in names])[0]
    m = onnx.load_model(str(MLPERF / f"{model}.onnx"))
    recipes = []
    for _ in range(r.choice([1, 1, 1, 2, 2, 3])):
        rec = propose(r, m)
        recipes.append(rec)
        out = apply(m, rec)
        if isinstance(out, bytes):
            break
    return model, recipes


# ---- running one mutant (in a worker process) -------------------------------------------------

SANITIZE = ["-O0", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def _cached_compile(cache: Path):
    """build.compile_host's stand-in for the fuzzer: gcc with ASan and UBSan, each source
    compiled once per content (generated files differ in their header comment only, the model's
    SHA-256, when a mutation changed nothing else), then linked."""
    from tinydeploy import build
    from tinydeploy.errors import TinydeployError

    def strip(text: str) -> str:   # the header comment and the model's SHA-256 (only printed)
        text = re.sub(r"\A/\*.*?\*/", "", text, count=1, flags=re.S)
        return re.sub(r'#define TD_MODEL_SHA256 "[0-9a-f]*"', "", text)

    def compile_host(outdir, target, extra_cflags=None, cc=None, exe="model_run"):
        outdir = Path(outdir)
        flags = [f for f in target.cflags if not f.startswith("-O")] + list(extra_cflags or []) + SANITIZE
        headers = "".join(strip(p.read_text()) for p in sorted(outdir.glob("*.h")))
        objs = []
        for src in ["main.c", "model.c", "td_kernels.c", "td_weights.c"]:
            key = hashlib.sha256((" ".join(flags) + "\0" + headers + "\0" + strip((outdir / src).read_text()))
                                 .encode()).hexdigest()[:24]
            obj = cache / f"{key}.o"
            if not obj.is_file():
                tmp = cache / f"{key}.{os.getpid()}.tmp.o"
                r = subprocess.run(["gcc", *flags, "-c", "-o", str(tmp), src], cwd=outdir, capture_output=True,
                                   text=True, timeout=TIMEOUT_S)
                if r.returncode != 0:
                    (outdir / "build.log").write_text(r.stdout + r.stderr)
                    first = next((ln for ln in r.stderr.splitlines() if "error" in ln), "")
                    raise TinydeployError(f"compiling the generated C failed ({first[:200]}); "
                                          "-- this is a tinydeploy bug, please report it with the model")
                os.replace(tmp, obj)
            objs.append(str(obj))
        r = subprocess.run(["gcc", *flags, "-o", exe, *objs, *target.ldlibs], cwd=outdir, capture_output=True,
                           text=True, timeout=TIMEOUT_S)
        if r.returncode != 0:
            raise TinydeployError(f"compiling the generated C failed (link: {r.stderr[-200:]}) "
                                  "-- this is a tinydeploy bug")
        return outdir / exe
    build.compile_host = compile_host


def _fast_runs():
    """`run` times as many runs as fit in a second; the fuzzer needs the result, not the time."""
    from tinydeploy import flow

    def untimed(runner, built, feeds, out_specs, budget_s, probe=1):
        return None, 0
    flow.time_runs = untimed


@contextlib.contextmanager
def _captured_fds():
    """Everything written to file descriptors 1 and 2 (Python's and onnxruntime's own) meanwhile."""
    out = {}
    saved = [os.dup(1), os.dup(2)]
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        yield out
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for key, f in zip(("stdout", "stderr"), files):
            f.seek(0)
            out[key] = f.read().decode("utf-8", "replace")
            f.close()


def run_one(data: bytes, work: Path) -> dict:
    """`tinydeploy run --json` on the mutant's bytes, in this process: exit code, stdout, stderr."""
    from tinydeploy import cli
    work.mkdir(parents=True, exist_ok=True)
    path = work / "mutant.onnx"
    path.write_bytes(data)
    old = os.getcwd()
    os.chdir(work)
    try:
        with _captured_fds() as cap:
            try:
                code = cli.main(["run", "mutant.onnx", "-o", "out", "--json"])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 2
            except BaseException as e:   # cli.main catches everything; this would be a fuzzer bug
                print(f"fuzzer: {type(e).__name__}: {e}", file=sys.stderr)
                code = 99
    finally:
        os.chdir(old)
    return {"code": code, **cap}


def classify(res: dict) -> tuple[str, str]:
    """(verdict, detail): exit0 / exit1 / exit2, or one of FAILURES."""
    code, out, err = res["code"], res.get("stdout", ""), res.get("stderr", "")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    others = [ln for ln in lines if not ln.startswith("[tinydeploy] ") and not ln.startswith("tinydeploy: error:")]
    if code == "hang":
        return "hang", f"no result within {TIMEOUT_S:g} s"
    if "Traceback" in err or code == 3 or "internal error" in err:
        return "internal", (lines[-1] if lines else "")[:300]
    if "Sanitizer" in err or "runtime error:" in err:
        return "sanitizer", (others[:1] or [""])[0][:300]
    if code in (0, 1):
        try:
            res_json = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return "badjson", out[-200:]
        if others:
            return "noise", others[0][:300]
        if bool(res_json.get("outputs_match")) != (code == 0) or (code == 1 and "max_abs_error" not in res_json):
            return "badjson", out[-200:]
        return f"exit{code}", "" if code == 0 else json.dumps({k: res_json.get(k) for k in
                                                               ("max_abs_error", "max_rel_error", "tolerance", "note") if k in res_json})
    if code == 2:
        errors = [ln for ln in lines if ln.startswith("tinydeploy: error:")]
        if len(errors) != 1 or lines[-1] != errors[0]:
            return "multiline", " | ".join(lines[-3:])[:300]
        if others:
            return "noise", others[0][:300]
        msg = errors[0]
        if "the model binary failed" in msg:
            return "sanitizer", msg[:300]
        if "compiling the generated C failed" in msg:
            return "codegen", msg[:300]
        if "onnxruntime, the reference, refuses" in msg:
            return "reference", msg[:300]
        return "exit2", msg[len("tinydeploy: error: "):][:300]
    return "internal", f"exit {code}: " + " | ".join(lines[-2:])[:300]


def _worker(tasks, results, cache: str, work: str):
    os.setpgrp()                       # a hang is killed with everything it started
    # Forked from pytest, sys.stdout/err are its capture objects: write to the descriptors instead,
    # which _captured_fds redirects.
    sys.stdout = open(1, "w", closefd=False, errors="replace")
    sys.stderr = open(2, "w", closefd=False, errors="replace")
    os.environ.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    sys.path.insert(0, str(REPO))
    _cached_compile(Path(cache))
    _fast_runs()
    while True:
        task = tasks.get()
        if task is None:
            return
        i, model, recipes = task
        t0 = time.monotonic()
        try:
            data = mutant(model, recipes)
            res = run_one(data, Path(work) / f"m{i}")
        except Exception as e:
            res = {"code": 99, "stdout": "", "stderr": f"fuzzer: {type(e).__name__}: {e}"}
        finally:
            shutil.rmtree(Path(work) / f"m{i}", ignore_errors=True)
        res["seconds"] = time.monotonic() - t0
        results.put((i, os.getpid(), res))


class Pool:
    """Worker processes that import tinydeploy once; a mutant past its time is a hang: its worker
    and everything it started are killed and a new worker takes its place."""

    def __init__(self, jobs: int, timeout: float = TIMEOUT_S):
        self.ctx = mp.get_context("fork")
        self.timeout = timeout
        self.tmp = Path(tempfile.mkdtemp(prefix="tinydeploy-fuzz-"))
        (self.tmp / "cache").mkdir()
        self.results = self.ctx.Queue()
        self.workers: dict[int, tuple] = {}
        self.jobs = jobs

    def _start(self):
        tasks = self.ctx.Queue()
        p = self.ctx.Process(target=_worker, args=(tasks, self.results, str(self.tmp / "cache"), str(self.tmp / "work")),
                             daemon=True)
        p.start()
        self.workers[p.pid] = (p, tasks, None)
        return p.pid

    def run(self, items, on_result) -> None:
        """items: iterator of (index, model, recipes); on_result(index, model, recipes, res)."""
        items = iter(items)
        pending: dict[int, tuple] = {}
        for _ in range(self.jobs):
            self._start()
        exhausted = False
        while True:
            for pid, (p, tasks, busy) in list(self.workers.items()):
                if busy is None and not exhausted:
                    try:
                        item = next(items)
                    except StopIteration:
                        exhausted = True
                        continue
                    tasks.put(item)
                    self.workers[pid] = (p, tasks, (item, time.monotonic()))
                    pending[item[0]] = item
            if exhausted and all(b is None for _, _, b in self.workers.values()):
                break
            try:
                i, pid, res = self.results.get(timeout=1.0)
                p, tasks, busy = self.workers[pid]
                self.workers[pid] = (p, tasks, None)
                item = pending.pop(i)
                on_result(*item, res)
            except queue.Empty:
                pass
            now = time.monotonic()
            for pid, (p, tasks, busy) in list(self.workers.items()):
                if busy is not None and (now - busy[1] > self.timeout or not p.is_alive()):
                    code = "hang" if p.is_alive() else 99
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                    p.join(5)
                    del self.workers[pid]
                    item = busy[0]
                    pending.pop(item[0], None)
                    on_result(*item, {"code": code, "stdout": "", "stderr": "" if code == "hang" else
                                      f"the worker died (exit {p.exitcode})"})
                    self._start()

    def close(self) -> None:
        for pid, (p, tasks, _) in self.workers.items():
            with contextlib.suppress(Exception):
                tasks.put(None)
        for pid, (p, _, _) in self.workers.items():
            p.join(10)
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(self.tmp, ignore_errors=True)


def fuzz(n: int | None = None, seconds: float | None = None, seed: int = 0, jobs: int = 2,
         log=None, timeout: float = TIMEOUT_S) -> dict:
    """Runs mutants until `n` are done or `seconds` have passed: {"counts": Counter of verdicts,
    "results": [(index, model, recipes, verdict, detail)], "n", "seconds"}."""
    r = random.Random(seed)
    t0 = time.monotonic()
    counts: Counter = Counter()
    results = []

    def items():
        i = 0
        while (n is None or i < n) and (seconds is None or time.monotonic() - t0 < seconds):
            model, recipes = draw(r)
            yield i, model, recipes
            i += 1

    def done(i, model, recipes, res):
        verdict, detail = classify(res)
        counts[verdict] += 1
        results.append((i, model, recipes, verdict, detail))
        if log:
            log(i, model, recipes, verdict, detail, res.get("seconds", 0.0))

    import resource
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    pool = Pool(jobs, timeout)
    try:
        pool.run(items(), done)
    finally:
        pool.close()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    return {"counts": counts, "results": sorted(results, key=lambda x: x[0]), "n": len(results),
            "seconds": time.monotonic() - t0, "cpu_seconds": cpu}


def replay(entries: list[dict], jobs: int = 2, timeout: float = TIMEOUT_S) -> list[tuple[str, str]]:
    """(verdict, detail) of each corpus entry, in order."""
    out: dict[int, tuple[str, str]] = {}

    def done(i, model, recipes, res):
        out[i] = classify(res)

    pool = Pool(jobs, timeout)
    try:
        pool.run(((i, e["model"], e["recipes"]) for i, e in enumerate(entries)), done)
    finally:
        pool.close()
    return [out[i] for i in range(len(entries))]


def summary(rep: dict, seed: int) -> str:
    c = rep["counts"]
    bad = sum(c[k] for k in FAILURES)
    parts = [f"exit 0: {c['exit0']}", f"exit 1: {c['exit1']}", f"exit 2: {c['exit2']}"]
    parts += [f"{k}: {c[k]}" for k in FAILURES if c[k]]
    return (f"fuzz: {rep['n']} mutants of the MLPerf Tiny models (seed {seed}) in {rep['seconds']:.0f} s "
            f"({rep.get('cpu_seconds', 0):.0f} s of CPU): "
            + ", ".join(parts) + f"; {bad} failure{'s' * (bad != 1)}")


# ---- the corpus ------------------------------------------------------------------------------

def load_corpus(path: Path = CORPUS) -> list[dict]:
    return json.loads(path.read_text()) if path.is_file() else []


def save_corpus(entries: list[dict], path: Path = CORPUS) -> None:
    path.write_text("[\n" + ",\n".join(json.dumps(e, sort_keys=True) for e in entries) + "\n]\n")


def expected(verdict: str) -> str:
    """What a corpus entry must give from now on: failures were fixed into a clean exit 2 (or a
    result); the rest keep their verdict."""
    return "clean" if verdict in FAILURES else verdict


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, help="run for this long (default: until --mutants)")
    ap.add_argument("--mutants", type=int, help="this many mutants")
    ap.add_argument("--seed", type=int, default=None, help="seed (default: from the time, printed)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--corpus", default=str(CORPUS), help="corpus to add findings to (default tests/fuzz_corpus.json)")
    ap.add_argument("--keep", type=int, default=2, help="mutants kept per verdict and model besides the failures")
    ap.add_argument("--log", help="write every mutant's verdict to this JSON-lines file")
    a = ap.parse_args(argv)
    if a.minutes is None and a.mutants is None:
        ap.error("give --minutes or --mutants")
    seed = a.seed if a.seed is not None else int(time.time())
    logf = open(a.log, "a") if a.log else None

    def log(i, model, recipes, verdict, detail, seconds):
        line = f"[{i}] {verdict:10} {seconds:5.1f} s {model} {json.dumps(recipes)[:160]} {detail[:160]}"
        print(line, flush=True)
        if logf:
            logf.write(json.dumps({"i": i, "model": model, "recipes": recipes, "verdict": verdict,
                                   "detail": detail, "seconds": round(seconds, 2)}) + "\n")
            logf.flush()

    rep = fuzz(a.mutants, a.minutes * 60 if a.minutes else None, seed, a.jobs, log)
    corpus = load_corpus(Path(a.corpus))
    have = Counter((e["model"], e["expect"]) for e in corpus)
    added = 0
    for i, model, recipes, verdict, detail in rep["results"]:
        exp = expected(verdict)
        if verdict in FAILURES or have[(model, exp)] < a.keep:
            corpus.append({"model": model, "recipes": recipes, "expect": exp, "found": verdict,
                           "detail": detail[:200], "seed": seed, "index": i})
            have[(model, exp)] += 1
            added += 1
    save_corpus(corpus, Path(a.corpus))
    print(summary(rep, seed))
    print(f"corpus {a.corpus}: {added} entries added ({len(corpus)} in all)")
    return 1 if any(rep["counts"][k] for k in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
