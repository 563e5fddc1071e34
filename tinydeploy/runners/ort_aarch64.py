"""onnxruntime's own linux-aarch64 library under the same user-mode QEMU and the same counting
plugin as tinydeploy's build (runners/icount.py): the peer of `tinydeploy bench --board rpi4
--emulate`, so both are counted in the same unit, instructions per inference, on the same inputs.

What it needs, each piece with a clear error when it is missing:
- onnxruntime's C API headers, which are not part of tinydeploy: $TINYDEPLOY_ORT_HEADERS, else
  `../shared/third_party/onnxruntime-c-api/include` beside the checkout or the current folder;
- the shared library from PyPI's manylinux aarch64 wheel of the onnxruntime installed here (the
  pinned version), fetched once with `pip download` into tinydeploy's cache folder;
- the board's cross compiler (the harness, ort_peer_harness.c, is compiled at bench time) and the
  aarch64 C++ runtime the library links (Debian: /usr/aarch64-linux-gnu, libstdc++6-arm64-cross);
- a sysroot for `qemu-aarch64 -L` in the cache: the cross runtime, plus a /proc/cpuinfo and a
  /sys/devices/system/cpu tree describing the emulated core (onnxruntime reads them to pick its
  kernels and crashes under qemu-user on an x86 host's own), made from what the core reports.

A benchmark, not a test: onnxruntime's inferences vary by a few hundred instructions (its
allocator and bookkeeping), so its figure is the mean of (count(N) - count(1)) / (N - 1)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.runners import icount
from tinydeploy.runners.harness import pack_inputs

HARNESS_SOURCE = Path(__file__).with_name("ort_peer_harness.c")
HEADERS_ENV = "TINYDEPLOY_ORT_HEADERS"
HEADERS_BESIDE = Path("..") / "shared" / "third_party" / "onnxruntime-c-api" / "include"
RUNS = 3                   # inferences of the counted N-inference run
TIMEOUT_S = 3600

# Linux's names of the AArch64 HWCAP and HWCAP2 bits, in bit order (/proc/cpuinfo "Features")
HWCAP = ["fp", "asimd", "evtstrm", "aes", "pmull", "sha1", "sha2", "crc32", "atomics", "fphp", "asimdhp", "cpuid",
         "asimdrdm", "jscvt", "fcma", "lrcpc", "dcpop", "sha3", "sm3", "sm4", "asimddp", "sha512", "sve", "asimdfhm",
         "dit", "uscat", "ilrcpc", "flagm", "ssbs", "sb", "paca", "pacg"]
HWCAP2 = ["dcpodp", "sve2", "sveaes", "svepmull", "svebitperm", "svesha3", "svesm4", "flagm2", "frint", "svei8mm",
          "svef32mm", "svef64mm", "svebf16", "i8mm", "bf16", "dgh", "rng", "bti"]


def headers() -> Path:
    """The folder holding onnxruntime_c_api.h."""
    env = os.environ.get(HEADERS_ENV)
    repo = Path(__file__).resolve().parents[2]
    places = [Path(env)] if env else [repo / HEADERS_BESIDE, Path.cwd() / HEADERS_BESIDE]
    for p in places:
        if (p / "onnxruntime_c_api.h").is_file():
            return p.resolve()
    raise TinydeployError(f"onnxruntime's C API headers (onnxruntime_c_api.h) not found in "
                          f"{' or '.join(printable(str(p)) for p in places)}; set {HEADERS_ENV} to the folder that "
                          "holds them (they are not part of tinydeploy)")


def onnxruntime_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("onnxruntime")
    except metadata.PackageNotFoundError:
        raise TinydeployError("onnxruntime is not installed here; install tinydeploy's dependencies") from None


def library(machine: str, version: str | None = None) -> Path:
    """libonnxruntime.so from PyPI's manylinux wheel for `machine`, cached (downloaded once)."""
    version = version or onnxruntime_version()
    name = f"libonnxruntime.so.{version}"
    out = icount.cache_dir() / f"onnxruntime-{machine}" / version / name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tinydeploy-ort-", dir=out.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
               f"manylinux_2_28_{machine}", "--python-version", f"{sys.version_info[0]}.{sys.version_info[1]}",
               f"onnxruntime=={version}", "-d", tmp, "--disable-pip-version-check", "-q"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            r = subprocess.CompletedProcess(cmd, 1, "", str(e))
        wheels = sorted(Path(tmp).glob("onnxruntime-*.whl"))
        if r.returncode != 0 or not wheels:
            last = [ln for ln in (r.stderr or "").splitlines() if ln.strip() and not ln.startswith("WARNING")]
            raise TinydeployError(f"cannot fetch onnxruntime {printable(version)}'s linux-{machine} wheel from PyPI "
                                  f"({printable(last[-1] if last else 'pip download failed', 160)}); it is fetched "
                                  f"once into {printable(str(out.parent))}: connect to PyPI, or bench with --peers none")
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                member = next((m for m in z.namelist() if m.endswith("/capi/" + name)), None)
                if member is None:
                    raise TinydeployError(f"{printable(wheels[0].name)} holds no {name}")
                part = Path(tmp) / name
                part.write_bytes(z.read(member))
        except zipfile.BadZipFile:
            raise TinydeployError(f"{printable(wheels[0].name)} is not a readable wheel") from None
        os.replace(part, out)
    return out


def _sysroot_libs(machine: str) -> Path:
    libs = Path(f"/usr/{machine}-linux-gnu/lib")
    for need in ("libc.so.6", "libstdc++.so.6"):
        if not (libs / need).exists():
            raise TinydeployError(f"{libs / need} not found: onnxruntime's library needs the {machine} C and C++ "
                                  f"runtime (Debian: apt-get install libc6-dev-arm64-cross libstdc++6-arm64-cross)")
    return libs


