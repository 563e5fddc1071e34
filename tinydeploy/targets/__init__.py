"""Targets: how to compile for a kind of CPU. A Target owns its CPU's knowledge: the compiler and
its flags (one table per family: targets/cortex_m.py, targets/aarch64.py, the host here), the
kernel ISAs it has (descriptors in targets/isa.py), its data caches and alignment, and the
machine name (`uname -m`) its Linux binaries need. Boards (boards/*.json, targets/boards.py) name
a target and add their own facts (Board.make_target); no code outside this package and boards/
compares board or target names."""
from __future__ import annotations

from tinydeploy.errors import TinydeployError
from tinydeploy.targets.aarch64 import CPUS as _A64, aarch64
from tinydeploy.targets.base import WARNINGS, Target
from tinydeploy.targets.cortex_m import CPUS as _CM, cortex_m
from tinydeploy.targets.host import FEATURES, cpu_features, has_vnni, host, machine_name, this_machine

__all__ = ["FEATURES", "TARGETS", "WARNINGS", "Target", "cpu_features", "get_target", "has_vnni", "host",
           "machine_name", "this_machine"]

TARGETS = {"host": host}
for _cpu in _CM:
    TARGETS[_cpu] = (lambda c: lambda: cortex_m(c))(_cpu)
for _cpu in _A64:
    TARGETS[f"aarch64-{_cpu}"] = (lambda c: lambda: aarch64(c))(_cpu)


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise TinydeployError(f"unknown target {name!r}; known: {', '.join(sorted(TARGETS))}")
    return TARGETS[name]()
