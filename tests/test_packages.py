"""A model as the packages other build systems use (`tinydeploy build --package`,
tinydeploy/packages.py), built from consumer projects written by hand (tests/consumer/): the CMake
package for the host, aarch64 and arm-none-eabi (add_subdirectory and find_package), the
PlatformIO library offline (lib_deps = file://...) and run under QEMU; the Arduino library and the
Zephyr module, whose toolchains cannot be installed here, checked for form."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tinydeploy import flow, packages, reference
from tinydeploy.firmware import pio as tp
from tinydeploy.targets.boards import get_board
from test_library import pack, specs_of, unpack
from test_platformio import LINKER, SEMIHOST_C, SEMIHOST_H, STARTUP_C, pio_core  # noqa: F401 (fixture)
from util import REPO, check_8bit, mlperf_model, require

CONSUMER = REPO / "tests" / "consumer"


@pytest.fixture(scope="module")
def kws():
    return mlperf_model("kws_dscnn_int8.onnx")


def package(kws, board: str, tmp_path: Path) -> tuple[Path, dict]:
    b = flow.build_library([kws], board, tmp_path / f"build-{board}", flow.Library(names=["kws"], package=True),
                           quiet=True, emulate=False)
    return b.outdir / "package" / "kws", b.summary["models"][0]


@pytest.mark.models
def test_packages_are_well_formed(kws, tmp_path):
    import yaml
    pkg, _ = package(kws, "mps2-an386", tmp_path)
    assert packages.check(pkg) == []
    for f in ("library.json", "library.properties", "CMakeLists.txt", "kwsConfig.cmake", "kwsConfigVersion.cmake",
              "zephyr/module.yml", "zephyr/CMakeLists.txt", "zephyr/Kconfig", "README.md", "src/kws_model.h"):
        assert (pkg / f).is_file(), f
    assert yaml.safe_load((pkg / "zephyr" / "module.yml").read_text()) == {
        "name": "kws", "build": {"cmake": "zephyr", "kconfig": "zephyr/Kconfig"}}
    assert "config TINYDEPLOY_KWS\n\tbool" in (pkg / "zephyr" / "Kconfig").read_text()
    assert "toolchains could not be installed" in (pkg / "README.md").read_text().replace("\n", " ")
    # what check() catches
    bad = tmp_path / "bad" / "kws"
    shutil.copytree(pkg, bad)
    props = (bad / "library.properties").read_text()
    (bad / "library.properties").write_text(props.replace("category=Data Processing", "category=Machine Learning")
                                            .replace("version=", "version=v"))
    (bad / "zephyr" / "module.yml").write_text("name: kws\nbuild:\n  cmake: nowhere\n")
    (bad / "src" / "kws_weights.c").unlink()
    found = packages.check(bad)
    for want in ("category", "version is not", "build.cmake has no CMakeLists.txt", "kws_weights.c is not in src/"):
        assert any(want in p for p in found), (want, found)


def cmake_build(src: Path, build: Path, *defs: str, env=None) -> None:
    require("cmake")
    for cmd in (["cmake", "-S", str(src), "-B", str(build), *defs], ["cmake", "--build", str(build)]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.models
@pytest.mark.parametrize("board,cc", [("host", "cc"), ("rpi4", "aarch64-linux-gnu-gcc"),
                                      ("mps2-an386", "arm-none-eabi-gcc")])
def test_cmake_package_builds_from_a_consumer(kws, board, cc, tmp_path):
    require(cc)
    pkg, m = package(kws, board, tmp_path)
    if board == "mps2-an386":
        defs = [f"-DCMAKE_TOOLCHAIN_FILE={CONSUMER / 'cmake' / 'arm-none-eabi.cmake'}"]
    else:
        defs = [f"-DCMAKE_C_COMPILER={cc}"] + (["-DCMAKE_EXE_LINKER_FLAGS=-static"] if board == "rpi4" else [])
    cmake_build(CONSUMER / "cmake", tmp_path / "sub", f"-DMODEL_PACKAGE={pkg}", *defs)
    cmake_build(CONSUMER / "cmake", tmp_path / "find", "-DUSE_FIND_PACKAGE=ON", f"-DCMAKE_PREFIX_PATH={pkg}", *defs)
    exe = tmp_path / "find" / "consumer"
    assert exe.is_file()
    flags = (tmp_path / "find" / "CMakeCache.txt").read_text()
    assert re.search(r"KWS_C_FLAGS:STRING=.*-O[23]", flags)
    if board == "mps2-an386":
        return      # bare metal: linked against newlib's stubs; the PlatformIO test runs one under QEMU
    prefix = [] if board == "host" else get_board(board).qemu_user
    ins, outs = specs_of(m, "inputs"), specs_of(m, "outputs")
    x = reference.random_inputs(ins, 8)
    (tmp_path / "in.bin").write_bytes(pack(x, ins))
    for built in (tmp_path / "sub" / "consumer", exe):
        r = subprocess.run([*prefix, str(built), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        check_8bit(kws, x, unpack((tmp_path / "out.bin").read_bytes(), outs), label=f"cmake {board}",
                   lsb_scales=m["output_lsb"])


@pytest.mark.models
def test_platformio_library_builds_offline_from_a_consumer(kws, pio_core, tmp_path):  # noqa: F811
    pkg, m = package(kws, "mps2-an386", tmp_path)
    proj = tmp_path / "consumer"
    shutil.copytree(CONSUMER / "platformio", proj)
    (proj / "src" / "startup.c").write_text(STARTUP_C)
    (proj / "src" / "semihost.c").write_text(SEMIHOST_C)
    (proj / "include").mkdir()
    (proj / "include" / "semihost.h").write_text(SEMIHOST_H)
    board = get_board("mps2-an386")
    (proj / "link.ld").write_text(LINKER.format(flash_bytes=board.flash_bytes, flash_origin=board.flash_origin,
                                                ram_bytes=board.ram_bytes, ram_origin=board.ram_origin))
    env = dict(pio_core["env"], TD_MODEL_PACKAGE=str(pkg), TD_PIO_PLATFORM=str(tp.platform_dir()))
    r = subprocess.run(["pio", "run"], cwd=proj, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "kws" in r.stdout and not pio_core["net_log"].exists()
    elf = proj / ".pio" / "build" / "mps2-an386" / "firmware.elf"
    q = subprocess.run([require("qemu-system-arm"), "-M", "mps2-an386", "-display", "none", "-monitor", "none",
                        "-serial", "none", "-semihosting-config", "enable=on,target=native", "-kernel", str(elf)],
                       capture_output=True, text=True, timeout=120)
    text = q.stdout + q.stderr
    assert q.returncode == 0 and "consumer: ok" in text, text
    got = bytes.fromhex(re.search(r"consumer: outputs ([0-9a-f]+)", text).group(1))
    ins, outs = specs_of(m, "inputs"), specs_of(m, "outputs")
    x = {n: np.zeros(s, d) for n, s, d in ins}
    check_8bit(kws, x, unpack(got, outs), label="platformio consumer", lsb_scales=m["output_lsb"])
