"""Instructions counted under qemu-aarch64 by tinydeploy's QEMU plugin (tinydeploy/runners/icount.py):
the plugin counts a known loop exactly and repeatably (instructions, SIMD/FP instructions, FMA lanes,
windows, the N-run minus 1-run difference), `run --emulate` reports latency.instructions for the
Cortex-A boards, `bench --emulate` per inference and per layer, and the peers (LiteRT here,
onnxruntime's aarch64 library under QEMU) fail with one clear line when their pieces are missing.
Counts, not times: nothing here depends on how busy the machine is."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from tinydeploy import flow
from tinydeploy.errors import TinydeployError
from tinydeploy.runners import icount
from util import REPO, make_model, mlperf_model, require, save

# One iteration: 3 vector/scalar FMAs of 4 + 2 + 4 lanes and one scalar FMADD (11 lanes, 4 SIMD/FP
# instructions), then the loop's add, add, cmp, branch: 8 instructions.
LOOP_C = r"""
#include <stdlib.h>
__attribute__((noinline)) void work(long n)
{
    long i;
    for (i = 0; i < n; ++i) {
        __asm__ volatile("fmla v0.4s, v1.4s, v2.4s\n\tfmla v3.2d, v4.2d, v5.2d\n\tfmadd s0, s1, s2, s3\n\t"
                         "fmla v6.4s, v7.4s, v8.s[1]\n\tadd x9, x9, #1" ::: "v0", "v3", "v6", "x9");
    }
}
int main(int argc, char **argv)
{
    long n = atol(argv[1]), r = atol(argv[2]), k;
    for (k = 0; k < r; ++k) {
        work(n);
    }
    return 0;
}
"""
PER_ITERATION = (8, 4, 11)


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    d = tmp_path_factory.mktemp("loop")
    (d / "loop.c").write_text(LOOP_C)
    subprocess.run(["aarch64-linux-gnu-gcc", "-O2", "-static", "-o", str(d / "loop"), str(d / "loop.c")], check=True)
    return d / "loop"


def count_loop(exe: Path, n: int, r: int, tmp: Path) -> icount.Report:
    out = tmp / f"count-{n}-{r}.txt"
    subprocess.run(["qemu-aarch64", *icount.qemu_args(out, icount.windows(exe, run="work")), "-cpu", "cortex-a72",
                    str(exe), str(n), str(r)], check=True)
    return icount.read_report(out)


def test_plugin_counts_a_known_loop_exactly(loop, tmp_path):
    a, b = count_loop(loop, 1000, 1, tmp_path), count_loop(loop, 1000, 1, tmp_path)
    assert a == b and a.vcpus == 1 and a.windows == 1                    # repeats to the instruction
    # the window: the loop's iterations plus work()'s 5 instructions around them, nothing else
    assert a.first == (1000 * 8 + 5, 1000 * 4, 1000 * 11)
    assert a.total[0] > a.first[0] + 10000                               # the program's start-up, outside
    four, seven = count_loop(loop, 1000, 4, tmp_path), count_loop(loop, 1000, 7, tmp_path)
    # whole programs, N calls minus 1 call: proportional to N - 1, exactly (the call and main's loop
    # add a few instructions per call to the window's)
    per_call = (four.total[0] - a.total[0]) // 3
    assert seven.total[0] - a.total[0] == 6 * per_call and 0 < per_call - a.first[0] < 10
    assert [x - y for x, y in zip(seven.total[1:], a.total[1:])] == [6 * 1000 * 4, 6 * 1000 * 11]
    assert seven.windows == 7 and seven.steady == (a.first[0], a.first[0])
    per = icount.per_inference(a, seven)
    assert (per.instructions, per.simd_fp_instructions, per.fma_lanes) == a.first and per.exact
    # proportional: twice the iterations, twice the loop's share
    two = count_loop(loop, 2000, 1, tmp_path)
    assert [x - y for x, y in zip(two.first, a.first)] == [1000 * k for k in PER_ITERATION]


def _report(first, steady, windows, vcpus=1, layers=None):
    return icount.Report(vcpus=vcpus, total=(0, 0, 0), windows=windows, first=first,
                         sum=tuple(f + s * (windows - 1) for f, s in zip(first, steady)),
                         steady=(steady[0], steady[0]) if windows > 1 else None, layers=layers or {})


def test_per_inference_is_the_difference_and_refuses_what_is_not_exact():
    one = _report((110, 10, 20), (100, 10, 20), 1, layers={0: (1, (60, 5, 20)), 1: (1, (40, 5, 0))})
    many = _report((110, 10, 20), (100, 10, 20), 3, layers={0: (3, (180, 15, 60)), 1: (3, (120, 15, 0))})
    per = icount.per_inference(one, many)
    assert (per.instructions, per.simd_fp_instructions, per.fma_lanes, per.first_instructions) == (100, 10, 20, 110)
    assert per.inferences == 2 and per.exact and per.layers == [(60, 5, 20), (40, 5, 0)]
    varied = _report((110, 10, 20), (100, 10, 20), 3)
    varied.steady = (99, 101)
    with pytest.raises(TinydeployError, match="instruction counts differ between inferences"):
        icount.per_inference(one, varied)
    assert icount.per_inference(one, varied, exact=False).exact is False        # a peer: the mean
    with pytest.raises(TinydeployError, match="2 threads: instruction counts are exact for one thread only"):
        icount.per_inference(one, _report((110, 10, 20), (100, 10, 20), 3, vcpus=2))
    with pytest.raises(TinydeployError, match="made 1 and 1 inferences"):
        icount.per_inference(one, one)


def tiny_conv(tmp_path: Path) -> Path:
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 3, 3], np.linspace(-1, 1, 108, dtype=np.float32))
    m = make_model([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                    helper.make_node("Relu", ["c"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w])
    return save(m, tmp_path, "tiny.onnx")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """tiny_conv in a folder of its own (one per test worker): the commands run there, so the rpi4
    build in its build/ is made once and reused by the tests that follow."""
    return tiny_conv(tmp_path_factory.mktemp("tiny"))


def tdy(*args, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "tinydeploy", *args], capture_output=True, text=True, cwd=cwd, env=e)


def test_run_emulate_reports_exact_instructions(tiny):
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    path, board = tiny, "rpi4"
    r = tdy("run", "--board", board, "--emulate", str(path), "--json", cwd=path.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    lat = json.loads(r.stdout)["latency"]
    assert lat["instructions"] > 0 and lat["exact"] is True and lat["median_ms"] is None
    assert lat["simd_fp_instructions"] > 0 and lat["fma_lanes"] >= 4 * 8 * 8 * 27      # every MAC on an FMA lane
    assert lat["first_inference_instructions"] == lat["instructions"]
    built = path.parent / flow.default_outdir(path, board)                             # the command's build
    again = flow.run(path, board, outdir=built, quiet=True, emulate=True)["latency"]
    assert again["instructions"] == lat["instructions"]                                  # repeatable
    plain = flow.run(path, board, outdir=built, quiet=True, emulate=True, latency=False)["latency"]
    assert "instructions" not in plain                                                   # latency=False: no count


@pytest.mark.models
def test_int8_inferences_count_the_same(tmp_path):
    """The arena reuses the input's bytes: the harness puts the inputs back before every inference,
    so the 3-inference run counts each one like the first (8-bit kernels' counts depend on data)."""
    res = flow.run(mlperf_model("kws_dscnn_int8.onnx"), "rpi4", outdir=tmp_path / "b", quiet=True, emulate=True)
    # KWS's 2,664,768 MACs at no more than 16 per instruction (one SDOT; rpi4 has none): a whole
    # inference, not a part of one
    assert res["outputs_match"] and res["latency"]["exact"] and res["latency"]["instructions"] > 2_664_768 // 16


def test_bench_emulate_per_inference_and_per_layer(tiny):
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    path, tmp_path = tiny, tiny.parent
    r = tdy("bench", "--board", "rpi4", "--emulate", "--peers", "none", "--json", str(path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(r.stdout)
    assert row["instructions"] > 0 and row["outputs_match"] and "ratio" not in row and row["emulated"]
    r = tdy("bench", "--board", "rpi4", "--emulate", "--layers", "--json", str(path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (res,) = json.loads(r.stdout)
    (layer,) = res["layers"]
    assert layer["op"].startswith("Conv") and 0 < layer["instructions"] <= res["instructions"]
    assert res["layers_instructions_sum"] == layer["instructions"] and layer["share_percent"] == 100.0
    r = tdy("bench", "--board", "host", "--emulate", str(path), cwd=tmp_path)
    assert r.returncode == 2 and "runs natively here" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_compiler_or_plugin_support_is_one_clear_line(tiny, tmp_path):
    require("aarch64-linux-gnu-gcc")
    path = tiny
    r = tdy("run", "--board", "rpi4", "--emulate", str(path), cwd=path.parent,
            env={"TINYDEPLOY_CACHE": str(tmp_path / "cache"), "TINYDEPLOY_PLUGIN_CC": "no-such-cc-td"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "tinydeploy: error: counting instructions under QEMU needs a C compiler for this machine (no-such-cc-td) "
        "to build tinydeploy's QEMU plugin; install gcc (Debian: apt-get install gcc)")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "qemu-aarch64").write_text("#!/bin/sh\necho 'usage: qemu-aarch64 [options] program [arguments...]'\n")
    (fake / "qemu-aarch64").chmod(0o755)
    r = tdy("run", "--board", "rpi4", "--emulate", str(path), cwd=path.parent,
            env={"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "was built without TCG plugin support" in r.stderr.strip().splitlines()[-1]


def test_plugin_builds_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYDEPLOY_CACHE", str(tmp_path / "cache"))
    p = icount.plugin()
    assert p.is_file() and p.is_relative_to(tmp_path / "cache") and icount.plugin() == p
    assert [f.name for f in p.parent.iterdir()] == ["libtdcount.so"]            # no half-written files


# ---- peers: LiteRT on the host, onnxruntime's aarch64 library under QEMU ---------------------------

def test_litert_missing_is_one_clear_line(tmp_path):
    path = tiny_conv(tmp_path)
    (tmp_path / "tiny.tflite").write_bytes(b"not a flatbuffer")
    blocked = tmp_path / "blocked" / "ai_edge_litert"        # LiteRT made unimportable, installed or not
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('blocked by the test')\n")
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{blocked.parent}"}
    r = tdy("bench", "--seconds", "0.01", "--tflite", str(tmp_path / "tiny.tflite"), str(path), cwd=tmp_path, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "tinydeploy: error: LiteRT is not installed (the optional extra: pip install 'tinydeploy[litert]', which "
        "installs ai-edge-litert)")
    # a twin found beside the model: left out with one line, the bench goes on
    r = tdy("bench", "--seconds", "0.01", "--json", str(path), cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert [ln for ln in r.stderr.splitlines() if "peer left out" in ln] == [
        "[tinydeploy] peer left out: LiteRT is not installed (the optional extra: pip install 'tinydeploy[litert]', "
        "which installs ai-edge-litert)"]
    (row,) = json.loads(r.stdout)
    assert "litert_median_ms" not in row and row["onnxruntime_median_ms"] > 0
    r = tdy("bench", "--seconds", "0.01", "--tflite", str(tmp_path / "none.tflite"), str(path), cwd=tmp_path, env=env)
    assert r.returncode == 2 and "none.tflite does not exist" in r.stderr and "Traceback" not in r.stderr


def test_litert_twin_lookup(tmp_path):
    from tinydeploy.runners.litert import find_twin
    m = tmp_path / "m.onnx"
    assert find_twin(m) is None
    (tmp_path / "tflite").mkdir()
    (tmp_path / "tflite" / "m.tflite").write_bytes(b"")
    assert find_twin(m) == tmp_path / "tflite" / "m.tflite"
    (tmp_path / "m.tflite").write_bytes(b"")
    assert find_twin(m) == tmp_path / "m.tflite"
    assert find_twin(m, tmp_path / "tflite") == tmp_path / "tflite" / "m.tflite"


def test_onnxruntime_aarch64_missing_pieces_are_one_clear_line(tiny, tmp_path):
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    path = tiny
    base = {"TINYDEPLOY_CACHE": str(tmp_path / "cache")}
    r = tdy("bench", "--board", "rpi4", "--emulate", "--peers", "require", str(path), cwd=path.parent,
            env={**base, "TINYDEPLOY_ORT_HEADERS": str(tmp_path / "no-headers")})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("tinydeploy: error: onnxruntime's C API headers (onnxruntime_c_api.h) not found in ")
    assert "set TINYDEPLOY_ORT_HEADERS" in last
    # the wheel cannot be fetched (no index, nothing to find: no network in tests)
    headers = tmp_path / "headers"
    headers.mkdir()
    (headers / "onnxruntime_c_api.h").write_text("/* not the real header */\n")
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    offline = {**base, "TINYDEPLOY_ORT_HEADERS": str(headers), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(empty),
               "PIP_CONFIG_FILE": os.devnull}
    r = tdy("bench", "--board", "rpi4", "--emulate", "--peers", "require", str(path), cwd=path.parent, env=offline)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("tinydeploy: error: cannot fetch onnxruntime ") and "linux-aarch64 wheel from PyPI" in last
    # auto: the bench goes on without the peer, after one line saying why
    r = tdy("bench", "--board", "rpi4", "--emulate", "--json", str(path), cwd=path.parent, env=offline)
    assert r.returncode == 0, r.stderr
    assert len([ln for ln in r.stderr.splitlines() if "peer left out: cannot fetch onnxruntime" in ln]) == 1
    (row,) = json.loads(r.stdout)
    assert row["instructions"] > 0 and "onnxruntime_instructions" not in row
