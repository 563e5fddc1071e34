"""The generated CMakeLists.txt builds the same harness as the generated Makefile, with the same
flags: for the host with cc, and for rpi4 with the aarch64 cross compiler (run under qemu-aarch64);
both binaries must give byte-identical outputs, which also match onnxruntime."""
import dataclasses
import re
import shlex
import subprocess

import numpy as np
import pytest

from tinydeploy import build as bld, flow, reference
from tinydeploy.targets import get_target
from tinydeploy.runners import select_runner
from test_deploy import tiny_model
from util import require


def cmake_flags(text: str) -> list[str]:
    return re.search(r'set\(TD_CFLAGS "([^"]*)"', text).group(1).split(";")


def make_flags(text: str) -> list[str]:
    return shlex.split(re.search(r"^CFLAGS \?= (.*)$", text, re.M).group(1))


def test_cmake_and_makefile_flags_come_from_one_list():
    target = get_target("aarch64-cortex-a72")
    for t in (target, dataclasses.replace(target, cflags=[*target.cflags, "-fopenmp"])):
        files = bld.host_files("Makefile -- test", "/* test */", t)
        assert cmake_flags(files["CMakeLists.txt"]) == make_flags(files["Makefile"]) == t.cflags
    assert "-mcpu=cortex-a72" in target.cflags and "aarch64-linux-gnu-gcc" in files["CMakeLists.txt"]


@pytest.mark.parametrize("board,cc", [("host", "cc"), ("rpi4", "aarch64-linux-gnu-gcc")])
def test_cmake_build_matches_makefile_build(board, cc, tmp_path):
    require("cmake")
    require("make")
    require(cc)
    model = tiny_model(tmp_path / "tiny.onnx")
    b = flow.build(model, board, tmp_path / "p", quiet=True)
    out = b.outdir
    runner = select_runner(board, emulate=board != "host")
    subprocess.run(["make", "-B", f"CC={cc}"], cwd=out, check=True, capture_output=True, timeout=300)
    cm = subprocess.run(["cmake", "-S", ".", "-B", "cm", f"-DCMAKE_C_COMPILER={cc}"], cwd=out, capture_output=True,
                        text=True, timeout=300)
    assert cm.returncode == 0, cm.stdout[-1500:] + cm.stderr[-1500:]
    cb = subprocess.run(["cmake", "--build", "cm"], cwd=out, capture_output=True, text=True, timeout=300)
    assert cb.returncode == 0, cb.stdout[-1500:] + cb.stderr[-1500:]
    specs = flow.io_specs(b.summary, "inputs")
    out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
    x = reference.random_inputs(specs, 3)
    feeds = [x[n] for n, _, _ in specs]
    by_make, _ = runner.run(out / "model_run", feeds, out_specs)
    by_cmake, _ = runner.run(out / "cm" / "model_run", feeds, out_specs)
    assert all(np.array_equal(a, c) for a, c in zip(by_make, by_cmake))
    want = reference.run_onnxruntime(model.read_bytes(), x)
    assert reference.compare(by_cmake, want, flow.FP32_RTOL)["outputs_match"]
