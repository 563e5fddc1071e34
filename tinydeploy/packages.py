"""A library-form model (codegen/project.py Api) as the packages other build systems use, one
folder per model, `package/<name>/`, that works as all of them at once:

    src/                    the model's C (its <name>_* files)
    library.json            PlatformIO library: `lib_deps = file://<folder>` (or lib_extra_dirs)
    library.properties      Arduino library (1.5 format: the sources in src/)
    CMakeLists.txt          CMake: add_subdirectory(<folder>) gives the static library target
    <name>Config.cmake      ... and find_package(<name>) (CMAKE_PREFIX_PATH or <name>_DIR) the same target
    <name>ConfigVersion.cmake
    zephyr/module.yml       Zephyr module (ZEPHYR_EXTRA_MODULES=<folder>), zephyr/CMakeLists.txt,
    zephyr/Kconfig          CONFIG_TINYDEPLOY_<NAME> to build it
    README.md

The model's code-generation flags (those of the board's target, without its warnings and link
options) build the library in each; `check` reads every manifest back (JSON, the Arduino
properties, YAML, Kconfig) and says what is malformed. CI builds the PlatformIO library and the
CMake package from a consumer project of its own (tests/consumer/); the Arduino and Zephyr
toolchains cannot be installed here, so those two are checked for form only."""
from __future__ import annotations

import json
import re

from tinydeploy import __version__
from tinydeploy.codegen import kernels as kreg
from tinydeploy.codegen.cfmt import printable
from tinydeploy.pipeline import Compiled, Image

LINK_ONLY = {"-static"}
WARNINGS = {"-Wall", "-Wextra", "-Werror"}
CPU_FLAGS = ("-mcpu=", "-mthumb", "-mfloat-abi=", "-mfpu=")
ARDUINO_CATEGORIES = ("Display", "Communication", "Signal Input/Output", "Sensors", "Device Control", "Timing",
                      "Data Storage", "Data Processing", "Other")


def library_flags(target) -> list[str]:
    """The flags the model's C is compiled with in a package: the target's, without warnings
    (the consumer's own apply to its code) and link options."""
    return [f for f in target.cflags if f not in WARNINGS | LINK_ONLY]


def package_files(c: Compiled | Image, board, command: str = "") -> dict[str, str]:
    """Relative path (package/<name>/...) -> text of every model's package."""
    models = c.models if isinstance(c, Image) else [c]
    target = board.make_target()
    env = kreg.env()
    out = {}
    for m in models:
        p = m.api.name
        root = f"package/{p}"
        files = m.sources + m.headers
        for f in files:
            out[f"{root}/src/{f}"] = m.files[f]
        kw = dict(p=p, P=p.upper(), model=printable(m.model, 80), board=board, target=target,
                  flags=library_flags(target), sources=m.sources, headers=m.headers, version=__version__,
                  command=printable(command, 300), arena=m.api.arena, arena_bytes=m.arena_bytes,
                  weights_bytes=m.weights_bytes, kconfig=f"TINYDEPLOY_{p.upper()}", categories=ARDUINO_CATEGORIES)
        out[f"{root}/library.json"] = json.dumps({
            "name": p, "version": __version__,
            "description": f"Model {p} ({printable(m.model, 80)}) compiled to C99 by tinydeploy for {board.id} "
                           f"({target.name}): no malloc, weights in const arrays",
            "keywords": ["tinydeploy", "onnx", "inference"],
            "frameworks": "*", "platforms": "*",
            # the CPU and its float ABI come from the PlatformIO board
            "build": {"srcDir": "src", "includeDir": "src",
                      "flags": [f for f in kw["flags"] if not f.startswith(CPU_FLAGS)]},
        }, indent=2) + "\n"
        for name in ("library.properties", "CMakeLists.txt", "Config.cmake", "ConfigVersion.cmake",
                     "zephyr/module.yml", "zephyr/CMakeLists.txt", "zephyr/Kconfig", "README.md"):
            rel = f"{p}{name}" if name.startswith("Config") else name
            out[f"{root}/{rel}"] = env.get_template(f"package/{name}.j2").render(**kw)
    return out


# ---- reading them back ----------------------------------------------------------------------

