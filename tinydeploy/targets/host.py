"""This machine as a target: its compiler, the SIMD kernels its CPU can run, its caches, and the
CPU features that matter to tinydeploy and to its reference stack (onnxruntime)."""
from __future__ import annotations

import os
import platform

from tinydeploy.targets.base import WARNINGS, Target


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
FEATURES = {"avx2": "avx2", "fma": "fma", "avx512f": "avx512f", "avx512bw": "avx512bw",
            "avx512_vnni": "avx512_vnni", "avx_vnni": "avx_vnni", "neon": "asimd", "dotprod": "asimddp", "i8mm": "i8mm"}


def cpu_features() -> dict[str, bool]:
    """This machine's CPU features that matter to tinydeploy and its reference stack, by name
    (x86: avx2, fma, avx512f, avx512bw, avx512_vnni, avx_vnni; aarch64: neon, dotprod, i8mm)."""
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


def machine_name(uname: str) -> str:
    """A `uname -m` answer with the aliases some systems use folded (arm64, amd64)."""
    return {"arm64": "aarch64", "amd64": "x86_64", "AMD64": "x86_64"}.get(uname, uname)


def this_machine() -> str:
    """This machine's `uname -m` (machine_name)."""
    return machine_name(platform.machine())


def host() -> Target:
    # -O3: gcc 12 vectorises the kernels' inner loops only at -O3 (measured 3.3x on ResNet-8).
    # SIMD kernel variants only when this CPU has them (the binary runs here), best first; the
    # 8-bit ISAs (avx512-vnni, avx512bw, avx-vnni) come before the fp32 ones they build on, and
    # kernel lookup skips an ISA without a variant of the family (codegen/kernels.py).
    flags, isas, extra = _cpu_flags(), [], []
    if this_machine() == "x86_64" and {"avx2", "fma"} <= flags:
        isas, extra = ["avx2"], ["-mavx2", "-mfma"]
        if "avx_vnni" in flags:
            isas, extra = ["avx-vnni"] + isas, extra + ["-mavxvnni"]
        if "avx512f" in flags:
            isas, extra = ["avx512"] + isas, extra + ["-mavx512f"]
            if "avx512bw" in flags:
                isas, extra = ["avx512bw"] + isas, extra + ["-mavx512bw"]
                if "avx512_vnni" in flags:
                    isas, extra = ["avx512-vnni"] + isas, extra + ["-mavx512vnni"]
    elif this_machine() == "aarch64":
        isas = ["neon-dotprod", "neon"] if "asimddp" in flags else ["neon"]
        extra = ["-march=armv8.2-a+dotprod"] if "asimddp" in flags else []
    return Target("host", os.environ.get("CC", "cc"), WARNINGS + ["-O3"] + extra, isas=isas,
                  l1d_bytes=_cache_bytes(1, 32768), l2_bytes=_cache_bytes(2, 524288), machine=this_machine())
