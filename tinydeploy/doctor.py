"""`tinydeploy doctor` and `tinydeploy --version`: what this installation and this machine are, for
bug reports. 8-bit results depend on the reference stack's versions and on the CPU (onnxruntime's
u8 x s8 kernels sum differently with and without VNNI), so both are printed together.

Everything here only reads: package metadata, /proc/cpuinfo, `TOOL --version`, constraints.txt."""
from __future__ import annotations

import importlib.metadata
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tinydeploy import __version__
from tinydeploy.codegen.cfmt import printable
from tinydeploy.targets import cpu_features

# The packages whose versions decide tinydeploy's results and builds (distribution names).
REFERENCE_STACK = ("onnx", "onnxruntime", "numpy", "jinja2", "platformio", "scons", "pyserial")

# External tools tinydeploy runs: compilers, emulators, CMake (generated projects).
TOOLS = ("gcc", "clang", "arm-none-eabi-gcc", "aarch64-linux-gnu-gcc", "qemu-system-arm", "qemu-aarch64",
         "qemu-x86_64", "cmake")

# targets.cpu_features() names -> how CPU vendors spell them.
FEATURE_LABELS = {"avx2": "AVX2", "fma": "FMA", "avx512f": "AVX-512F", "avx512bw": "AVX-512BW",
                  "avx512_vnni": "AVX512-VNNI", "avx_vnni": "AVX-VNNI", "neon": "NEON", "dotprod": "dot product", "i8mm": "i8mm"}
_X86 = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni")
_ARM = ("neon", "dotprod", "i8mm")


def package_version(name: str) -> str | None:
    """The installed version of distribution `name`, None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    """The "model name" line of /proc/cpuinfo (x86; most aarch64 kernels have none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "model name":
                    return value.strip() or None
    except OSError:
        pass
    return None


def is_x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def int8_note(machine: str, features: dict[str, bool]) -> str:
    """One sentence: what this CPU means for onnxruntime's 8-bit fast kernels."""
    if not is_x86(machine):
        return ("not x86: the saturating 16-bit sums of onnxruntime's x86 u8 x s8 kernels do not apply on "
                "this machine")
    if features.get("avx512_vnni") or features.get("avx_vnni"):
        return ("x86 with VNNI: onnxruntime's u8 x s8 fast kernels sum 8-bit products in 32 bits (no "
                "saturating 16-bit pairs)")
    return ("x86 without VNNI: onnxruntime's u8 x s8 fast kernels add products in saturating 16-bit pairs, "
            "so its fast session's 8-bit results can differ from exact integer arithmetic on this machine "
            "(tinydeploy's 8-bit oracle runs the graph node by node instead; see docs/quantization.md)")


def summary() -> dict:
    """The short form (`--version`): versions, machine, CPU features."""
    machine = platform.machine()
    features = cpu_features()
    return {
        "tinydeploy": __version__,
        "python": platform.python_version(),
        "packages": {name: package_version(name) for name in REFERENCE_STACK},
        "machine": machine,
        "cpu_model": cpu_model(),
        "cpu_features": features,
        "vnni": bool(features.get("avx512_vnni") or features.get("avx_vnni")),
        "onnxruntime_int8": int8_note(machine, features),
    }


def tool_version(name: str, timeout: float = 10.0) -> dict | None:
    """{"path", "version"} of an external tool on PATH (version: the first line `NAME --version`
    prints, or why there is none), None when it is not on PATH."""
    path = shutil.which(name)
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, errors="replace",
                             timeout=timeout, stdin=subprocess.DEVNULL)
        text = out.stdout + "\n" + out.stderr
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), None)
        version = first if first is not None else f"no version printed (exit code {out.returncode})"
    except subprocess.TimeoutExpired:
        version = f"`{name} --version` did not answer within {timeout:g} s"
    except OSError as e:
        version = f"`{name} --version` failed: {e.strerror or e}"
    return {"path": path, "version": version}


