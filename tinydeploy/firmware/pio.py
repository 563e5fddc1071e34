"""PlatformIO support that never needs the PlatformIO registry.

`pio run` normally downloads a platform, a toolchain and SCons from the PlatformIO registry. Here
everything comes from this machine instead, in a PlatformIO core folder tinydeploy owns
(default ~/.cache/tinydeploy/platformio-core, or $TINYDEPLOY_PIO_CORE):

    packages/tool-scons/                 SCons from pip (package.json, scons.py, .piopm: owner platformio)
    tinydeploy/toolchain-gccarmnoneeabi/ package.json + bin/ links to the system's arm-none-eabi-*
    tinydeploy/platform-cortexm/         the repository's platformio/platform (platform.json pointing at
                                         the toolchain above, builder/main.py) + boards/ generated from
                                         boards/<id>.json (kind "mcu")
    appstate.json                        telemetry off, upgrade and prune checks pushed far away

A generated project's platformio.ini names the platform as `symlink://<that folder>`. With
PLATFORMIO_CORE_DIR pointing at the core folder, a plain `pio run` in the project works offline too.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tinydeploy import __version__
from tinydeploy.targets import boards as boardlib
from tinydeploy.build import file_lock
from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.targets.cortex_m import cpu_option

TEMPLATES = Path(__file__).resolve().parents[2] / "platformio"
PLATFORM_NAME = "platform-cortexm"       # folder of the assembled platform inside <core>/tinydeploy
TOOLCHAIN_NAME = "toolchain-gccarmnoneeabi"
DEFAULT_SCONS_VERSION = "4.41101.0"      # what PlatformIO 6.2 asks for (~4.41101.0); read from PlatformIO
BUILD_TIMEOUT_S = 1800

# Environment variables that would move parts of the core elsewhere (and so send pio to the registry).
_RELOCATING_VARS = ("PLATFORMIO_PACKAGES_DIR", "PLATFORMIO_PLATFORMS_DIR", "PLATFORMIO_CORE_DIR")

_PROGRESS = re.compile(r"^(Processing |Compiling |Archiving |Indexing |Linking |Building |Checking size|"
                       r"RAM:|Flash:|Making |=+ \[|Uploading )")


def _say(msg: str) -> None:
    print(f"[tinydeploy] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Where things are


def core_dir() -> Path:
    env = os.environ.get("TINYDEPLOY_PIO_CORE")
    return Path(env).expanduser().resolve() if env else Path.home() / ".cache" / "tinydeploy" / "platformio-core"


def platform_dir(core: Path | None = None) -> Path:
    return (core or core_dir()) / "tinydeploy" / PLATFORM_NAME


def find_pio() -> str:
    for name in ("pio", "platformio"):
        path = shutil.which(name)
        if path:
            return path
    beside = Path(sys.executable).parent / "pio"     # pip installed it next to this Python
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise TinydeployError("PlatformIO Core (`pio`) not found; install it with `pip install platformio`")


def _find_gcc() -> Path:
    gcc = shutil.which("arm-none-eabi-gcc")
    if gcc is None:
        raise TinydeployError("arm-none-eabi-gcc not found; install the Arm toolchain "
                              "(Debian: apt-get install gcc-arm-none-eabi libnewlib-arm-none-eabi)")
    return Path(gcc)


def _find_scons() -> Path:
    """The folder holding the pip-installed SCons package."""
    spec = importlib.util.find_spec("SCons")
    if spec is None or not spec.submodule_search_locations:
        raise TinydeployError("SCons not found; install it with `pip install scons` "
                              "(tinydeploy makes PlatformIO's tool-scons from it, offline)")
    return Path(list(spec.submodule_search_locations)[0]).resolve().parent


def _scons_version(parent: Path) -> str:
    text = (parent / "SCons" / "__init__.py").read_text(errors="replace")
    m = re.search(r"__version__\s*=\s*[\"']([^\"']+)", text)
    return m.group(1) if m else "0"


def _scons_package_version() -> str:
    """The tool-scons version PlatformIO accepts (its requirement looks like "~4.41101.0")."""
    try:
        from platformio.dependencies import get_core_dependencies  # noqa: PLC0415
        req = get_core_dependencies()["tool-scons"]
    except Exception:  # noqa: BLE001 - an unexpected PlatformIO layout: fall back to the known value
        return DEFAULT_SCONS_VERSION
    m = re.search(r"\d+\.\d+\.\d+", req)
    return m.group(0) if m else DEFAULT_SCONS_VERSION


def _gcc_package_version(gcc: Path) -> str:
    """PlatformIO writes gcc X.Y.Z as 1.XXYYZZ.0 (12.2.1 -> 1.120201.0)."""
    try:
        out = subprocess.run([str(gcc), "-dumpversion"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    nums = [int(x) for x in re.findall(r"\d+", out)[:3]] + [0, 0, 0]
    return "1.%d%02d%02d.0" % (nums[0], nums[1], nums[2])


# --------------------------------------------------------------------------------------------------
# Boards


def _target(board) -> object:
    target = board.make_target()
    if not target.bare_metal or cpu_option(target, "-mcpu") is None:
        raise TinydeployError(f"board {board.id!r} (target {target.name}) is not a Cortex-M board the PlatformIO "
                              "platform builds for")
    return target


def cpu_flags(board) -> list[str]:
    """The code-generation flags of a board's target that name its CPU, FPU and float ABI, e.g.
    -mcpu=cortex-m4 -mthumb -mfloat-abi=hard -mfpu=fpv4-sp-d16 (targets/cortex_m.py)."""
    return [f for f in _target(board).cflags if f.startswith(("-mcpu=", "-mfpu=", "-mfloat-abi=")) or f == "-mthumb"]


def pio_board_manifest(board) -> dict:
    """A PlatformIO board manifest (boards/<id>.json of a platform) made from a tinydeploy board."""
    target = _target(board)
    mcpu, fpu, abi = (cpu_option(target, o) for o in ("-mcpu", "-mfpu", "-mfloat-abi"))
    build = {"cpu": mcpu, "mcu": board.cpu or mcpu, "float_abi": abi or "soft"}
    if fpu:
        build["fpu"] = fpu
    if board.clock_hz:
        build["f_cpu"] = f"{board.clock_hz}L"
    upload: dict = {}
    if board.ram_bytes:
        upload["maximum_ram_size"] = board.ram_bytes
    if board.flash_bytes:
        upload["maximum_size"] = board.flash_bytes
    up = board.upload or {}
    tool = str(up.get("protocol") or up.get("tool") or up.get("method") or "").lower()
    if tool in ("bossac", "sam-ba", "samba"):
        upload.update(protocol="sam-ba", protocols=["sam-ba"])
    elif tool:
        upload.update(protocol=tool, protocols=[tool])
    if up.get("openocd_config"):
        upload["openocd_config"] = up["openocd_config"]
    if up.get("touch_baud") == 1200 or up.get("use_1200bps_touch"):
        # SAM-BA bootloaders (Arduino): opening the port at 1200 baud resets the board into the
        # bootloader, which comes back as a new serial port.
        upload.update(use_1200bps_touch=True, wait_for_upload_port=True)
    return {
        "name": board.name,
        "vendor": "tinydeploy",
        "url": "",
        "frameworks": [],
        "build": build,
        "upload": upload,
        "tinydeploy": {"board": board.id, "generated_from": f"boards/{board.id}.json"},
    }


def _mcu_boards(all_boards: dict | None) -> dict:
    """The microcontroller boards whose target is a Cortex-M core (the platform's boards)."""
    all_boards = boardlib.load_all() if all_boards is None else all_boards
    out = {}
    for bid, b in all_boards.items():
        if b.is_mcu:
            t = b.make_target()
            if t.bare_metal and cpu_option(t, "-mcpu"):
                out[bid] = b
    return out


# --------------------------------------------------------------------------------------------------
# The core folder


def _write(path: Path, text: str) -> None:
    """Write only when the content differs (keeps mtimes stable for SCons and makes re-runs cheap)."""
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _dump(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _template(rel: str) -> str:
    p = TEMPLATES / rel
    if not p.is_file():
        raise TinydeployError(f"{p} is missing: the platformio/ folder of the tinydeploy checkout is incomplete")
    return p.read_text()


def _pio_version(pio: str, core: Path) -> str:
    try:
        out = subprocess.run([pio, "--version"], capture_output=True, text=True, timeout=120,
                             env=_base_env(core)).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TinydeployError(f"`{pio} --version` failed ({e}); reinstall with `pip install platformio`") from None
    m = re.search(r"version\s+(\S+)", out)
    if not m:
        raise TinydeployError(f"`{pio} --version` printed {printable(out.strip(), 80)!r}, not a version; "
                              "reinstall with `pip install platformio`")
    return m.group(1)


def _base_env(core: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _RELOCATING_VARS}
    if core is not None:
        env["PLATFORMIO_CORE_DIR"] = str(core)
    env["PLATFORMIO_DISABLE_UPGRADE_CHECK"] = "true"
    env["PLATFORMIO_SETTING_ENABLE_TELEMETRY"] = "no"
    return env


def _stamp(core: Path, pio: str, gcc: Path, scons: Path, manifests: dict) -> str:
    h = hashlib.sha256()
    for p in sorted(TEMPLATES.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(TEMPLATES)).encode() + b"\0" + p.read_bytes())
    try:
        from importlib.metadata import version  # noqa: PLC0415
        pio_pkg = version("platformio")
    except Exception:  # noqa: BLE001
        pio_pkg = "?"
    gcc_real = gcc.resolve()
    h.update(json.dumps({"tinydeploy": __version__, "core": str(core), "pio": [pio, pio_pkg],
                         "gcc": [str(gcc), str(gcc_real), gcc_real.stat().st_mtime_ns],
                         "scons": [str(scons), _scons_version(scons)], "boards": manifests},
                        sort_keys=True).encode())
    return h.hexdigest()


def ensure_core(boards: dict[str, dict] | None = None, quiet: bool = True) -> dict:
    """Prepare tinydeploy's PlatformIO core folder (idempotent; about 0.1 s once done) and
    return the environment for running `pio` in it: offline, no telemetry, no upgrade checks.

    `boards` (id -> tinydeploy board dict) defaults to every boards/<id>.json."""
    core = core_dir()
    pio = find_pio()
    gcc = _find_gcc()
    scons = _find_scons()
    manifests = {bid: pio_board_manifest(b) for bid, b in sorted(_mcu_boards(boards).items())}
    stamp_path = core / "tinydeploy" / "stamp.json"
    stamp = _stamp(core, pio, gcc, scons, manifests)
    env = _base_env(core)
    if _up_to_date(core, stamp_path, stamp):
        return env

    with file_lock(core / "tinydeploy" / "ensure.lock"):
        if _up_to_date(core, stamp_path, stamp):     # another process just did it
            return env
        if not quiet:
            _say(f"preparing the offline PlatformIO core in {core}")
        major = re.match(r"\d+", _scons_version(scons))
        if not major or int(major.group(0)) < 4:
            raise TinydeployError(f"SCons {_scons_version(scons)} in {scons} is too old; "
                                  "install a newer one with `pip install -U scons`")
        _install_tool_scons(core, scons)
        toolchain = _install_toolchain(core, gcc)
        _install_platform(core, toolchain, manifests)
        _write_appstate(core, _pio_version(pio, core))
        _write(stamp_path, _dump({"stamp": stamp, "tinydeploy": __version__, "pio": pio, "gcc": str(gcc),
                                  "scons": str(scons), "boards": sorted(manifests)}))
    return env


def _up_to_date(core: Path, stamp_path: Path, stamp: str) -> bool:
    # A missing piece (someone cleaned part of the folder) would send pio to the registry: check them.
    needed = [core / "packages" / "tool-scons" / ".piopm", core / "packages" / "tool-scons" / "scons.py",
              core / "tinydeploy" / TOOLCHAIN_NAME / "bin" / "arm-none-eabi-gcc",
              platform_dir(core) / "platform.json", platform_dir(core) / "builder" / "main.py",
              core / "appstate.json"]
    try:
        return json.loads(stamp_path.read_text()).get("stamp") == stamp and all(p.exists() for p in needed)
    except (OSError, ValueError):
        return False


def _install_tool_scons(core: Path, scons_parent: Path) -> None:
    dest = core / "packages" / "tool-scons"
    version = _scons_package_version()
    manifest = json.loads(_template("packages/tool-scons/package.json"))
    manifest["version"] = version
    _write(dest / "package.json", _dump(manifest))
    script = _template("packages/tool-scons/scons.py").replace("SCONS_PARENT = None",
                                                               f"SCONS_PARENT = {str(scons_parent)!r}", 1)
    _write(dest / "scons.py", script)
    # Without "owner": "platformio" in .piopm PlatformIO does not recognise its core package and goes to
    # the registry for it.
    _write(dest / ".piopm", json.dumps({
        "type": "tool", "name": "tool-scons", "version": version,
        "spec": {"owner": "platformio", "id": None, "name": "tool-scons", "requirements": None, "uri": None}}))


def _install_toolchain(core: Path, gcc: Path) -> Path:
    dest = core / "tinydeploy" / TOOLCHAIN_NAME
    manifest = json.loads(_template(f"packages/{TOOLCHAIN_NAME}/package.json"))
    manifest["version"] = _gcc_package_version(gcc)
    manifest["system"] = ["*"]     # links to this machine's own tools
    _write(dest / "package.json", _dump(manifest))
    bindir = dest / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    tools = {p.name: p for p in gcc.parent.glob("arm-none-eabi-*") if p.is_file() and os.access(p, os.X_OK)}
    for link in bindir.iterdir():
        if link.name not in tools or not link.is_symlink() or Path(os.readlink(link)) != tools[link.name]:
            link.unlink()
    for name, target in tools.items():
        if not (bindir / name).is_symlink():
            (bindir / name).symlink_to(target)
    return dest


def _install_platform(core: Path, toolchain: Path, manifests: dict) -> None:
    dest = platform_dir(core)
    platform = json.loads(_template("platform/platform.json"))
    platform["packages"][TOOLCHAIN_NAME]["version"] = f"symlink://{toolchain}"
    _write(dest / "platform.json", _dump(platform))
    _write(dest / "builder" / "main.py", _template("platform/builder/main.py"))
    bdir = dest / "boards"
    bdir.mkdir(parents=True, exist_ok=True)
    for old in bdir.glob("*.json"):
        if old.stem not in manifests:
            old.unlink()
    for bid, manifest in manifests.items():
        _write(bdir / f"{bid}.json", _dump(manifest))


def _write_appstate(core: Path, pio_version: str) -> None:
    """Settings that keep a plain `pio run` (without our environment variables) offline: no telemetry,
    no weekly upgrade check, no prune check, and "already upgraded to this version" (a changed version
    makes pio update its core packages from the registry)."""
    path = core / "appstate.json"
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            state = {}
    except (OSError, ValueError):
        state = {}
    settings = state.setdefault("settings", {})
    settings.update(enable_telemetry=False, check_platformio_interval=36500, check_prune_system_threshold=0)
    state["last_version"] = pio_version
    now = int(time.time())
    checks = state.setdefault("last_check", {})
    checks["platformio_upgrade"] = max(int(checks.get("platformio_upgrade", 0) or 0), now)
    checks["prune_system"] = max(int(checks.get("prune_system", 0) or 0), now)
    _write(path, json.dumps(state))


# --------------------------------------------------------------------------------------------------
# Projects


def _ini_value(s: str) -> str:
    if any(c in s for c in "\n\r;#") or s != s.strip():
        raise TinydeployError(f"value {printable(s)!r} cannot be written into platformio.ini")
    return s


def write_platformio_ini(project_dir: Path | str, board: str, *, ldscript: str = "link.ld",
                         build_flags: list[str] | None = None, model: str | None = None,
                         all_boards: dict[str, dict] | None = None) -> Path:
    """Write <project_dir>/platformio.ini for a tinydeploy board: an offline env named after the board
    (tinydeploy's local platform, the project's linker script) and, when PlatformIO has a stock board
    for it, an Arduino env for teams with internet. Layout: src/ (application and startup), include/,
    lib/<model>/ (the generated model as a library), `ldscript` relative to the project folder."""
    project_dir = Path(project_dir)
    all_boards = boardlib.load_all() if all_boards is None else all_boards
    if board not in all_boards:
        raise TinydeployError(f"unknown board {printable(board)!r}; known boards: {', '.join(all_boards)}")
    b = all_boards[board]
    if not b.is_mcu:
        raise TinydeployError(f"board {board!r} is not a microcontroller; PlatformIO projects are for "
                              f"kind \"mcu\" boards")
    # The target's own flags (targets/): the same code generation, warnings and C standard as the
    # Makefile's; the platform's -ffunction-sections -fdata-sections -Wall come again from it.
    flags = list(dict.fromkeys(_target(b).cflags + list(build_flags or [])))
    core = core_dir()
    lines = [
        f"; Generated by tinydeploy {__version__} for board {board} ({printable(b.name, 80)})"
        + (f", model {printable(model, 60)}" if model else "") + ".",
        f"; [env:{board}] builds offline with tinydeploy's own PlatformIO platform and the system's",
        "; arm-none-eabi toolchain, from the PlatformIO core folder tinydeploy prepares (core_dir below);",
        "; no PlatformIO registry needed. In this folder a plain `pio run` is enough. From elsewhere",
        "; (`pio run -d <here>`) set the same core and settings in the environment first:",
        f";   export PLATFORMIO_CORE_DIR={core}",
        ";   export PLATFORMIO_DISABLE_UPGRADE_CHECK=true PLATFORMIO_SETTING_ENABLE_TELEMETRY=no",
        "; The firmware is .pio/build/<env>/firmware.elf (.bin, .hex beside it).",
        "",
        "[platformio]",
        "core_dir = " + _ini_value(str(core)),
        "; only the offline env by default: a bare `pio run` must not reach for the registry",
        f"default_envs = {board}",
        "",
        f"[env:{board}]",
        f"platform = symlink://{platform_dir(core)}",
        f"board = {board}",
        f"board_build.ldscript = {_ini_value(ldscript)}",
        "build_flags =",
        *[f"    {_ini_value(f)}" for f in flags],
        "",
    ]
    reg = b.platformio   # the stock PlatformIO board, when there is one (boards/<id>.json "platformio")
    if reg:
        lines += [
            "; For teams WITH internet access only: this env needs the PlatformIO registry (the",
            f"; {reg['platform']} platform, the Arduino core and its toolchain); offline it fails after about",
            f"; a minute. Build it with `pio run -e {board}_arduino`. The Arduino core brings its own",
            "; startup code and linker script, so src/ must provide setup()/loop() instead of main()",
            "; and the bare-metal startup file must be left out (build_src_filter).",
            f"[env:{board}_arduino]",
            f"platform = {reg['platform']}",
            f"board = {reg['board']}",
            f"framework = {reg['framework']}",
            "build_flags = -O2",
            "",
        ]
    path = project_dir / "platformio.ini"
    project_dir.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def write_sources(project_dir: Path | str, model: str, *, src: dict[str, str] | None = None,
                  lib: dict[str, str] | None = None, include: dict[str, str] | None = None) -> None:
    """Put files where PlatformIO looks for them: src/ (application, startup), lib/<model>/ (the model
    library, found by PlatformIO when src/ includes one of its headers), include/ (shared headers)."""
    project_dir = Path(project_dir)
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", model):
        raise TinydeployError(f"model library name {printable(model)!r} must be letters, digits, _ . -")
    for sub, files in (("src", src), (f"lib/{model}", lib), ("include", include)):
        for name, text in (files or {}).items():
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise TinydeployError(f"file name {printable(name)!r} must stay inside {sub}/")
            p = project_dir / sub / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)


