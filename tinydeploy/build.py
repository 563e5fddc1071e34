"""Writing a generated project to disk (safely) and compiling it for the host."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import stat
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


def read_marker(outdir: Path) -> dict:
    """The folder's marker when it is tinydeploy's (a JSON object naming the tool and the files it
    wrote with their SHA-256), else {}."""
    try:
        m = json.loads((outdir / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    if not (isinstance(m, dict) and m.get("tool") == "tinydeploy" and isinstance(m.get("files"), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in m["files"].items())):
        return {}
    return m


def claim_outdir(outdir: Path, force: bool) -> dict:
    """Make sure writing into outdir loses nothing the user owns; returns the previous marker
    ({} for a new folder). A folder is tinydeploy's when its marker lists what tinydeploy wrote
    there (with hashes); anything else that is not empty needs --force. Nothing is created yet
    (write_files makes the folder), so a build refused later leaves no empty folder behind."""
    outdir = Path(outdir)
    shown = printable(str(outdir))
    try:
        st = os.lstat(outdir)
        if stat.S_ISLNK(st.st_mode):
            try:
                st = os.stat(outdir)
            except OSError as e:
                raise TinydeployError(f"output path {shown!r} is a symbolic link that leads nowhere ("
                                      f"{printable(e.strerror or str(e), 60)}); choose another -o") from None
    except FileNotFoundError:
        st = None
    except OSError as e:   # a name too long, a file where a folder should be, no permission, ...
        raise TinydeployError(f"cannot use output path {shown!r}: {printable(e.strerror or str(e), 80)}; "
                              "choose another -o") from None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise TinydeployError(f"output path {shown!r} exists and is not a folder")
    previous = read_marker(outdir) if st is not None else {}
    try:
        if st is not None and not previous and any(outdir.iterdir()) and not force:
            raise TinydeployError(f"output folder {shown!r} is not empty and was not made by "
                                  "tinydeploy; choose another -o or pass --force to write into it")
    except OSError as e:
        raise TinydeployError(f"cannot use output folder {shown!r}: "
                              f"{printable(e.strerror or str(e), 80)}; choose another -o") from None
    return previous


def make_outdir(outdir: Path) -> None:
    try:
        Path(outdir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TinydeployError(f"cannot create output folder {printable(str(outdir))!r}: "
                              f"{printable(e.strerror or str(e), 80)}; choose another -o") from None


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_files(outdir: Path, files: dict[str, str | bytes], previous: dict, force: bool) -> dict[str, str]:
    """Write files (relative path -> text) into a claimed folder; returns their SHA-256 by path.
    A file already there is replaced only if tinydeploy wrote it and nobody changed it since (its
    hash is in `previous`), or with force; an unchanged file is left alone (make's timestamps);
    symbolic links are never followed (each file is written to a temporary name and renamed over
    whatever the path held)."""
    outdir = Path(outdir)
    make_outdir(outdir)
    ours = previous.get("files", {})
    hashes, changed = {}, []
    for rel, text in files.items():
        try:
            _write_one(outdir, rel, text, ours, force, hashes, changed)
        except OSError as e:
            raise TinydeployError(f"cannot write {printable(str(outdir / rel))!r}: "
                                  f"{printable(e.strerror or str(e), 80)}") from None
    if changed:
        shown = ", ".join(printable(c, 60) for c in changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise TinydeployError(f"{shown} in {printable(str(outdir))!r} changed since tinydeploy wrote "
                              f"{'them' if len(changed) > 1 else 'it'} (or tinydeploy did not write "
                              f"{'them' if len(changed) > 1 else 'it'}); pass --force to overwrite, or choose another -o")
    return hashes


def _write_one(outdir: Path, rel: str, text, ours: dict, force: bool, hashes: dict, changed: list) -> None:
    """One file of write_files (see there): written, left alone when unchanged, or noted in `changed`."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    sha = hashlib.sha256(data).hexdigest()
    hashes[rel] = sha
    p = outdir / rel
    if ".." in Path(rel).parts or Path(rel).is_absolute():
        raise TinydeployError(f"internal: generated file name {printable(rel)!r} leaves the output folder")
    for parent in reversed(p.relative_to(outdir).parents[:-1]):
        q = outdir / parent
        if q.is_symlink():
            raise TinydeployError(f"{printable(str(q))} is a symbolic link inside the output folder; "
                                  "remove it (tinydeploy never writes through links)")
        q.mkdir(exist_ok=True)
    if p.is_file() and not p.is_symlink():
        current = _sha(p)
        if current == sha:
            return
        if ours.get(rel) != current and not force:
            changed.append(rel)
            return
    elif (p.exists() or p.is_symlink()) and not force and rel not in ours:
        changed.append(rel)
        return
    if p.is_dir() and not p.is_symlink():
        raise TinydeployError(f"{printable(str(p))} is a folder where tinydeploy writes a file; remove it")
    tmp = p.with_name(f".{p.name}.tinydeploy-{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as fh:
        for i in range(0, len(data), 64 << 20):   # in slices: a 1 GB weights file is never
            fh.write(data[i:i + (64 << 20)])       # held twice
    os.replace(tmp, p)


def write_marker(outdir: Path, kind: str, hashes: dict[str, str], **extra) -> None:
    """The one marker of an output folder: that tinydeploy made it, what it wrote there (with
    hashes, so a stray file cannot pass for it), and, for builds, their reuse key and summary."""
    m = {"tool": "tinydeploy", "version": __version__, "kind": kind, "files": dict(sorted(hashes.items())), **extra}
    tmp = Path(outdir) / f".{MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(m, indent=1) + "\n")
    os.replace(tmp, Path(outdir) / MARKER)


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


CLASSIC_SOURCES = ["model.c", "td_kernels.c", "td_weights.c"]
CLASSIC_HEADERS = ["model.h", "td_kernels.h", "td_runtime.h", "td_weights.h"]


def host_files(header_line: str, header: str, target: Target, threads: int = 1, sources=None, headers=None,
               multi: bool = False) -> dict[str, str]:
    """main.c, and a Makefile and a CMakeLists.txt that build it with the same flags: both are
    rendered from target.cflags, so they cannot drift apart. `sources` / `headers`: the model's
    files (default: the classic ones); `multi`: an image of several models (main.c takes the
    model's name first)."""
    sources, headers = sources or CLASSIC_SOURCES, headers or CLASSIC_HEADERS
    env = kreg.env()
    flags = list(target.cflags)
    plain = re.compile(r"^[A-Za-z0-9_=+.,:/-]+$")     # nothing make, a shell or CMake would interpret
    if not all(plain.match(f) for f in [*flags, *target.ldlibs]):
        raise TinydeployError(f"target {target.name}: compiler flags must be plain words: {printable(' '.join(flags))}")
    return {
        "main.c": env.get_template("host/main.c.j2").render(header=header, multi=multi),
        "Makefile": env.get_template("host/Makefile.j2").render(header_line=c_comment(header_line, 200),
                                                                cflags=" ".join(flags), threads=threads,
                                                                sources=sources, headers=headers),
        "CMakeLists.txt": env.get_template("host/CMakeLists.txt.j2").render(
            header_line=c_comment(header_line.replace("Makefile", "CMakeLists.txt", 1), 200), cflags=flags,
            ldlibs=target.ldlibs, sources=sources),
    }


def with_threads(target: Target, threads: int) -> Target:
    """The target for `--threads N`: N > 1 compiles and links with OpenMP (-fopenmp; with -static,
    as on the aarch64 boards, libgomp is linked statically)."""
    return target if threads <= 1 else dataclasses.replace(target, cflags=[*target.cflags, "-fopenmp"])


def compile_host(outdir: Path, target: Target, extra_cflags: list[str] | None = None, cc: str | None = None,
                 exe: str = "model_run", sources=None) -> Path:
    compiler = cc or target.compiler()
    srcs = ["main.c", *(sources or CLASSIC_SOURCES)]
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
