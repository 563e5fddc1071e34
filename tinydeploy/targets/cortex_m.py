"""Cortex-M4F (Armv7E-M with the single-precision FPU), bare metal, built with arm-none-eabi-gcc.

Kernel variants: `<family>_<dtype>_cortex-m4-dsp` (8-bit, DSP extension: SMLAD on int16 pairs) and
`<family>_<dtype>_cortex-m4-fpu` (fp32, FPU registers); the kernel registry falls back to the
portable reference kernels for the rest (tinydeploy/schedule/mcu.py re-lays their weights)."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from tinydeploy.errors import TinydeployError
from tinydeploy.targets import WARNINGS, Target

CPU_FLAGS = ["-mcpu=cortex-m4", "-mthumb", "-mfloat-abi=hard", "-mfpu=fpv4-sp-d16"]
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


def cortex_m4() -> CortexMTarget:
    return CortexMTarget(
        name="cortex-m4",
        cc=os.environ.get("ARM_CC", "arm-none-eabi-gcc"),
        cflags=WARNINGS + CPU_FLAGS + ["-O2", "-ffunction-sections", "-fdata-sections"],
        ldlibs=["-lm"],
        isas=["cortex-m4-dsp", "cortex-m4-fpu"],
        alignment=8,
    )
