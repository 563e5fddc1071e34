"""Instructions counted under user-mode QEMU (qemu-aarch64), exactly, by tinydeploy's own TCG
plugin (qemu_count_plugin.c beside this file): built with gcc on first use into tinydeploy's cache
folder (`cache_dir()`: $TINYDEPLOY_CACHE, else $XDG_CACHE_HOME/tinydeploy, else
~/.cache/tinydeploy), keyed by the source and the compiler, and loaded with `-plugin`.

The plugin counts per window: a window opens when the function that runs one inference is entered
(`td_run` in tinydeploy's harness, `td_peer_run` in the onnxruntime peer's) and closes when its
caller (`main`) runs again; with the per-layer hooks of a -DTD_PROFILE build
(`td_profile_begin`/`td_profile_end`) each layer gets a window of its own, hooks left out. The
addresses come from the binary's symbol table (`function_symbols`), so the binary must be linked at
fixed addresses (static, or -no-pie) and keep its symbols.

Per inference = the difference of two run counts: the program run with one inference and with N,
(count(N) - count(1)) / (N - 1), so the start-up, the first inference's one-off costs and the
harness's own work cancel (`per_inference`). For tinydeploy's binaries that figure is exact: every
inference after the first must count the same, or the measurement is refused."""
from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError

PLUGIN_SOURCE = Path(__file__).with_name("qemu_count_plugin.c")
PLUGIN_CFLAGS = ["-std=c99", "-D_POSIX_C_SOURCE=200809L", "-O2", "-shared", "-fPIC", "-fvisibility=hidden",
                 "-Wall", "-Wextra", "-Werror"]
ONE_THREAD = ("instructions are counted with --threads 1 only (OpenMP threads waiting for work execute a varying "
              "number of instructions)")