def _run_pio(args: list[str], project_dir: Path, env: dict, log_path: Path, timeout: float, quiet: bool,
             what: str) -> None:
    """Run pio, echo progress lines, keep the whole output in log_path; one-line error on failure."""
    env = dict(env, PYTHONUNBUFFERED="1", PLATFORMIO_NO_ANSI="true")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(args) + "\n")
        try:
            proc = subprocess.Popen(args, cwd=project_dir, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                    errors="replace", start_new_session=True)
        except OSError as e:
            raise TinydeployError(f"cannot run {args[0]}: {e}; install PlatformIO with `pip install platformio`") \
                from None
        timer = _Killer(proc, timeout)
        try:
            for line in proc.stdout:
                log.write(line)
                line = line.rstrip()
                lines.append(line)
                if not quiet and _PROGRESS.match(line):
                    _say(f"pio: {printable(line, 160)}")
            rc = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                _kill(proc)
        log.write(f"\n[exit code {rc}, {time.monotonic() - start:.1f} s]\n")
    if timer.fired:
        raise TinydeployError(f"{what} took more than {timeout:.0f} s and was stopped; full log: {log_path}")
    if rc != 0:
        text = "\n".join(lines)
        if any(k in text for k in ("HTTPClientError", "InternetConnectionError", "registry.platformio.org")):
            hint = "PlatformIO tried to reach its registry (this machine is offline?)"
        else:
            errs = [ln for ln in lines if re.search(r"\berror\b|Error:", ln)]
            hint = printable(errs[0].strip(), 160) if errs else f"exit code {rc}"
        raise TinydeployError(f"{what} failed: {hint}; full log: {log_path}")


