"""`--threads N` (tinydeploy/schedule/threads.py `parallelise`, the OpenMP loops of the fast drivers): every
threaded algorithm (conv2d_gemm, conv2d_igemm, conv2d_gemmt, conv2d_dw, dense_packed, each forced
by TINYDEPLOY_ALGO) on a small synthetic model with batch 2, groups, strides and tails, built
with 1 and 4 threads: both match onnxruntime and are bit-identical to each other; threads = 1
generates exactly the serial code; the NEON build runs on 2 threads under qemu-aarch64; a
microcontroller board refuses --threads."""
from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto, helper

from tinydeploy import cli, flow, reference
from tinydeploy import schedule
from tinydeploy.schedule import threads as threads_mod
from tinydeploy.errors import TinydeployError
from tinydeploy.pipeline import compile_model
from tinydeploy.targets import get_target
from tinydeploy.runners import select_runner
from util import SANITIZE, make_model, mlperf_model, require, save

ALGOS = ["conv2d_gemm", "conv2d_igemm", "conv2d_gemmt", "conv2d_dw", "dense_packed"]
PRAGMA = re.compile(r"#pragma omp parallel for num_threads\((\d+)\)")
OPENMP = re.compile(r"\bomp\b|\bomp_|<omp\.h>|openmp")      # ("compile-time" holds "omp")


def small_model():
    """Batch 2: 3x3 conv (im2col / implicit GEMM), depthwise stride 2 (12 groups when forced
    into a GEMM), 1x1 conv on a 5x5 plane (gemmt), depthwise stride 1 with relu6, then a fully
    connected layer of 2 rows and 100 columns."""
    rng = np.random.default_rng(7)

    def init(name, shape):
        return helper.make_tensor(name, TensorProto.FLOAT, shape, rng.standard_normal(shape).astype(np.float32).ravel())
    inits = [init("w1", [12, 8, 3, 3]), init("b1", [12]), init("w2", [12, 1, 3, 3]), init("w3", [20, 12, 1, 1]),
             init("b3", [20]), init("w4", [20, 1, 3, 3]), init("w5", [500, 100]), init("b5", [100]),
             helper.make_tensor("lo", TensorProto.FLOAT, [], [0.0]), helper.make_tensor("hi", TensorProto.FLOAT, [], [6.0]),
             helper.make_tensor("shape", TensorProto.INT64, [2], [2, 500])]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2], group=12),
        helper.make_node("Conv", ["c2", "w3", "b3"], ["c3"], kernel_shape=[1, 1]),
        helper.make_node("Conv", ["c3", "w4"], ["c4"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=20),
        helper.make_node("Clip", ["c4", "lo", "hi"], ["r4"]),
        helper.make_node("Reshape", ["r4", "shape"], ["f"]),
        helper.make_node("Gemm", ["f", "w5", "b5"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 10, 10])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 100])
    return make_model(nodes, [x], [y], inits)


@pytest.fixture
def model(tmp_path, monkeypatch):
    # every layer of the small model is worth threading (the real threshold keeps tiny layers serial)
    monkeypatch.setattr(threads_mod, "MIN_THREAD_MACS", 64)
    return save(small_model(), tmp_path)


