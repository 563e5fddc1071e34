"""The library form on the host (`tinydeploy build --name ...`, flow.build_library): several
models in one program with no clashing symbol, contexts on the caller's arena (refused at run
time with an error code when too small or misaligned), sections, two instances on two threads
under ThreadSanitizer, and a model carrying state between runs through the state API, against
onnxruntime fed the state by hand. The test program of the API is tests/c/ctx_driver.c."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinydeploy import flow, reference
from tinydeploy.pipeline import compile_model
from tinydeploy.targets import get_target
from tinydeploy.targets.boards import get_board
from test_bad_input import assert_user_error, cli_run
from test_deploy import tiny_model
from util import REPO, SANITIZE, check_8bit, mlperf_model, require

sys.path.insert(0, str(REPO / "models"))
import make_streaming  # noqa: E402

DRIVER = REPO / "tests" / "c" / "ctx_driver.c"
TSAN = ["-O1", "-g", "-fsanitize=thread", "-fno-omit-frame-pointer"]


def specs_of(m: dict, kind: str):
    return [(n, tuple(s), np.dtype(d)) for n, s, d in m[kind]]


def pack(x: dict, specs) -> bytes:
    return b"".join(np.ascontiguousarray(x[n]).tobytes() for n, _, _ in specs)


def unpack(raw: bytes, specs) -> list[np.ndarray]:
    out, pos = [], 0
    for _, shape, dt in specs:
        n = int(np.prod(shape)) * dt.itemsize
        out.append(np.frombuffer(raw[pos:pos + n], dt).reshape(shape).copy())
        pos += n
    return out


def driver(outdir: Path, name: str, flags=(), cc: str = "gcc") -> Path:
    """ctx_driver.c compiled with the model `name` of a library build in outdir."""
    require(cc)
    srcs = [f"{name}_model.c", f"{name}_kernels.c", f"{name}_weights.c"]
    exe = outdir / f"drv-{cc}-{len(flags)}"
    cmd = [cc, *get_board("host").make_target().cflags, *flags, f'-DTD_HEADER="{name}_model.h"',
           f"-DTD_NAME={name}", f"-DTD_NAME_UPPER={name.upper()}", "-I", str(outdir), "-o", str(exe), str(DRIVER),
           *(str(outdir / s) for s in srcs), "-lm", "-pthread"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


def global_symbols(objs: list[Path]) -> list[str]:
    r = subprocess.run(["nm", "-g", "--defined-only", *map(str, objs)], capture_output=True, text=True, check=True)
    return [ln.split()[-1] for ln in r.stdout.splitlines() if re.match(r"^[0-9a-f]+ [A-Z] ", ln)]


@pytest.mark.models
def test_kws_and_ic_link_into_one_host_binary_and_both_match(tmp_path):
    kws, ic = mlperf_model("kws_dscnn_int8.onnx"), mlperf_model("ic_resnet8_int8.onnx")
    b = flow.build_library([kws, ic], "host", tmp_path / "p", flow.Library(names=["kws", "ic"]), quiet=True)
    out = b.outdir
    assert (out / "kws_model.h").is_file() and (out / "ic_model.h").is_file() and not (out / "model.c").exists()
    header = (out / "kws_model.h").read_text()
    for want in ("int kws_ctx_run(kws_ctx *ctx);", "void *kws_input(int i);", "#define KWS_ARENA_BYTES",
                 "#define KWS_INPUT0_BYTES", "#ifndef KWS_MODEL_H"):
        assert want in header, want
    # both models, one binary, the same run of the test: each selected by name
    for m, path in zip(b.summary["models"], (kws, ic)):
        ins, outs = specs_of(m, "inputs"), specs_of(m, "outputs")
        x = reference.random_inputs(ins, 5)
        (tmp_path / "in.bin").write_bytes(pack(x, ins))
        r = subprocess.run([str(b.exe), m["name"], str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        check_8bit(path, x, unpack((tmp_path / "out.bin").read_bytes(), outs), label=m["name"],
                   lsb_scales=m["output_lsb"])
    r = subprocess.run([str(b.exe), "vww", "a", "b"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "one of kws ic" in r.stderr
    # no clash: every global symbol is defined once, and each model's are named after it
    objs = []
    for src in b.compiled.sources:
        obj = tmp_path / (src + ".o")
        subprocess.run(["gcc", "-std=c99", "-O1", "-mavx2", "-mfma", "-c", "-o", str(obj), str(out / src)],
                       check=True, timeout=300)
        objs.append(obj)
    syms = global_symbols(objs)
    assert len(syms) == len(set(syms)), sorted({s for s in syms if syms.count(s) > 1})
    r = subprocess.run([require("clang"), *get_board("host").make_target().cflags, "-fsyntax-only", "main.c",
                        *b.compiled.sources], cwd=out, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(s.startswith(("kws_", "ic_", "td_")) for s in syms), [s for s in syms if not s.startswith(("kws_", "ic_", "td_"))]
    assert any(s.startswith("kws_l") for s in syms) and any(s.startswith("ic_qconv2d") for s in syms)


def test_caller_arena_too_small_or_misaligned_is_an_error_code(tmp_path):
    model = tiny_model(tmp_path / "tiny.onnx")
    b = flow.build_library([model], "host", tmp_path / "p", flow.Library(names=["tiny"], arena="caller"), quiet=True)
    header = (b.outdir / "tiny_model.h").read_text()
    assert "int tiny_run(void);" not in header and "static union" not in (b.outdir / "tiny_model.c").read_text()
    for flags in ((), SANITIZE):
        r = subprocess.run([str(driver(b.outdir, "tiny", flags)), "arena"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        codes = dict(ln.split()[1:] for ln in r.stdout.splitlines())
        assert codes["too_small"] == "-2" and codes["misaligned"] == "-3" and codes["run_after_refusal"] == "-4"
    # the harness binary (its model table owns an arena for the caller-arena model) matches onnxruntime
    specs, outs = specs_of(b.summary["models"][0], "inputs"), specs_of(b.summary["models"][0], "outputs")
    x = reference.random_inputs(specs, 2)
    (tmp_path / "in.bin").write_bytes(pack(x, specs))
    subprocess.run([str(b.exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True, timeout=60)
    got = unpack((tmp_path / "out.bin").read_bytes(), outs)
    assert reference.compare(got, reference.run_onnxruntime(model.read_bytes(), x), flow.FP32_RTOL)["outputs_match"]


@pytest.mark.models
def test_arena_and_weights_sections_on_the_host(tmp_path):
    kws = mlperf_model("kws_dscnn_int8.onnx")
    lib = flow.Library(names=["kws"], arena_section=".kws_arena", weights_section=".kws_weights")
    b = flow.build_library([kws], "host", tmp_path / "p", lib, quiet=True)
    r = subprocess.run(["readelf", "-S", "-W", str(b.exe)], capture_output=True, text=True, check=True)
    secs = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"\]\s+(\S+)\s+\S+\s+([0-9a-f]+)", r.stdout)}
    assert ".kws_arena" in secs and ".kws_weights" in secs, r.stdout
    syms = subprocess.run(["nm", "-S", str(b.exe)], capture_output=True, text=True, check=True).stdout
    addr = {ln.split()[-1]: int(ln.split()[0], 16) for ln in syms.splitlines() if len(ln.split()) == 4}
    assert addr["kws_arena"] == secs[".kws_arena"]
    weights = [v for k, v in addr.items() if re.match(r"kws_l\d+_", k)]
    assert weights and all(v >= secs[".kws_weights"] for v in weights)
    m = b.summary["models"][0]
    x = reference.random_inputs(specs_of(m, "inputs"), 1)
    (tmp_path / "in.bin").write_bytes(pack(x, specs_of(m, "inputs")))
    subprocess.run([str(b.exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True, timeout=60)
    check_8bit(kws, x, unpack((tmp_path / "out.bin").read_bytes(), specs_of(m, "outputs")), lsb_scales=m["output_lsb"])


@pytest.mark.models
def test_two_threads_run_two_instances_like_a_serial_run_under_tsan(tmp_path):
    kws = mlperf_model("kws_dscnn_int8.onnx")
    b = flow.build_library([kws], "host", tmp_path / "p", flow.Library(names=["kws"], arena="caller"), quiet=True)
    m = b.summary["models"][0]
    x = reference.random_inputs(specs_of(m, "inputs"), 3)
    (tmp_path / "in.bin").write_bytes(pack(x, specs_of(m, "inputs")))
    exe = driver(b.outdir, "kws", TSAN)
    r = subprocess.run([str(exe), "threads", "2", "20", str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ThreadSanitizer" not in r.stderr, r.stdout + r.stderr[-3000:]
    assert r.stdout.count("mismatches 0") == 2, r.stdout
    check_8bit(kws, x, unpack((tmp_path / "out.bin").read_bytes(), specs_of(m, "outputs")), lsb_scales=m["output_lsb"])


def test_tsan_sees_two_threads_on_one_arena(tmp_path):
    """The sanitizer in use catches what the test above rules out: two threads on one context."""
    src = tmp_path / "race.c"
    src.write_text("#include <pthread.h>\nstatic int shared;\nstatic void *f(void *a) { (void)a; ++shared; return 0; }\n"
                   "int main(void) { pthread_t t[2]; int i; for (i = 0; i < 2; ++i) pthread_create(&t[i], 0, f, 0);\n"
                   "for (i = 0; i < 2; ++i) pthread_join(t[i], 0); return 0; }\n")
    subprocess.run(["gcc", *TSAN, "-o", str(tmp_path / "race"), str(src), "-pthread"], check=True, timeout=120)
    r = subprocess.run([str(tmp_path / "race")], capture_output=True, text=True, timeout=60)
    assert "WARNING: ThreadSanitizer: data race" in r.stderr


def test_streaming_model_state_steps_equal_onnxruntime_fed_by_hand(tmp_path):
    import onnx
    path = tmp_path / "streaming_kws.onnx"
    onnx.save(make_streaming.build(seed=0), path)
    b = flow.build_library([path], "host", tmp_path / "p", flow.Library(names=["stream"], states="auto"), quiet=True)
    m = b.summary["models"][0]
    # the planner writes the new frames and hidden state over the old (no copy); the running mean
    # is read after its new value is made, so it is copied back after the run
    assert {i: a for i, _, a in m["states"]} == {"frames_in": True, "h_in": True, "mean_in": False}
    text = (b.outdir / "stream_model.c").read_text()
    assert text.count("memcpy(ctx->arena + TD_OFF_") == 1 and "TD_OFF_mean_in, ctx->arena + TD_OFF_mean_out" in text
    assert [n for n, _, _ in m["inputs"]] == ["x"] and [n for n, _, _ in m["outputs"]] == ["scores"]
    steps = 6
    rng = np.random.default_rng(11)
    frames = [rng.standard_normal((1, make_streaming.C)).astype(np.float32) for _ in range(steps)]
    (tmp_path / "in.bin").write_bytes(b"".join(f.tobytes() for f in frames))
    # onnxruntime with the state fed by hand, from zeros
    import onnxruntime as ort
    sess = ort.InferenceSession(path.read_bytes(), providers=["CPUExecutionProvider"])
    state = {i.name: np.zeros(i.shape, np.float32) for i in sess.get_inputs() if i.name != "x"}
    want = []
    for f in frames:
        scores, fo, ho, mo = sess.run(["scores", "frames_out", "h_out", "mean_out"], {"x": f, **state})
        state = {"frames_in": fo, "h_in": ho, "mean_in": mo}
        want.append([scores, fo, ho, mo])
    for cc, flags in (("gcc", ()), ("gcc", SANITIZE), ("clang", ())):
        exe = driver(b.outdir, "stream", flags, cc)
        subprocess.run([str(exe), "steps", str(steps), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                       check=True, timeout=120)
        raw = (tmp_path / "out.bin").read_bytes()
        per = [("scores", (1, make_streaming.N)), ("frames", (1, make_streaming.C, 1, make_streaming.K - 1)),
               ("h", (1, make_streaming.H)), ("mean", (1, make_streaming.F))]
        spec = [(n, s, np.dtype(np.float32)) for n, s in per]
        size = sum(int(np.prod(s)) * 4 for _, s in per)
        for k in range(steps):
            got = unpack(raw[k * size:(k + 1) * size], spec)
            res = reference.compare(got, want[k], flow.FP32_RTOL)
            assert res["outputs_match"], f"step {k}: {res}"
        # after reset_state the first step again: the same scores, bit for bit
        again = np.frombuffer(raw[steps * size:steps * size + 4 * make_streaming.N], np.float32)
        assert np.array_equal(again, unpack(raw[:size], spec)[0].reshape(-1))


def test_planner_aliases_a_state_only_when_nothing_reads_it_later(tmp_path):
    import onnx
    from tinydeploy import planner
    from tinydeploy.pipeline import lower, prepared_graph
    from tinydeploy.schedule import select_kernels
    p = tmp_path / "s.onnx"
    onnx.save(make_streaming.build(seed=1), p)
    g = prepared_graph(p)
    kernels = select_kernels(g, lower(g), get_target("host"))
    pairs = (("frames_in", "frames_out"), ("h_in", "h_out"), ("mean_in", "mean_out"))
    plan = planner.plan_memory(g, kernels, 16, states=pairs)
    plain = planner.plan_memory(g, kernels, 16)
    assert plan.state_aliased == {"frames_out", "h_out"}
    for i, o in pairs:
        assert (plan.offsets[i] == plan.offsets[o]) == (o in plan.state_aliased)
    # the state inputs live to the end: nothing else ever shares their bytes
    owner = {n: b for b in plan.buffers for n in b.tensors}
    for i, _ in pairs:
        b = owner[i]
        others = [x for x in plan.buffers if x is not b and x.offset < b.offset + b.size and b.offset < x.offset + x.size]
        assert not others, (i, [x.tensors for x in others])
    assert plan.lower_bound >= plain.lower_bound


@pytest.mark.models
def test_scratch_section_takes_the_scratch_out_of_the_arena():
    path = mlperf_model("kws_dscnn_int8.onnx")
    from tinydeploy.codegen.project import Api
    c = compile_model(path, get_target("cortex-m4"), board="mps2-an386", api=Api("kws", scratch_section=".fast"))
    plain = compile_model(path, get_target("cortex-m4"), board="mps2-an386")
    scratch = [b.size for b in plain.plan.buffers if b.tensors[0].startswith("#scratch")]
    assert c.plan.scratch_bytes == max(scratch) and c.arena_bytes < plain.arena_bytes
    text = c.files["kws_model.c"]
    assert '__attribute__((section(".fast")))' in text and "TD_SCRATCH_AT(TD_OFF_scratch_l1)" in text


def test_shared_arena_saves_the_smaller_one(tmp_path):
    big = tiny_model(tmp_path / "big.onnx")
    small = tmp_path / "small.onnx"
    small.write_bytes(tiny_model(tmp_path / "t.onnx").read_bytes())
    r = cli_run(tmp_path, "build", big, small, "--share-arena", "-o", "p", timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"one arena shared by the models: ([\d,]+) B instead of ([\d,]+) B \(saves ([\d,]+) B\)", r.stdout)
    assert m, r.stdout
    shared, separate, saved = (int(g.replace(",", "")) for g in m.groups())
    arenas = [x["arena_bytes"] for x in json.loads((tmp_path / "p" / ".tinydeploy.json").read_text())["summary"]["models"]]
    assert separate - shared == saved > 0 and shared == max(arenas) and separate == sum(arenas)
    table = (tmp_path / "p" / "td_models.c").read_text()
    assert "td_shared_arena" in table and "big_ctx_init(&td_ctx_0, td_shared_arena.bytes" in table
    x = reference.random_inputs([("x", (1, 3, 8, 8), np.dtype(np.float32))], 0)
    (tmp_path / "in.bin").write_bytes(x["x"].tobytes())
    want = reference.run_onnxruntime(big.read_bytes(), x)
    for name in ("small", "big", "small"):       # each selection sets its context on the shared arena
        subprocess.run([str(tmp_path / "p" / "model_run"), name, str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                       check=True, timeout=60)
        got = [np.frombuffer((tmp_path / "out.bin").read_bytes(), np.float32).reshape(1, 10)]
        assert reference.compare(got, want, flow.FP32_RTOL)["outputs_match"]


@pytest.mark.parametrize("args,facts", [
    (["--name", "2fast"], ["--name '2fast'", "C identifier"]),
    (["--name", "td_x"], ["tinydeploy's own"]),
    (["--name", "a", "--name", "b"], ["given 2 times for 1 models"]),
    (["--arena-section", "my section"], ["--arena-section", "dot-separated"]),
    (["--weights-section", ".text.w"], ["--weights-section", "already places"]),
    (["--arena", "caller", "--scratch-section", ".fast"], ["--scratch-section", "static arena"]),
    (["--share-arena"], ["two or more models"]),
    (["--state", "x"], ["--state 'x'", "IN=OUT"]),
    (["--state", "x=nope"], ["no output 'nope'"]),
    (["--state", "auto"], ["found no state"]),
])
def test_bad_library_options_are_one_line(tmp_path, args, facts):
    model = tiny_model(tmp_path / "tiny.onnx")
    assert_user_error(cli_run(tmp_path, "build", model, "-o", "out", *args), *facts)
    assert not (tmp_path / "out" / "tiny_model.c").exists()


def test_clashing_names_of_two_models_are_refused(tmp_path):
    a = tiny_model(tmp_path / "a.onnx")
    assert_user_error(cli_run(tmp_path, "build", a, a, "--name", "kws", "--name", "kws_x"), "'kws' and 'kws_x'", "clash")
    assert_user_error(cli_run(tmp_path, "build", a, a, "--name", "kws", "--name", "KWS"), "clash")
    assert_user_error(cli_run(tmp_path, "build", a, a), "'a' and 'a'")


def test_default_names_come_from_the_file_names(tmp_path):
    m = tiny_model(tmp_path / "3-Conv.Model v2.onnx")
    b = flow.build_library([m], "host", tmp_path / "p", flow.Library(), quiet=True)
    assert b.summary["models"][0]["name"] == "m3_conv_model_v2"
    assert (b.outdir / "m3_conv_model_v2_model.h").is_file()


def test_library_form_is_byte_identical_for_the_same_inputs(tmp_path):
    import onnx
    from tinydeploy.codegen.project import Api
    from tinydeploy.pipeline import compile_image
    path = tmp_path / "s.onnx"
    onnx.save(make_streaming.build(seed=2), path)
    other = tiny_model(tmp_path / "t.onnx")

    def image():
        apis = [Api("s", arena_section=".a", weights_section=".w"), Api("t", arena_section=".a", weights_section=".w")]
        return compile_image([path, other], get_target("cortex-m4"), apis, state_pairs="auto", header="/* @FILE@ */")
    a, b = image(), image()
    assert a.files == b.files and set(a.files) >= {"model.h", "td_models.c", "s_model.c", "t_weights.h"}
