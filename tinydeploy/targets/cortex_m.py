"""Cortex-M cores, bare metal, built with arm-none-eabi-gcc: one table of their compiler flags
and kernel ISAs (the PlatformIO projects read their CPU, FPU and float ABI from the same flags).

Kernel variants: `<family>_<dtype>_cortex-m4-dsp` (8-bit, DSP extension: SMLAD on int16 pairs) and
`<family>_<dtype>_cortex-m4-fpu` (fp32, FPU registers), for every Armv7E-M core with a
single-precision FPU (Cortex-M4F, Cortex-M7); the kernel registry falls back to the portable
reference kernels for the rest (tinydeploy/schedule/mcu.py re-lays their weights)."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from tinydeploy.errors import TinydeployError
from tinydeploy.targets.base import WARNINGS, Target

# core -> (gcc code-generation flags, kernel ISAs best first, data caches to block for).
# The Cortex-M7 of the STM32F7 has a single-precision FPU (FPv5-SP): fpv5-sp-d16, not fpv5-d16.
# Its 4 KB data cache is not worth GEMM cache blocking at microcontroller layer sizes.
CPUS = {
    "cortex-m4": (["-mcpu=cortex-m4", "-mthumb", "-mfloat-abi=hard", "-mfpu=fpv4-sp-d16"],
                  ["cortex-m4-dsp", "cortex-m4-fpu"], False),
    "cortex-m7": (["-mcpu=cortex-m7", "-mthumb", "-mfloat-abi=hard", "-mfpu=fpv5-sp-d16"],
                  ["cortex-m4-dsp", "cortex-m4-fpu"], False),
}
DEBIAN_PACKAGES = "gcc-arm-none-eabi libnewlib-arm-none-eabi"


@dataclass
class CortexMTarget(Target):
    """A Target whose compiler is the bare-metal Arm GCC; says which Debian packages to install."""

    def compiler(self) -> str:
        path = shutil.which(self.cc)
        if path is None:
            raise TinydeployError(f"{self.cc} not found: building for Cortex-M needs the Arm bare-metal "
                                  f"toolchain (Debian: apt-get install {DEBIAN_PACKAGES})")
        return path

    def tool(self, name: str) -> str:
        """Path of a binutils program from the same toolchain (size, objcopy, objdump)."""
        prefix = self.cc[:-len("gcc")] if self.cc.endswith("gcc") else "arm-none-eabi-"
        path = shutil.which(prefix + name)
        if path is None:
            raise TinydeployError(f"{prefix}{name} not found (Debian: apt-get install {DEBIAN_PACKAGES})")
        return path


def cortex_m(cpu: str) -> CortexMTarget:
    flags, isas, caches = CPUS[cpu]
    return CortexMTarget(
        name=cpu,
        cc=os.environ.get("ARM_CC", "arm-none-eabi-gcc"),
        cflags=WARNINGS + flags + ["-O2", "-ffunction-sections", "-fdata-sections"],
        ldlibs=["-lm"],
        isas=list(isas),
        alignment=8,
        caches=caches,
        os="none",
        long_bits=32,
    )


def cpu_option(target: Target, option: str) -> str | None:
    """The value of a gcc option (-mcpu=, -mfpu=, -mfloat-abi=) in a target's flags, or None."""
    return next((f.split("=", 1)[1] for f in target.cflags if f.startswith(option + "=")), None)