def _properties(text: str) -> dict[str, str]:
    out = {}
    for ln in text.splitlines():
        if ln.strip() and not ln.lstrip().startswith("#"):
            if "=" not in ln:
                raise ValueError(f"library.properties: line without '=': {ln!r}")
            k, v = ln.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def check(folder) -> list[str]:
    """What is malformed in a package folder (empty: nothing): the PlatformIO manifest, the
    Arduino properties (the fields and values its library specification requires), the Zephyr
    module (module.yml keys and paths, the Kconfig symbol its CMakeLists.txt tests), the CMake
    files' references, and that every source the manifests name exists."""
    import yaml
    from pathlib import Path
    folder = Path(folder)
    problems = []
    name = folder.name
    try:
        lj = json.loads((folder / "library.json").read_text())
        if lj.get("name") != name or not re.fullmatch(r"\d+\.\d+\.\d+", str(lj.get("version"))):
            problems.append("library.json: name must be the folder's and version X.Y.Z")
        if not (folder / lj.get("build", {}).get("srcDir", "src")).is_dir():
            problems.append("library.json: build.srcDir is not a folder")
    except (OSError, ValueError) as e:
        problems.append(f"library.json: {e}")
    try:
        props = _properties((folder / "library.properties").read_text())
        need = ["name", "version", "author", "maintainer", "sentence", "paragraph", "category", "url", "architectures"]
        problems += [f"library.properties: no {k}" for k in need if not props.get(k)]
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9 _.\-]{0,62}", props.get("name", "")) \
                or props.get("name", "").lower().startswith("arduino"):
            problems.append("library.properties: name is not a valid library name")
        if not re.fullmatch(r"\d+\.\d+\.\d+", props.get("version", "")):
            problems.append("library.properties: version is not X.Y.Z")
        if props.get("category") not in ARDUINO_CATEGORIES:
            problems.append(f"library.properties: category {props.get('category')!r} is not one of the specification's")
        if not re.match(r"https?://", props.get("url", "")):
            problems.append("library.properties: url is not a URL")
        for h in props.get("includes", "").split(","):
            if h.strip() and not (folder / "src" / h.strip()).is_file():
                problems.append(f"library.properties: includes {h.strip()} which src/ does not have")
    except (OSError, ValueError) as e:
        problems.append(f"library.properties: {e}")
    try:
        mod = yaml.safe_load((folder / "zephyr" / "module.yml").read_text())
        build = mod.get("build", {}) if isinstance(mod, dict) else None
        if not isinstance(build, dict) or set(mod) - {"name", "build"} or set(build) - {"cmake", "kconfig"}:
            problems.append("zephyr/module.yml: only name and build (cmake, kconfig) are expected")
        else:
            if not (folder / build.get("cmake", "zephyr") / "CMakeLists.txt").is_file():
                problems.append("zephyr/module.yml: build.cmake has no CMakeLists.txt")
            kconfig = folder / build.get("kconfig", "zephyr/Kconfig")
            symbols = re.findall(r"^config (\w+)$", kconfig.read_text(), re.M) if kconfig.is_file() else []
            if not symbols:
                problems.append("zephyr/module.yml: build.kconfig names no Kconfig file with a config symbol")
            zc = (folder / build.get("cmake", "zephyr") / "CMakeLists.txt").read_text()
            if not any(f"CONFIG_{s}" in zc for s in symbols):
                problems.append("zephyr/CMakeLists.txt tests none of the module's Kconfig symbols")
            for src in re.findall(r"\$\{CMAKE_CURRENT_LIST_DIR\}/\.\./src/(\S+\.c)", zc):
                if not (folder / "src" / src).is_file():
                    problems.append(f"zephyr/CMakeLists.txt: {src} is not in src/")
    except (OSError, ValueError, yaml.YAMLError) as e:
        problems.append(f"zephyr module: {e}")
    for cm in ("CMakeLists.txt", f"{name}Config.cmake"):
        text = (folder / cm).read_text() if (folder / cm).is_file() else ""
        if not text:
            problems.append(f"{cm}: missing")
        for src in re.findall(r"src/(\S+\.c)", text):
            if not (folder / "src" / src).is_file():
                problems.append(f"{cm}: {src} is not in src/")
    return problems
