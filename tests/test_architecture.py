"""The layering rules of docs/architecture.md, held against the code:
- no import cycle inside tinydeploy/ (every import counts, also those inside functions);
- no board or target id compared outside tinydeploy/targets/ (boards are data, targets own
  their knowledge);
- no module or package named like a standard-library module or an installed dependency (run
  from inside the package, `select.py` or `inspect.py` would hide the real ones).
"""
from __future__ import annotations

import ast
import sys
from importlib import metadata
from pathlib import Path

from tinydeploy.targets import TARGETS
from tinydeploy.targets.boards import load_all
from util import REPO

PKG = REPO / "tinydeploy"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(REPO).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The tinydeploy modules `name` imports (a name imported from a package counts as its
    submodule when there is one of that name, else as the package)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tinydeploy"):
                    out.add(a.name if a.name in modules else a.name.rpartition(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if is_pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            if not base.startswith("tinydeploy"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
    out.discard(name)
    return {m for m in out if m in modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(p, m, modules) for m, p in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles inside tinydeploy/: " + "; ".join(" <-> ".join(c) for c in cycles)


def _ids() -> set[str]:
    ids = set(TARGETS) | {b.id for b in load_all().values()} | {b.target for b in load_all().values()}
    # prefixes a check could use instead of a whole id
    ids |= {i.split("-")[0] + "-" for i in ids if "-" in i} | {i.rpartition("-")[0] for i in ids if "-" in i}
    return {i for i in ids if i}


def _strings(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def test_no_board_or_target_id_compared_outside_targets():
    ids = _ids()
    found = []
    for p in sorted(PKG.rglob("*.py")):
        if (PKG / "targets") in p.parents:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            consts = []
            if isinstance(node, ast.Compare):
                consts = [s for c in [node.left, *node.comparators] for s in _strings(c)]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("startswith", "endswith")):
                consts = [s for a in node.args for s in _strings(a)]
            hits = [s for s in consts if s in ids]
            if hits:
                found.append(f"{p.relative_to(REPO)}:{node.lineno} compares {hits}")
    assert not found, "board/target ids compared outside tinydeploy/targets/:\n" + "\n".join(found)


def _dependency_names() -> set[str]:
    names = set()
    for dist in metadata.distributions():
        top = dist.read_text("top_level.txt")
        if top:
            names |= {t.strip() for t in top.split() if t.strip()}
        names.add(dist.metadata["Name"].lower().replace("-", "_"))
    return names


def test_no_module_shadows_the_standard_library_or_a_dependency():
    taken = set(sys.stdlib_module_names) | _dependency_names()
    taken.discard("tinydeploy")
    bad = []
    for p in sorted([*PKG.rglob("*.py"), *(REPO / "hil").glob("*.py")]):
        for stem in [p.stem] + [d.name for d in p.relative_to(REPO).parents if d.name]:
            if stem in taken and stem != "__init__":
                bad.append(f"{p.relative_to(REPO)} ({stem})")
    assert not bad, "modules named like the standard library or a dependency: " + ", ".join(sorted(set(bad)))