class _Killer:
    """Kill a process group after a timeout (so a registry retry loop never hangs a build)."""

    def __init__(self, proc: subprocess.Popen, timeout: float):
        import threading  # noqa: PLC0415
        self.fired = False
        self._proc = proc
        self._t = threading.Timer(timeout, self._fire)
        self._t.daemon = True
        self._t.start()

    def _fire(self):
        self.fired = True
        _kill(self._proc)

    def cancel(self):
        self._t.cancel()


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _check_platform_paths(project_dir: Path) -> None:
    """A `platform = symlink://...` naming a folder that is gone would make pio fail late and obscurely."""
    text = (project_dir / "platformio.ini").read_text(errors="replace")
    for m in re.finditer(r"^\s*platform\s*=\s*symlink://(\S+)", text, re.M):
        if not (Path(m.group(1)) / "platform.json").is_file():
            raise TinydeployError(f"{project_dir / 'platformio.ini'} names the platform folder {m.group(1)}, "
                                  f"which does not exist (tinydeploy's core folder is now {core_dir()}); "
                                  "write platformio.ini again")


def env_platform(project_dir: Path | str, env_name: str) -> str | None:
    """The `platform` of [env:<env_name>] in platformio.ini (following `extends`), or None."""
    import configparser  # noqa: PLC0415
    cfg = configparser.ConfigParser(interpolation=None, strict=False, inline_comment_prefixes=(";",))
    try:
        cfg.read(Path(project_dir) / "platformio.ini")
    except configparser.Error as e:
        raise TinydeployError(f"{Path(project_dir) / 'platformio.ini'}: {printable(str(e), 160)}") from None
    section, seen = f"env:{env_name}", set()
    while section in cfg and section not in seen:
        seen.add(section)
        if cfg.has_option(section, "platform"):
            return cfg.get(section, "platform").strip()
        parents = [x.strip() for x in cfg.get(section, "extends", fallback="").split(",") if x.strip()]
        section = parents[0] if parents else ""
    return cfg.get("env", "platform", fallback=None)


