"""64-bit Arm Linux boards (Raspberry Pi 4, Jetson Orin, Jetson Xavier): cross-built static
binaries of the same portable harness as the host, run on the board or under qemu-aarch64."""
from __future__ import annotations

from tinydeploy.targets.base import WARNINGS, Target

# Per core: gcc code-generation flags, and the kernel ISA variants to prefer (best first).
# Carmel has no -mcpu in gcc 12: it is ARMv8.2-A with FP16 (its cpuinfo lists no asimddp).
CPUS = {
    "cortex-a72": (["-mcpu=cortex-a72"], ["neon"]),
    "cortex-a78ae": (["-mcpu=cortex-a78ae"], ["neon-dotprod", "neon"]),
    "carmel": (["-march=armv8.2-a+fp16", "-mtune=cortex-a76"], ["neon"]),
}


def aarch64(cpu: str) -> Target:
    flags, isas = CPUS[cpu]
    return Target(f"aarch64-{cpu}", "aarch64-linux-gnu-gcc", WARNINGS + ["-O3", *flags, "-static"],
                  isas=isas, alignment=16, machine="aarch64")