def cache_dir() -> Path:
    """The folder tinydeploy keeps what it builds or downloads for itself (not the user's files)."""
    env = os.environ.get("TINYDEPLOY_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tinydeploy"


def check_plugin_support(qemu: str) -> None:
    """A clear error when `qemu` is missing or was built without TCG plugin support (-plugin)."""
    path = shutil.which(qemu)
    if path is None:
        raise TinydeployError(f"{printable(qemu)} not found; install it (Debian: apt-get install qemu-user)")
    try:
        r = subprocess.run([path, "-h"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TinydeployError(f"cannot run {printable(path)}: {printable(str(e), 120)}") from None
    if "-plugin" not in r.stdout:
        raise TinydeployError(f"{printable(path)} was built without TCG plugin support (no -plugin option), so "
                              "instructions cannot be counted; install a QEMU with plugins (Debian 12's qemu-user "
                              "7.2 has them)")


def plugin(cc: str | None = None) -> Path:
    """The counting plugin (a shared library for this machine's QEMU), built on first use into
    the cache; a clear error when no C compiler is there."""
    cc = cc or os.environ.get("TINYDEPLOY_PLUGIN_CC") or "gcc"
    compiler = shutil.which(cc)
    if compiler is None:
        raise TinydeployError(f"counting instructions under QEMU needs a C compiler for this machine ({printable(cc)}) "
                              "to build tinydeploy's QEMU plugin; install gcc (Debian: apt-get install gcc)")
    source = PLUGIN_SOURCE.read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TinydeployError(f"cannot run {printable(compiler)}: {printable(str(e), 120)}") from None
    key = hashlib.sha256(source + version.encode() + " ".join(PLUGIN_CFLAGS).encode()).hexdigest()[:16]
    out = cache_dir() / "qemu-plugin" / key / "libtdcount.so"
    return compile_cached([compiler, *PLUGIN_CFLAGS, "-o", "{out}", str(PLUGIN_SOURCE)], out,
                          f"building the QEMU counting plugin with {printable(cc)}")


def compile_cached(cmd: list[str], out: Path, what: str) -> Path:
    """`out`, compiled by `cmd` ("{out}" stands for the file it writes) unless the cache has it;
    written under a temporary name and renamed, so a parallel build finds a whole file or none."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}-", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([tmp if a == "{out}" else a for a in cmd], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            last = [ln for ln in r.stderr.splitlines() if ln.strip()]
            raise TinydeployError(f"{what} failed: {printable(last[-1] if last else '', 200)}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


# --------------------------------------------------------------------------------------------------
# Where the windows are: function symbols of an ELF binary

def function_symbols(exe, names) -> dict[str, tuple[int, int]]:
    """{name: (address, size)} of the named functions in the symbol table of a little-endian
    64-bit ELF executable linked at fixed addresses; a clear error otherwise."""
    exe = Path(exe)
    want = set(names)
    found: dict[str, tuple[int, int]] = {}
    with open(exe, "rb") as f:
        ident = f.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            raise TinydeployError(f"{printable(exe.name)} is not a 64-bit little-endian ELF program")
        e_type = struct.unpack_from("<H", ident, 16)[0]
        if e_type != 2:
            raise TinydeployError(f"{printable(exe.name)} is position-independent; counting windows need a binary "
                                  "linked at fixed addresses (-static or -no-pie)")
        shoff, = struct.unpack_from("<Q", ident, 40)
        shentsize, shnum = struct.unpack_from("<HH", ident, 58)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
        for sh in sections:
            if sh[1] != 2:                                    # SHT_SYMTAB
                continue
            strtab = sections[sh[6]]
            f.seek(strtab[4])
            strings = f.read(strtab[5])
            f.seek(sh[4])
            syms = f.read(sh[5])
            for off in range(0, len(syms) - 23, 24):
                st_name, st_info, _, _, value, size = struct.unpack_from("<IBBHQQ", syms, off)
                if st_info & 0xF != 2:                        # STT_FUNC
                    continue
                name = strings[st_name:strings.index(b"\0", st_name)].decode("ascii", "replace")
                if name in want and value:
                    found[name] = (value, size)
    return found


def windows(exe, run: str = "td_run", caller: str = "main", layers: bool = False) -> list[str]:
    """The plugin's window arguments for `exe`: one window per call of `run` from `caller`; with
    `layers`, per layer between the TD_PROFILE hooks."""
    hooks = ("td_profile_begin", "td_profile_end")
    syms = function_symbols(exe, [run, caller, *(hooks if layers else ())])
    missing = [n for n in (run, caller, *(hooks if layers else ())) if n not in syms]
    if missing:
        raise TinydeployError(f"{printable(Path(exe).name)} has no symbol {', '.join(missing)} (stripped, or not "
                              "built by tinydeploy?); instructions are counted between its functions")
    args = [f"run=0x{syms[run][0]:x}", f"caller=0x{syms[caller][0]:x}-0x{sum(syms[caller]):x}"]
    if layers:
        args += [f"lbegin=0x{syms[hooks[0]][0]:x}", f"lend=0x{syms[hooks[1]][0]:x}",
                 f"body=0x{syms[run][0]:x}-0x{sum(syms[run]):x}"]
    return args


def qemu_args(out: Path, window_args: list[str]) -> list[str]:
    """`-plugin` and its arguments for QEMU (commas in paths doubled, as QEMU's option syntax wants)."""
    spec = ",".join([str(plugin()).replace(",", ",,"), "out=" + str(out).replace(",", ",,"), *window_args])
    return ["-plugin", spec]


# --------------------------------------------------------------------------------------------------
# The plugin's report, and one inference from two of them

@dataclass
class Report:
    vcpus: int = 0
    total: tuple = (0, 0, 0)
    windows: int = 0
    first: tuple = (0, 0, 0)
    sum: tuple = (0, 0, 0)
    steady: tuple | None = None                      # (min, max) instructions of windows 2..N
    layers: dict = field(default_factory=dict)       # index -> (calls, (insns, simd_fp, fma_lanes))


def read_report(path: Path) -> Report:
    try:
        text = Path(path).read_text()
    except OSError:
        raise TinydeployError("the counting plugin wrote no report (did QEMU stop the program?)") from None
    rep, ended = Report(), False
    for line in text.splitlines():
        key, *vals = line.split()
        nums = tuple(int(v) for v in vals) if key not in ("tdcount", "end") else ()
        if key == "vcpus":
            rep.vcpus = nums[0]
        elif key in ("total", "first", "sum"):
            setattr(rep, key, nums)
        elif key == "windows":
            rep.windows = nums[0]
        elif key == "steady":
            rep.steady = nums
        elif key == "layer":
            rep.layers[nums[0]] = (nums[1], nums[2:5])
        elif key == "end":
            ended = True
    if not ended:
        raise TinydeployError("the counting plugin's report is incomplete")
    return rep


@dataclass
class PerInference:
    """What one inference executes, counted: the difference of two runs of the same program."""
    instructions: int
    simd_fp_instructions: int
    fma_lanes: int
    first_instructions: int            # the first inference alone (one-off costs included)
    inferences: int                    # how many inferences the difference spans
    exact: bool                        # every inference after the first counted the same
    spread: tuple = (0, 0)             # (min, max) instructions of those inferences
    layers: list = field(default_factory=list)   # per layer, in call order: (insns, simd_fp, fma_lanes)

    def as_dict(self) -> dict:
        return {"instructions": self.instructions, "simd_fp_instructions": self.simd_fp_instructions,
                "fma_lanes": self.fma_lanes, "first_inference_instructions": self.first_instructions,
                "inferences_counted": self.inferences, "exact": self.exact}


def per_inference(one: Report, many: Report, exact: bool = True) -> PerInference:
    """(count(N) - count(1)) / (N - 1) from the reports of a 1-inference run and an N-inference run.
    `exact`: refuse unless every inference after the first counted the same and the two runs agree
    on the first (tinydeploy's code); else the mean, with its spread (a peer whose work varies)."""
    if one.windows != 1 or many.windows < 2:
        raise TinydeployError(f"the counted runs made {one.windows} and {many.windows} inferences, not 1 and more; "
                              "was the binary built by tinydeploy?")
    if exact and max(one.vcpus, many.vcpus) > 1:
        raise TinydeployError(f"the program ran {max(one.vcpus, many.vcpus)} threads: instruction counts are exact "
                              "for one thread only (build with --threads 1)")
    n = many.windows - one.windows
    diff = [a - b for a, b in zip(many.sum, one.sum)]
    spread = many.steady or (0, 0)
    steady = spread[0] == spread[1] and all(d % n == 0 for d in diff) and one.first == many.first
    if exact and not steady:
        raise TinydeployError(f"instruction counts differ between inferences ({spread[0]:,} to {spread[1]:,}; first "
                              f"{one.first[0]:,} and {many.first[0]:,}); the program is not deterministic")
    layers = []
    for k in sorted(many.layers):
        calls, counts = many.layers[k]
        calls1, counts1 = one.layers.get(k, (0, (0, 0, 0)))
        if exact and calls - calls1 != n:
            raise TinydeployError(f"layer {k} ran {calls - calls1} times in {n} inferences")
        layers.append(tuple(round((a - b) / n) for a, b in zip(counts, counts1)))
    per = [round(d / n) for d in diff]
    return PerInference(per[0], per[1], per[2], one.first[0], n, steady, tuple(spread), layers)
