"""Kernel variants: which template implements (family, dtype) on an ISA, and rendering it.

A variant is a template file firmware_templates/kernels/<family>_<dtype>_<isa>.c.j2. Lookup
walks the target's ISA list in preference order and falls back to the portable reference
(`ref`), then to a type-generic reference <family>_ref.c.j2 (data movement). Adding an
optimised kernel is adding a template file; the tests run every variant against the reference.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jinja2

from tinydeploy.codegen.cfmt import c_type
from tinydeploy.errors import TinydeployError

TEMPLATES = Path(__file__).resolve().parents[2] / "firmware_templates"

_DTYPES = {"f32": "float32", "s8": "int8", "u8": "uint8", "s32": "int32"}


@lru_cache(maxsize=1)
def env() -> jinja2.Environment:
    if not TEMPLATES.is_dir():
        raise TinydeployError(f"firmware templates not found at {TEMPLATES}; install tinydeploy from a "
                              "checkout with `pip install -e .`")
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)


def variants(family: str, dtype: str) -> list[str]:
    """All ISA variants that exist for (family, dtype), 'ref' first."""
    found = sorted(p.name[len(f"{family}_{dtype}_"):-len(".c.j2")]
                   for p in (TEMPLATES / "kernels").glob(f"{family}_{dtype}_*.c.j2"))
    return sorted(found, key=lambda v: v != "ref")


def resolve(family: str, dtype: str, isas: list[str]) -> tuple[str, str]:
    """(template path, isa chosen) for the first ISA in `isas` that has a variant, else ref."""
    for isa in list(isas) + ["ref"]:
        path = f"kernels/{family}_{dtype}_{isa}.c.j2"
        if (TEMPLATES / path).is_file():
            return path, isa
    generic = f"kernels/{family}_ref.c.j2"
    if (TEMPLATES / generic).is_file():
        return generic, "ref"
    raise TinydeployError(f"no kernel template for {family} ({dtype}); this is a tinydeploy bug")


def render(family: str, dtype: str, params: dict, fn: str, isas: list[str]) -> tuple[str, str]:
    """(C source of one specialised kernel function, isa chosen)."""
    path, isa = resolve(family, dtype, isas)
    T = c_type(_DTYPES.get(dtype, dtype))
    return env().get_template(path).render(fn=fn, T=T, **params), isa
