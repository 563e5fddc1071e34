"""The Target: how to compile for a kind of CPU (see tinydeploy/targets/__init__.py)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field

from tinydeploy.errors import TinydeployError
from tinydeploy.targets.isa import ISA, get_isa


@dataclass
class Target:
    name: str
    cc: str
    cflags: list[str]
    ldlibs: list[str] = field(default_factory=lambda: ["-lm"])
    isas: list[str] = field(default_factory=list)    # kernel variants to prefer, best first
    alignment: int = 16
    l1d_bytes: int = 32768        # per-core data caches: the GEMM kernels' cache blocking (schedule/)
    l2_bytes: int = 524288
    caches: bool = True           # data caches to block for; False: cores that read memory directly (Cortex-M4)
    machine: str | None = None    # `uname -m` of the Linux machine that runs its binaries; None: bare metal
    os: str = "linux"             # "linux" (a harness program) or "none" (firmware)
    long_bits: int = 64           # width of C `long` (the generated C's byte offsets); Cortex-M: 32

    @property
    def bytes_max(self) -> int:
        """The largest tensor, in bytes, whose offsets the generated C can hold (C `long`)."""
        return 2 ** (self.long_bits - 1) - 1

    @property
    def bare_metal(self) -> bool:
        return self.os == "none"

    def isa(self, name: str) -> ISA:
        return get_isa(name)

    def isa_with_role(self, role: str) -> str | None:
        """The first of this target's ISAs with kernels of `role` (targets/isa.py), or None."""
        return next((i for i in self.isas if get_isa(i).role == role), None)

    def needed_features(self) -> list[str]:
        """CPU features (targets.cpu_features names) its code needs of the machine that runs it."""
        return sorted({f for i in self.isas for f in get_isa(i).features})

    def compiler(self) -> str:
        path = shutil.which(self.cc)
        if path is None:
            pkg = {"arm-none-eabi-gcc": "gcc-arm-none-eabi", "aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu"}
            raise TinydeployError(f"C compiler {self.cc!r} not found; install it (Debian: apt-get install "
                                  f"{pkg.get(self.cc, 'gcc')}){' or set CC' if self.name == 'host' else ''}")
        return path


WARNINGS = ["-std=c99", "-Wall", "-Wextra", "-Werror"]