def _refuse_registry_env(project_dir: Path, env_name: str) -> None:
    platform = env_platform(project_dir, env_name)
    if platform and not platform.startswith(("symlink://", "file://")):
        raise TinydeployError(f"env {env_name!r} uses the registry platform {printable(platform, 60)!r}, which "
                              "needs the PlatformIO registry (offline it fails after about a minute); "
                              f"tinydeploy builds only offline envs: run `pio run -e {env_name}` yourself on "
                              "a machine with internet, or pass allow_registry=True")


def build_command(project_dir: Path | str, env_name: str) -> list[str]:
    return [find_pio(), "run", "-e", env_name, "-d", str(Path(project_dir).resolve())]


def _prepare(project_dir, env_name: str, allow_registry: bool, quiet: bool) -> tuple[Path, dict]:
    """What every `pio run` needs first: a project, an offline env, a ready core."""
    project_dir = Path(project_dir).resolve()
    if not (project_dir / "platformio.ini").is_file():
        raise TinydeployError(f"{project_dir} has no platformio.ini; write it first (write_platformio_ini)")
    if not allow_registry:
        _refuse_registry_env(project_dir, env_name)
    env = ensure_core(quiet=quiet)
    _check_platform_paths(project_dir)
    return project_dir, env


def pio_build(project_dir: Path | str, env_name: str, timeout: float = BUILD_TIMEOUT_S,
              quiet: bool = False, allow_registry: bool = False) -> Path:
    """`pio run -e env_name` in project_dir, offline; returns .pio/build/<env>/firmware.elf.
    Envs on a registry platform (e.g. nano33ble_arduino) are refused unless allow_registry."""
    project_dir, env = _prepare(project_dir, env_name, allow_registry, quiet)
    log = project_dir / ".pio" / f"tinydeploy-build-{env_name}.log"
    _run_pio(build_command(project_dir, env_name), project_dir, env, log, timeout, quiet,
             f"pio run -e {env_name}")
    elf = project_dir / ".pio" / "build" / env_name / "firmware.elf"
    if not elf.is_file():
        raise TinydeployError(f"pio run -e {env_name} made no {elf}; full log: {log}")
    return elf


def upload_command(project_dir: Path | str, env_name: str, port: str | None = None) -> list[str]:
    """The `pio run -t upload` command line. For nano33ble the platform touches the port at 1200 baud
    (the board enters its bootloader), waits for the bootloader's port and runs bossac."""
    cmd = build_command(project_dir, env_name) + ["-t", "upload"]
    if port:
        cmd += ["--upload-port", _ini_value(port)]
    return cmd


def pio_upload(project_dir: Path | str, env_name: str, port: str | None = None,
               timeout: float = BUILD_TIMEOUT_S, quiet: bool = False, allow_registry: bool = False) -> None:
    """Build if needed and flash a real board through PlatformIO (offline, like pio_build)."""
    project_dir, env = _prepare(project_dir, env_name, allow_registry, quiet)
    log = project_dir / ".pio" / f"tinydeploy-upload-{env_name}.log"
    _run_pio(upload_command(project_dir, env_name, port), project_dir, env, log, timeout, quiet,
             f"pio run -e {env_name} -t upload")
