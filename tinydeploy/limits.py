"""How many bytes of constants a model may make tinydeploy materialise: one budget, sized
against this machine's memory, for everything that grows with the weights.

Two demands meet here. A real network can carry a 100 M-element weight (VGG-16's fc6, 411 MB)
as a ConstantOfShape of a 200-byte model, and must build; and a 200-byte model must not be able
to expand into more than the machine can build (2^26 float elements: up to 1.1 GB of C, a
minute or two and up to 5 GB of memory). No ratio of expansion to file size separates the two -- both
models are a few hundred bytes -- so the bound is what the build costs on this machine:

* every constant the import holds (the file's initializers plus each folded constant, checked
  from shapes *before* it is computed, so 10^12 elements are refused without allocating), and
  the weights the build then writes as C, must fit in `Budget.bytes`;
* by default that is MemAvailable (or a cgroup's remaining limit, if lower) divided by what a
  build needs per byte of weights, measured below; `--max-weights-bytes SIZE` or
  TINYDEPLOY_MAX_WEIGHTS_BYTES=SIZE sets it instead (2G, 512M, 100000000).

The model's own size enters the messages (and a build note when folding made far more weights
than the file holds): expansion is allowed, but said, and never beyond what this machine can do.

The cost per weight byte, measured on host builds of a 25088 x 4096 float ConstantOfShape weight
(411 MB; gcc 12.2 -O3; above 8 MB the weights are one C string, project.BLOB_THRESHOLD): the C is
1.16 to 4.16 characters per weight byte (printable bytes are themselves, others "\\ooo"); gcc's
peak RSS is ~3.3 bytes per character of C plus ~3.5 per weight byte (fill 0.001: 1.09 GB of C,
gcc 4.8 GB; zeros, the worst case: 1.71 GB of C, gcc 7.06 GB); tinydeploy holds ~1.1 bytes per
weight byte meanwhile (the graph's weights; the C text is let go before the compiler runs);
the phases before peak lower (import ~5, writing the C up to ~11 bytes per weight byte). Worst
case 18.3 bytes per weight byte, so BUILD_BYTES_PER_WEIGHT_BYTE = 20.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from tinydeploy.errors import TinydeployError

FLAG = "--max-weights-bytes"
ENV = "TINYDEPLOY_MAX_WEIGHTS_BYTES"
BUILD_BYTES_PER_WEIGHT_BYTE = 20
FALLBACK_AVAILABLE_BYTES = 4 << 30   # neither MemAvailable nor the RAM size known: assume 4 GiB free
MEMINFO = "/proc/meminfo"
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),               # cgroup v2
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True)
class Budget:
    bytes: int    # the most bytes of constants a model may materialise
    how: str      # where the number comes from, for messages


def parse_size(text: str, origin: str = FLAG) -> int:
    """'2G', '512M', '1.5g', '64KiB', '100000000' -> bytes (K/M/G/T are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise TinydeployError(f"{origin} {str(text)[:40]!r} is not a size: give bytes, or a number with K, M, G "
                              "or T (powers of 1024), e.g. 2G or 512M")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 1:
        raise TinydeployError(f"{origin} must be at least 1 byte, not {str(text)[:40]!r}")
    return n


def human(n: int) -> str:
    """Bytes for messages, in the flag's powers of 1024: '392.0 MiB', '3.6 TiB'."""
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.1f} {unit}iB"
    return f"{n} B"


def flag_value(n: int) -> str:
    """The smallest K/M/G/T flag value of at least n bytes: what to pass to admit n."""
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit]:
            return f"{math.ceil(n / _UNITS[unit])}{unit}"
    return str(n)


def available_memory() -> tuple[int, str]:
    """(bytes this process may still use, how that was found): /proc/meminfo MemAvailable, lowered
    to a cgroup memory limit's remaining room when one is set (containers, CI runners)."""
    avail, how = None, ""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail, how = int(line.split()[1]) * 1024, "MemAvailable"
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:   # not Linux, or a kernel before 3.14: half the physical memory, else a guess
        try:
            avail, how = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2, "no MemAvailable: half of RAM"
        except (ValueError, OSError, AttributeError):
            avail, how = FALLBACK_AVAILABLE_BYTES, "no MemAvailable, no RAM size: assumed"
        if avail <= 0:
            avail, how = FALLBACK_AVAILABLE_BYTES, "no MemAvailable, no RAM size: assumed"
    for limit_file, usage_file in CGROUP_FILES:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60 and int(limit) - usage < avail:
            avail, how = max(int(limit) - usage, 0), "cgroup memory limit minus usage"
        break
    return avail, how


def budget(max_weights_bytes: "int | Budget | None" = None) -> Budget:
    """The weights budget: an explicit number (the --max-weights-bytes flag), else
    TINYDEPLOY_MAX_WEIGHTS_BYTES, else this machine's available memory over the build's cost."""
    if isinstance(max_weights_bytes, Budget):
        return max_weights_bytes
    if max_weights_bytes is not None:
        if isinstance(max_weights_bytes, bool) or not isinstance(max_weights_bytes, int) or max_weights_bytes < 1:
            raise TinydeployError(f"{FLAG} must be a positive number of bytes, not {max_weights_bytes!r}")
        return Budget(max_weights_bytes, f"set by {FLAG}")
    env = os.environ.get(ENV, "").strip()
    if env:
        return Budget(parse_size(env, ENV), f"set by {ENV}")
    avail, how = available_memory()
    return Budget(avail // BUILD_BYTES_PER_WEIGHT_BYTE,
                  f"this machine: {how} {human(avail)} / {BUILD_BYTES_PER_WEIGHT_BYTE} bytes of build "
                  "memory per weight byte")


def refuse(what: str, need: int, b: Budget, others: int = 0) -> TinydeployError:
    """The one-line refusal: what asked for how much (`need` bytes in all, `others` of them held
    before), the budget and where it comes from, and how to raise it."""
    total = f", {human(need)} with the {human(others)} of constants before it" if others >= 1 << 20 else ""
    return TinydeployError(
        f"{what}{total}: over the weights budget of {human(b.bytes)} ({b.bytes} bytes; {b.how}); if this "
        f"machine really has the memory (a build needs about {BUILD_BYTES_PER_WEIGHT_BYTE} bytes per weight "
        f"byte), raise it with {FLAG} {flag_value(need)} or {ENV}={flag_value(need)}")


class Tally:
    """Running total of the constant bytes a model has materialised, against a budget."""

    def __init__(self, b: Budget, start: int = 0):
        self.budget, self.used = b, start

    def add(self, nbytes: int, what) -> None:
        """Count `nbytes` more; `what()` describes them for the refusal (called only then)."""
        if self.used + nbytes > self.budget.bytes:
            raise refuse(what(), self.used + nbytes, self.budget, self.used)
        self.used += nbytes