def harness(cc: str, include: Path) -> Path:
    """The peer harness, compiled for the board with its cross compiler against the headers."""
    compiler = shutil.which(cc)
    if compiler is None:
        raise TinydeployError(f"{printable(cc)} not found: the onnxruntime peer is compiled for the board with it "
                              "(Debian: apt-get install gcc-aarch64-linux-gnu)")
    flags = ["-std=c99", "-D_POSIX_C_SOURCE=200809L", "-O2", "-no-pie", "-Wall", "-Wextra", "-Werror"]
    h = hashlib.sha256(HARNESS_SOURCE.read_bytes() + (include / "onnxruntime_c_api.h").read_bytes()
                       + " ".join([cc, *flags]).encode())
    out = icount.cache_dir() / "onnxruntime-peer" / h.hexdigest()[:16] / "ort_peer"
    return icount.compile_cached([compiler, *flags, "-I", str(include), "-o", "{out}", str(HARNESS_SOURCE), "-ldl"],
                                 out, "compiling the onnxruntime peer harness")


def cpuinfo(midr: int, hwcap: int, hwcap2: int) -> str:
    """/proc/cpuinfo of one core, as Linux writes it, from the core's MIDR_EL1 and HWCAPs."""
    feats = [n for i, n in enumerate(HWCAP) if hwcap >> i & 1] + [n for i, n in enumerate(HWCAP2) if hwcap2 >> i & 1]
    return ("processor\t: 0\nBogoMIPS\t: 100.00\n"
            f"Features\t: {' '.join(feats)}\n"
            f"CPU implementer\t: 0x{midr >> 24 & 0xFF:02x}\nCPU architecture: 8\n"
            f"CPU variant\t: 0x{midr >> 20 & 0xF:x}\nCPU part\t: 0x{midr >> 4 & 0xFFF:03x}\n"
            f"CPU revision\t: {midr & 0xF}\n\n")


def sysroot(qemu: list[str], peer: Path, machine: str) -> Path:
    """The `-L` folder for qemu-user: the cross runtime (linked) and a proc/sys tree of one core as
    the emulated CPU reports itself (MIDR, HWCAPs: the peer harness's `--cpu`)."""
    libs = _sysroot_libs(machine)
    cpu = qemu[qemu.index("-cpu") + 1] if "-cpu" in qemu else "default"
    root = icount.cache_dir() / "sysroot" / f"{machine}-{printable(cpu, 40).replace('/', '_')}"
    if (root / "proc" / "cpuinfo").is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "lib").exists():
        (root / "lib").symlink_to(libs)
    r = subprocess.run([qemu[0], "-L", str(root), *qemu[1:], str(peer), "--cpu"], capture_output=True, text=True,
                       timeout=120)
    words = r.stdout.split()
    if r.returncode != 0 or len(words) != 6:
        raise TinydeployError(f"the emulated CPU did not describe itself ({printable(r.stderr.strip()[-160:])})")
    midr, hwcap, hwcap2 = (int(w, 16) for w in words[1::2])
    cpus = root / "sys" / "devices" / "system" / "cpu"
    (cpus / "cpu0" / "regs" / "identification").mkdir(parents=True, exist_ok=True)
    for f in ("possible", "present", "online"):
        (cpus / f).write_text("0\n")
    (cpus / "cpu0" / "regs" / "identification" / "midr_el1").write_text(f"0x{midr:016x}\n")
    (root / "proc").mkdir(exist_ok=True)
    tmp = root / "proc" / ".cpuinfo"
    tmp.write_text(cpuinfo(midr, hwcap, hwcap2))
    os.replace(tmp, root / "proc" / "cpuinfo")      # last: its presence marks a finished sysroot
    return root


class OrtPeer:
    """onnxruntime (1 thread, default optimisations) counted under a board's user-mode QEMU."""

    def __init__(self, board):
        qemu = board.qemu_user
        target = board.make_target()
        if qemu is None or not target.machine:
            raise TinydeployError(f"{board.id} has no user-mode QEMU to count onnxruntime under")
        icount.check_plugin_support(qemu[0])
        include = headers()
        _sysroot_libs(target.machine)
        self.lib = library(target.machine)
        self.peer = harness(target.cc, include)
        self.root = sysroot(qemu, self.peer, target.machine)
        self.qemu = qemu
        self.version = onnxruntime_version()

    def count(self, model: Path, feeds: list) -> icount.PerInference:
        """Instructions per inference of onnxruntime on `model` with the inputs `feeds` (in the
        model's input order)."""
        marks = icount.windows(self.peer, run="td_peer_run")
        with tempfile.TemporaryDirectory(prefix="tinydeploy-ort-") as tmp:
            fin = Path(tmp) / "in.bin"
            fin.write_bytes(pack_inputs(feeds))
            reports = []
            for runs in (1, RUNS):
                rep = Path(tmp) / f"count{runs}.txt"
                cmd = [self.qemu[0], "-L", str(self.root), *icount.qemu_args(rep, marks), *self.qemu[1:],
                       str(self.peer), str(self.lib), str(Path(model).resolve()), str(fin), str(Path(tmp) / "out.bin"),
                       str(runs)]
                try:
                    r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    raise TinydeployError("onnxruntime ran for more than an hour under QEMU; stopped it") from None
                if r.returncode != 0:
                    last = [ln for ln in r.stderr.splitlines() if ln.strip()]
                    raise TinydeployError(f"onnxruntime under {Path(self.qemu[0]).name} failed (exit {r.returncode}): "
                                          f"{printable(last[-1] if last else '', 200)}")
                reports.append(icount.read_report(rep))
        return icount.per_inference(*reports, exact=False)
