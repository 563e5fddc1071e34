"""Properties of the generated project: deterministic, self-describing, sharing kernels; weights
named by role, arena offsets as named macros, layer counts that agree, includes once at the top,
constants folded."""
import hashlib
import os
import re
import subprocess
import sys
from functools import lru_cache

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinydeploy import __version__, flow
from tinydeploy.pipeline import compile_model
from tinydeploy.targets import boards
from util import REPO, mlperf_model


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.suffix in (".c", ".h") or p.name == "Makefile"}


def test_output_is_byte_identical_for_identical_input(tmp_path):
    m = mlperf_model("kws_dscnn_fp32.onnx")
    a = flow.build(m, "host", tmp_path / "a", command="tinydeploy build x", quiet=True)
    b = flow.build(m, "host", tmp_path / "b", command="tinydeploy build x", quiet=True)
    assert _digest(a.outdir) == _digest(b.outdir)


def test_files_explain_themselves(tmp_path):
    m = mlperf_model("ic_resnet8_fp32.onnx")
    r = flow.build(m, "host", tmp_path / "p", command="tinydeploy build --board host ic.onnx", quiet=True)
    sha = hashlib.sha256(m.read_bytes()).hexdigest()
    for name in ("model.h", "model.c", "td_kernels.c", "td_weights.c"):
        text = (r.outdir / name).read_text()
        head = text[:600]
        assert f"tinydeploy {__version__}" in head and sha in head
        assert "tinydeploy build --board host ic.onnx" in head
    body = (r.outdir / "model.c").read_text()
    calls = re.findall(r"^    td_\w+\(", body, re.M)
    comments = re.findall(r"^    /\* \d+: ", body, re.M)
    assert len(comments) >= len(calls) > 0          # a comment per layer
    assert "malloc" not in "".join(p.read_text() for p in r.outdir.glob("*.c"))
    # weights are const arrays, the arena one static buffer
    assert re.search(r"^const float td_l\d+_\w+_weight\[\d+\] = \{", (r.outdir / "td_weights.c").read_text(), re.M)
    assert body.count("static union") == 1


def test_identical_layers_share_one_kernel(tmp_path):
    r = flow.build(mlperf_model("kws_dscnn_fp32.onnx"), "host", tmp_path / "p", quiet=True)
    kernels = (r.outdir / "td_kernels.c").read_text()
    defined = re.findall(r"^void (td_\w+)\(", kernels, re.M)
    calls = re.findall(r"^    (td_\w+)\(", (r.outdir / "model.c").read_text(), re.M)
    assert len(set(defined)) == len(defined)
    assert len(defined) < len(calls), "KWS repeats its depthwise-separable block: layers must share code"


# ---- names, offsets, counts, includes: what an engineer reading the C relies on ---------------

ROLES = ("weight", "bias", "mult", "shift", "rscale", "scale", "lhs", "rhs")
# (model, board): int8 on the Cortex-M4 (DSP variants, td_runtime.h helpers), fp32 on the host
# (AVX kernels where the host has them) and on the Arm boards (NEON).
CASES = [("kws_dscnn_int8.onnx", "mps2-an386"), ("ic_resnet8_int8.onnx", "mps2-an386"),
         ("ad_autoencoder_int8.onnx", "mps2-an386"), ("kws_dscnn_fp32.onnx", "mps2-an386"),
         ("ic_resnet8_fp32.onnx", "host"), ("vww_mobilenetv1_int8.onnx", "host"), ("kws_dscnn_fp32.onnx", "rpi4")]


@lru_cache(maxsize=None)
def _compiled(model: str, board: str):
    return compile_model(mlperf_model(model), boards.get_board(board).make_target(), board=board)


def _defines(model_c: str) -> dict[str, int]:
    """TD_OFF_ macro -> its value, aliases (#define TD_OFF_b TD_OFF_a) resolved."""
    raw = dict(re.findall(r"^#define (TD_OFF_\w+) (\w+)", model_c, re.M))
    out = {}
    for name in raw:
        v = raw[name]
        while v in raw:
            v = raw[v]
        out[name] = int(v)
    return out


def _calls(model_c: str) -> dict[int, list[str]]:
    """Schedule step -> the arguments of its call in td_run()."""
    out = {}
    for m in re.finditer(r"TD_LAYER_BEGIN\((\d+)\);\n\s*td_\w+\((.*?)\);\n", model_c, re.S):
        out[int(m.group(1))] = [a.strip() for a in m.group(2).replace("\n", " ").split(",")]
    return out


