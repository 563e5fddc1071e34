"""Writing a generated project to disk (safely) and compiling it for the host."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
import subprocess
from pathlib import Path

from tinydeploy import __version__
from tinydeploy.codegen import kernels as kreg
from tinydeploy.codegen.cfmt import c_comment, printable
from tinydeploy.errors import TinydeployError
from tinydeploy.targets import Target

MARKER = ".tinydeploy.json"


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive lock on `path` (created if missing) for the duration of the block, so
    concurrent processes (pytest-xdist workers, parallel builds) take turns."""
    import fcntl  # POSIX only, like the toolchains tinydeploy drives
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)   # says "tinydeploy made this folder" and what it made


def prepare_outdir(outdir: Path, force: bool) -> dict:
    """Make sure writing into outdir loses nothing the user owns. Returns the previous manifest."""
    marker = outdir / MARKER
    if outdir.exists() and not outdir.is_dir():
        raise TinydeployError(f"output path {printable(str(outdir))!r} exists and is not a folder")
    if outdir.is_dir() and any(outdir.iterdir()) and not marker.is_file() and not force:
        raise TinydeployError(f"output folder {printable(str(outdir))!r} is not empty and was not made by "
                              "tinydeploy; choose another -o or pass --force to write into it")
    outdir.mkdir(parents=True, exist_ok=True)
    try:
        return json.loads(marker.read_text()) if marker.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def write_project(outdir: Path, files: dict[str, str], key: str) -> None:
    for name, text in files.items():
        with open(outdir / name, "w") as fh:
            for i in range(0, len(text), 64 << 20):   # in slices: a 1 GB weights file is never
                fh.write(text[i:i + (64 << 20)])       # encoded whole a second time
    (outdir / MARKER).write_text(json.dumps({"tool": "tinydeploy", "version": __version__, "key": key,
                                             "files": sorted(files)}, indent=1) + "\n")


def tool_fingerprint() -> str:
    """A hash of tinydeploy's own code and templates, so a changed tool never reuses old builds."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted([*(root / "tinydeploy").rglob("*.py"), *(root / "firmware_templates").rglob("*"),
                     *(root / "boards").glob("*.json")]):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def build_key(sha256: str, board: str, options: dict) -> str:
    """What makes a build up to date: the model, the board, the options and the tool itself."""
    blob = json.dumps({"sha": sha256, "board": board, "opts": options, "v": __version__,
                       "tool": tool_fingerprint()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def host_files(header_line: str, header: str, target: Target, threads: int = 1) -> dict[str, str]:
    """main.c, and a Makefile and a CMakeLists.txt that build it with the same flags: both are
    rendered from target.cflags, so they cannot drift apart."""
    env = kreg.env()
    flags = list(target.cflags)
    plain = re.compile(r"^[A-Za-z0-9_=+.,:/-]+$")     # nothing make, a shell or CMake would interpret
    if not all(plain.match(f) for f in [*flags, *target.ldlibs]):
        raise TinydeployError(f"target {target.name}: compiler flags must be plain words: {printable(' '.join(flags))}")
    return {
        "main.c": env.get_template("host/main.c.j2").render(header=header),
        "Makefile": env.get_template("host/Makefile.j2").render(header_line=c_comment(header_line, 200),
                                                                cflags=" ".join(flags), threads=threads),
        "CMakeLists.txt": env.get_template("host/CMakeLists.txt.j2").render(
            header_line=c_comment(header_line.replace("Makefile", "CMakeLists.txt", 1), 200), cflags=flags,
            ldlibs=target.ldlibs),
    }


def with_threads(target: Target, threads: int) -> Target:
    """The target for `--threads N`: N > 1 compiles and links with OpenMP (-fopenmp; with -static,
    as on the aarch64 boards, libgomp is linked statically)."""
    return target if threads <= 1 else dataclasses.replace(target, cflags=[*target.cflags, "-fopenmp"])


def compile_host(outdir: Path, target: Target, extra_cflags: list[str] | None = None, cc: str | None = None,
                 exe: str = "model_run") -> Path:
    compiler = cc or target.compiler()
    srcs = ["main.c", "model.c", "td_kernels.c", "td_weights.c"]
    cmd = [compiler, *target.cflags, *(extra_cflags or []), "-o", exe, *srcs, *target.ldlibs]
    try:
        r = subprocess.run(cmd, cwd=outdir, capture_output=True, text=True, timeout=1800)
    except FileNotFoundError:
        raise TinydeployError(f"C compiler {compiler!r} not found; install gcc or set CC") from None
    except subprocess.TimeoutExpired:
        raise TinydeployError("the C compiler ran for more than 30 minutes; giving up") from None
    if r.returncode != 0:
        log = outdir / "build.log"
        log.write_text(" ".join(cmd) + "\n" + r.stdout + r.stderr)
        first = next((ln for ln in (r.stderr or r.stdout).splitlines() if "error" in ln), "")
        raise TinydeployError(f"compiling the generated C failed ({printable(first, 200)}); full log in {log} "
                              "-- this is a tinydeploy bug, please report it with the model")
    return outdir / exe