def canonical(name: str) -> str:
    """A distribution name as the package index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_constraints(text: str) -> dict[str, str]:
    """The `name==version` pins of a constraints file, by canonical name (comments, blank lines,
    environment markers and anything that is not an exact pin are skipped)."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].split(";", 1)[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*==\s*([^\s,]+)", line)
        if m:
            pins[canonical(m.group(1))] = m.group(2)
    return pins


def constraints_file() -> Path | None:
    """constraints.txt of the checkout this tinydeploy is imported from (an editable install or a
    source tree), None for an installed wheel."""
    root = Path(__file__).resolve().parent.parent
    f = root / "constraints.txt"
    return f if f.is_file() and (root / "pyproject.toml").is_file() else None


def check_constraints(path: Path | None = None) -> dict:
    """Whether the installed packages have the versions constraints.txt pins:
    {"file", "pinned", "mismatches": [{"package", "pinned", "installed"}]} ("file" None: none found)."""
    path = constraints_file() if path is None else path
    if path is None:
        return {"file": None, "pinned": 0, "mismatches": []}
    pins = parse_constraints(path.read_text(encoding="utf-8", errors="replace"))
    mismatches = []
    for name, want in sorted(pins.items()):
        have = package_version(name)
        if have != want:
            mismatches.append({"package": name, "pinned": want, "installed": have})
    return {"file": str(path), "pinned": len(pins), "mismatches": mismatches}


def report() -> dict:
    """Everything `doctor` prints: the summary, the external tools, the constraints check."""
    return {**summary(), "location": str(Path(__file__).resolve().parent),
            "tools": {name: tool_version(name) for name in TOOLS}, "constraints": check_constraints()}


def _features_line(s: dict) -> str:
    names = _ARM if not is_x86(s["machine"]) else _X86
    shown = [f"{FEATURE_LABELS[n]} {'yes' if s['cpu_features'].get(n) else 'no'}" for n in names]
    return ", ".join(shown)


def _version_or_missing(v: str | None) -> str:
    return printable(v) if v is not None else "not installed"


def format_version(s: dict) -> list[str]:
    """The `--version` lines."""
    stack = ", ".join(f"{n} {_version_or_missing(v)}" for n, v in s["packages"].items())
    return [f"tinydeploy {printable(s['tinydeploy'])} (Python {printable(s['python'])})",
            f"reference stack: {stack}",
            f"CPU: {printable(s['machine'])} {printable(s['cpu_model'] or 'unknown model')}; {_features_line(s)}",
            f"8-bit: {s['onnxruntime_int8']}"]


def format_report(r: dict) -> list[str]:
    """The `doctor` lines."""
    lines = [f"tinydeploy {printable(r['tinydeploy'])} ({printable(r['location'])})",
             f"python      {printable(r['python'])} ({printable(sys.executable)})",
             "reference stack:"]
    lines += [f"  {n:<12}{_version_or_missing(v)}" for n, v in r["packages"].items()]
    lines += [f"machine     {printable(r['machine'])}",
              f"CPU         {printable(r['cpu_model'] or 'unknown (no model name in /proc/cpuinfo)')}",
              f"features    {_features_line(r)}",
              f"8-bit       {r['onnxruntime_int8']}",
              "tools:"]
    for name, t in r["tools"].items():
        lines.append(f"  {name:<22}" + ("not on PATH" if t is None
                                          else f"{printable(t['version'])} ({printable(t['path'])})"))
    c = r["constraints"]
    if c["file"] is None:
        lines.append("constraints: no constraints.txt beside the package (not an editable install); not checked")
    elif not c["mismatches"]:
        lines.append(f"constraints: all {c['pinned']} packages have the versions {printable(c['file'])} pins")
    else:
        lines.append(f"warning: {len(c['mismatches'])} of {c['pinned']} packages differ from {printable(c['file'])} "
                     "(CI tests the pinned versions; reinstall in the checkout with "
                     "`pip install -c constraints.txt -e '.[test]'`):")
        lines += [f"  {printable(m['package']):<26}installed {_version_or_missing(m['installed'])}, "
                  f"pinned {printable(m['pinned'])}" for m in c["mismatches"]]
    return lines