@pytest.mark.parametrize("model,board", CASES)
def test_weight_names_carry_their_role(model, board):
    c = _compiled(model, board)
    header = c.files["td_weights.h"]
    decls = re.findall(r"^/\* (layer (\d+) \(.*?\) (.*?): (\w+) \[([\d,]*)\]; \".*?\") \*/\n"
                       r"extern const \w+ (td_\w+)\[(\d+)\];", header, re.M)
    assert decls and len(decls) == header.count("extern const")
    names = [d[5] for d in decls]
    assert len(set(names)) == len(names)
    for _, step, what, dtype, shape, name, n in decls:
        role = next(r for r in ROLES if name.endswith("_" + r))
        assert name.startswith(f"td_l{step}_") and re.fullmatch(r"td_l\d+_[A-Za-z0-9_]+", name), name
        assert int(n) == int(np.prod([int(v) for v in shape.split(",") if v] or [1]))
        assert {"weight": "weights", "bias": "bias", "mult": "multipliers", "shift": "shift",
                "rscale": "requantisation scales"}.get(role, "") in what
    # each constant argument of a call is named for the parameter it binds
    calls = _calls(c.files["model.c"])
    for step, k in enumerate(c.kernels):
        if k is None or k.family not in ("qconv2d", "qdense", "conv2d", "dense_packed", "conv2d_gemm"):
            continue
        consts = [a for a in calls[step] if a.startswith("td_l")]
        # the Cortex-M kernels take the requantisation scales r = m * 2^-shift (schedule/mcu.py)
        expected = (["weight", "bias", "rscale"] if "RS" in k.params else ["weight", "bias", "mult", "shift"]) \
            if k.family.startswith("q") else ["weight", "bias"]
        assert [a.rsplit("_", 1)[1] for a in consts] == expected[:len(consts)], (step, consts)


