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

    def compiler(self) -> str:
        path = shutil.which(self.cc)
        if path is None:
            pkg = {"arm-none-eabi-gcc": "gcc-arm-none-eabi", "aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu"}
            raise TinydeployError(f"C compiler {self.cc!r} not found; install it (Debian: apt-get install "
                                  f"{pkg.get(self.cc, 'gcc')}){' or set CC' if self.name == 'host' else ''}")
        return path


WARNINGS = ["-std=c99", "-Wall", "-Wextra", "-Werror"]


def host() -> Target:
    # -O3: gcc 12 vectorises the kernels' inner loops only at -O3 (measured 3.3x on ResNet-8).
    return Target("host", os.environ.get("CC", "cc"), WARNINGS + ["-O3"])


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