def build_and_run(path, outdir, threads, board="host", extra_cflags=None):
    b = flow.build(path, board, outdir, quiet=True, cc="gcc" if board == "host" else None, threads=threads,
                   extra_cflags=extra_cflags)
    specs = flow.io_specs(b.summary, "inputs")
    x = reference.random_inputs(specs, 0)
    got, _ = select_runner(board, emulate=board != "host").run(
        b.exe, [x[n] for n, _, _ in specs], [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")])
    want = reference.run_onnxruntime(path.read_bytes(), x)
    res = reference.compare(got, want, flow.FP32_RTOL)
    assert res["outputs_match"], f"{threads} threads: {res}"
    return got, b


def threaded_families(compiled) -> dict[str, int]:
    return {k.family: k.params["THREADS"] for k in compiled.kernels if k is not None and "THREADS" in k.params}


@pytest.mark.parametrize("algo", ALGOS)
def test_threads_bit_identical_to_one_thread(algo, model, tmp_path, monkeypatch):
    require("gcc")
    monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
    one, b1 = build_and_run(model, tmp_path / "t1", 1)
    four, b4 = build_and_run(model, tmp_path / "t4", 4)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(one, four)), "4 threads differ from 1 thread"
    used = threaded_families(b4.compiled)
    assert used.get(algo, 0) > 1, f"{algo} did not run threaded: {used}"
    src = (tmp_path / "t4" / "td_kernels.c").read_text()
    assert PRAGMA.search(src) and all(1 < int(n) <= 4 for n in PRAGMA.findall(src))
    assert "-fopenmp" in (tmp_path / "t4" / "Makefile").read_text()
    assert not threaded_families(b1.compiled)


def test_one_thread_generates_the_serial_code(model, tmp_path, monkeypatch):
    for algo in ALGOS:
        monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
        default = compile_model(model, get_target("host"), command="c")
        one = compile_model(model, get_target("host"), command="c", threads=1)
        assert default.files == one.files
        assert not any(OPENMP.search(text) for text in one.files.values()), algo
    monkeypatch.delenv("TINYDEPLOY_ALGO")
    b = flow.build(model, "host", tmp_path / "b", quiet=True, cc="gcc")
    assert not any(OPENMP.search((tmp_path / "b" / f).read_text()) for f in b.summary["files"])


def test_per_thread_scratch_and_threshold(model, monkeypatch):
    monkeypatch.setenv("TINYDEPLOY_ALGO", "conv2d_gemm")
    one = compile_model(model, get_target("host"))
    three = compile_model(model, get_target("host"), threads=3)
    for k1, k3 in zip(one.kernels, three.kernels):
        if k3 is None or "THREADS" not in k3.params:
            continue
        t = k3.params["THREADS"]
        assert 1 < t <= min(3, schedule.parallel_blocks(k1))
        # a slice of the packing buffer per thread (conv2d_gemm: of the thread's columns only)
        assert k3.scratch_bytes == 4 * t * k3.params["WST"]
        if k3.family == "conv2d_gemm":
            assert k3.params["WST"] >= k3.params["KC"] * k3.params["NC"] and k3.params["NC"] <= k1.params["NC"]
        assert f"threads {t}]" in k3.desc
    assert three.plan.arena_bytes >= one.plan.arena_bytes
    monkeypatch.setattr(threads_mod, "MIN_THREAD_MACS", 10 ** 9)      # nothing is worth a thread
    assert compile_model(model, get_target("host"), threads=3).files["td_kernels.c"] == one.files["td_kernels.c"]


def test_asan_ubsan_threaded(model, tmp_path, monkeypatch):
    require("gcc")
    monkeypatch.setenv("TINYDEPLOY_ALGO", "conv2d_gemm")
    build_and_run(model, tmp_path / "asan", 3, extra_cflags=SANITIZE)


def test_mlperf_kws_two_threads_bit_identical(tmp_path):
    require("gcc")
    path = mlperf_model("kws_dscnn_fp32.onnx")
    one, _ = build_and_run(path, tmp_path / "t1", 1)
    two, b2 = build_and_run(path, tmp_path / "t2", 2)
    assert threaded_families(b2.compiled)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(one, two))


def test_aarch64_two_threads_under_qemu(model, tmp_path, monkeypatch):
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    monkeypatch.setenv("TINYDEPLOY_ALGO", "conv2d_gemm")     # the NEON micro-kernel, grouped layers too
    one, _ = build_and_run(model, tmp_path / "a1", 1, board="rpi4")
    two, b2 = build_and_run(model, tmp_path / "a2", 2, board="rpi4")
    makefile = (tmp_path / "a2" / "Makefile").read_text()
    assert threaded_families(b2.compiled) and "-static" in makefile and "-fopenmp" in makefile
    assert all(a.tobytes() == b.tobytes() for a, b in zip(one, two))


def test_threads_refused_for_microcontrollers(model, capsys):
    with pytest.raises(TinydeployError, match="Linux boards"):
        flow.build(model, "nano33ble", threads=2, quiet=True)
    assert cli.main(["run", "--board", "mps2-an386", "--threads", "2", str(model)]) == 2
    err = capsys.readouterr().err
    assert "Linux boards" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert cli.main(["build", "--threads", "0", str(model)]) == 2
    assert "--threads must be" in capsys.readouterr().err


@pytest.mark.parametrize("board", ["host", "rpi4"])
def test_8bit_implicit_gemm_threaded_bit_exact(board, tmp_path, monkeypatch):
    """qconv2d_igemm on 2 threads (the planes of disjoint channel groups, then the tiles): IC int8's
    stride-2 3x3 layers on rpi4 (where the implicit GEMM is chosen; under qemu-aarch64), and every
    KxK layer forced onto it on the host: bit for bit with the exact reference."""
    require("gcc")
    if board == "rpi4":
        require("aarch64-linux-gnu-gcc")
        require("qemu-aarch64")
    else:
        monkeypatch.setenv("TINYDEPLOY_ALGO", "qconv2d_igemm")
    res = flow.run(mlperf_model("ic_resnet8_int8.onnx"), board, outdir=tmp_path / "b", quiet=True, latency=False,
                   emulate=board != "host", threads=2)
    assert res["exact_reference"]["identical"] and res["outputs_match"], res
    src = (tmp_path / "b" / "td_kernels.c").read_text()
    assert re.search(r"\[qconv2d_igemm [^]]* threads 2\]", src) and PRAGMA.search(src)