def _long_names_model() -> onnx.ModelProto:
    """Two convolutions whose node names agree in their first 60 characters."""
    rng = np.random.default_rng(0)
    prefix = "block/with/a/very/long/and/repetitive/name/that/goes/on/and/on/"
    inits = [numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), f"w{i}")
             for i in range(2)] + [numpy_helper.from_array(np.ones(4, np.float32), f"b{i}") for i in range(2)]
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["y0"], name=prefix + "conv_a", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["y0", "w1", "b1"], ["y1"], name=prefix + "conv_b", pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                          [helper.make_tensor_value_info("y1", TensorProto.FLOAT, [1, 4, 6, 6])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_shortened_names_stay_unique_and_keep_their_role(tmp_path):
    path = tmp_path / "long.onnx"
    onnx.save(_long_names_model(), path)
    c = compile_model(path, boards.get_board("host").make_target(), board="host")
    names = re.findall(r"^extern const float (td_\w+)\[", c.files["td_weights.h"], re.M)
    assert len(names) == len(set(names)) == 4
    assert sorted(n.rsplit("_", 1)[1] for n in names) == ["bias", "bias", "weight", "weight"]
    assert all(len(n) <= 60 for n in names)


@pytest.mark.parametrize("model,board", CASES)
def test_arena_offsets_are_named_macros_that_match_the_plan(model, board):
    c = _compiled(model, board)
    text = c.files["model.c"]
    assert not re.search(r"TD_AT\(\d", text), "bare arena offsets"
    defs = _defines(text)
    calls = _calls(text)
    checked = 0
    for step, k in enumerate(c.kernels):
        if k is None:
            continue
        runtime = [a for a in k.args if not k.tensor(a, c.graph).is_const]
        macros = re.findall(r"TD_AT\((TD_OFF_\w+)\)", ", ".join(calls[step]))
        assert len(macros) == len(runtime), step
        for tensor, macro in zip(runtime, macros):
            assert defs[macro] == c.plan.offsets[tensor], (step, tensor, macro)
            checked += 1
    assert checked
    # every macro says what lives there and when
    for line in re.findall(r"^#define TD_OFF_.*$", text, re.M):
        assert re.search(r"/\* .*\d+ B.*steps? \d+", line), line


@pytest.mark.parametrize("model,board", CASES)
def test_kernel_scratch_lies_within_its_planned_bytes(model, board):
    """The scratch each layer's C uses (model.c: "scratch of layer k, N B", the kernel's size as
    its parameters have it, e.g. a GEMM tile) fits in the bytes the plan reserved for it, inside
    the arena. A planner whose chain trials sized shared kernels after the kept plan had them
    (no chain taken) left tiles 4x their room: the kernels wrote past the arena's end, over the
    next model's arena and context in a library image."""
    c = _compiled(model, board)
    text = c.files["model.c"]
    arena = int(re.search(r"unsigned char bytes\[(\d+)\];", text).group(1))
    assert arena == c.plan.arena_bytes
    planned = {nm: b.size for b in c.plan.buffers for nm in b.tensors}
    uses = re.findall(r"^#define TD_OFF_scratch_l(\d+) (\d+)\s+/\* scratch of layer \d+, (\d+) B", text, re.M)
    assert len(uses) == sum(1 for k in c.kernels if k is not None and k.scratch_bytes)
    for step, off, size in ((int(a), int(b), int(s)) for a, b, s in uses):
        assert size <= planned[f"#scratch{step}"] and int(off) + size <= arena, (step, off, size, arena)


@pytest.mark.parametrize("model,board", CASES)
def test_layer_count_is_the_layers_with_code(model, board):
    c = _compiled(model, board)
    h = c.files["model.h"]
    with_code = sum(1 for k in c.kernels if k is not None)
    assert int(re.search(r"#define TD_NUM_LAYERS (\d+)", h).group(1)) == with_code
    assert int(re.search(r"#define TD_NUM_STEPS (\d+)", h).group(1)) == len(c.graph.nodes)
    assert len(_calls(c.files["model.c"])) == with_code


@pytest.mark.parametrize("model,board", CASES)
def test_includes_once_at_the_top(model, board):
    c = _compiled(model, board)
    for name, text in c.files.items():
        if not name.endswith((".c", ".h")):
            continue
        lines = text.splitlines()
        incs = [i for i, ln in enumerate(lines) if ln.startswith("#include")]
        assert len({lines[i] for i in incs}) == len(incs), f"{name}: an #include twice"
        first_code = next((i for i, ln in enumerate(lines) if re.match(r"(void|const|static|extern|int|float|TD_INLINE)\b", ln)),
                          len(lines))
        assert all(i < first_code for i in incs), f"{name}: an #include after the code began"
    assert "td_runtime.h" in c.files and '#include "td_runtime.h"' in c.files["td_kernels.c"]


# Constant arithmetic the generator folds before writing C: `x - -128`, `x + -3`, `k * 1`, `/ 1`,
# `+ 0`, and casts to void that only silence unused variables.
_UNFOLDED = re.compile(r"[-+]=? -\d|(?<![\w.])\w+ \* 1(?![\w.])|/ 1(?![\w.])|[-+] 0(?![\w.])|\(void\)\w+;")


@pytest.mark.parametrize("model,board", CASES)
def test_no_unfolded_constants_or_dead_code(model, board):
    c = _compiled(model, board)
    for name in ("model.c", "td_kernels.c", "td_runtime.h"):
        for ln in c.files[name].splitlines():
            if not ln.lstrip().startswith(("/*", "*")):
                assert not _UNFOLDED.search(ln), f"{model} {board} {name}: {ln.strip()}"


def test_same_model_same_bytes_in_fresh_processes(tmp_path):
    """Two builds by separate interpreters (different hash seeds: no set or dict order leaks into
    the C) write identical sources, td_runtime.h included."""
    m = mlperf_model("kws_dscnn_int8.onnx")
    digests = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed,
                   PYTHONPATH=os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
        code = ("import hashlib, sys, json; from tinydeploy.pipeline import compile_model; "
                "from tinydeploy.targets import boards; "
                "c = compile_model(sys.argv[1], boards.get_board('mps2-an386').make_target(), command='x', board='mps2-an386'); "
                "print(json.dumps({k: hashlib.sha256(v.encode()).hexdigest() for k, v in sorted(c.files.items())}))")
        r = subprocess.run([sys.executable, "-c", code, str(m)], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        digests.append(r.stdout)
    assert digests[0] == digests[1]
    assert "td_runtime.h" in digests[0]


@pytest.mark.parametrize("model,board", CASES)
def test_lowering_and_selection_leave_the_graph_as_the_passes_made_it(model, board):
    """Kernels keep the arrays they derive (packed, re-laid weights) as their own constants and
    their scratch as an argument: the compiled graph holds only what the passes made."""
    from tinydeploy.pipeline import prepared_graph
    c = _compiled(model, board)
    g = prepared_graph(mlperf_model(model))
    assert set(c.graph.tensors) == set(g.tensors)
    assert not any(name.startswith("#scratch") for name in c.graph.tensors)
    owned = [n for k in c.kernels if k for n in k.consts]
    assert owned and not set(owned) & set(c.graph.tensors)
