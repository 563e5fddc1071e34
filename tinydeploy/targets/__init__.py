"""Targets: how to compile for a kind of CPU (compiler, flags, ISA features the kernel registry
may use, alignment). Boards (boards/*.json) name a target; board facts stay in the JSON."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

from tinydeploy.errors import TinydeployError


@dataclass
class Target:
    name: str
    cc: str
    cflags: list[str]
    ldlibs: list[str] = field(default_factory=lambda: ["-lm"])
    isas: list[str] = field(default_factory=list)    # kernel variants to prefer, best first
    alignment: int = 16
    l1d_bytes: int = 32768        # per-core data caches: the GEMM kernels' cache blocking (select.py)
    l2_bytes: int = 524288

    def compiler(self) -> str:
        path = shutil.which(self.cc)
        if path is None:
            pkg = {"arm-none-eabi-gcc": "gcc-arm-none-eabi", "aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu"}
            raise TinydeployError(f"C compiler {self.cc!r} not found; install it (Debian: apt-get install "
                                  f"{pkg.get(self.cc, 'gcc')}){' or set CC' if self.name == 'host' else ''}")
        return path


WARNINGS = ["-std=c99", "-Wall", "-Wextra", "-Werror"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# CPU features that decide which kernels run here and how onnxruntime's 8-bit kernels behave
# (/proc/cpuinfo names: x86 "flags", aarch64 "Features").
FEATURES = {"avx2": "avx2", "fma": "fma", "avx512f": "avx512f", "avx512_vnni": "avx512_vnni",
            "avx_vnni": "avx_vnni", "neon": "asimd", "dotprod": "asimddp", "i8mm": "i8mm"}


def cpu_features() -> dict[str, bool]:
    """This machine's CPU features that matter to tinydeploy and its reference stack, by name
    (x86: avx2, fma, avx512f, avx512_vnni, avx_vnni; aarch64: neon, dotprod, i8mm)."""
    flags = _cpu_flags()
    return {name: flag in flags for name, flag in FEATURES.items()}


def has_vnni() -> bool:
    """Whether this CPU has 8-bit dot-product instructions on x86 (AVX512-VNNI or AVX-VNNI).
    Without them onnxruntime's u8 x s8 kernels add products in saturating 16-bit pairs."""
    f = cpu_features()
    return f["avx512_vnni"] or f["avx_vnni"]


def _cache_bytes(level: int, default: int) -> int:
    """Size of this machine's level-`level` data (or unified) cache from sysfs, else `default`."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in sorted(os.listdir(base)):
            d = os.path.join(base, idx)
            with open(os.path.join(d, "level")) as f:
                lvl = int(f.read())
            with open(os.path.join(d, "type")) as f:
                typ = f.read().strip()
            if lvl == level and typ in ("Data", "Unified"):
                with open(os.path.join(d, "size")) as f:
                    size = f.read().strip().upper()
                mult = {"K": 1024, "M": 1 << 20}.get(size[-1:], 1)
                return int(size.rstrip("KM")) * mult
    except (OSError, ValueError):
        pass
    return default


def host() -> Target:
    # -O3: gcc 12 vectorises the kernels' inner loops only at -O3 (measured 3.3x on ResNet-8).
    # SIMD kernel variants only when this CPU has them (the binary runs here).
    import platform
    flags, isas, extra = _cpu_flags(), [], []
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= flags:
        isas, extra = ["avx2"], ["-mavx2", "-mfma"]
        if "avx512f" in flags:
            isas, extra = ["avx512", "avx2"], extra + ["-mavx512f"]
    elif platform.machine() in ("aarch64", "arm64"):
        isas = ["neon"]
    return Target("host", os.environ.get("CC", "cc"), WARNINGS + ["-O3"] + extra, isas=isas,
                  l1d_bytes=_cache_bytes(1, 32768), l2_bytes=_cache_bytes(2, 524288))


TARGETS = {"host": host}
from tinydeploy.targets.cortex_m import cortex_m4  # noqa: E402  (it needs Target above)
TARGETS["cortex-m4"] = cortex_m4
from tinydeploy.targets.aarch64 import CPUS as _A64, aarch64  # noqa: E402
for _cpu in _A64:
    TARGETS[f"aarch64-{_cpu}"] = (lambda c: lambda: aarch64(c))(_cpu)


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise TinydeployError(f"unknown target {name!r}; known: {', '.join(sorted(TARGETS))}")
    return TARGETS[name]()
