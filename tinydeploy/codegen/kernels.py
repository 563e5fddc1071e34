"""Kernel variants: which template implements (family, dtype) on an ISA, and rendering it.

The rule: a variant exists for (family, dtype, isa) when VARIANTS below declares it; lookup
walks the target's ISA list in preference order and falls back to the portable reference
(`ref`): the table's own `ref` entry, else the template <family>_<dtype>_ref.c.j2, else the
type-generic <family>_ref.c.j2 (data movement). A template written for several ISAs takes the
ISA as the parameter `isa`.

A variant may not apply to one specialisation (e.g. the Cortex-M4 convolution only handles
packed weights and 3-wide depthwise windows): its template then renders nothing, and the next
ISA in the list, finally `ref`, renders the layer under its own name. Whatever a variant renders
under ISA X must contain X's instructions (ISA_C[X].instructions): render() refuses anything
else, so reference code can never pass for an ISA variant.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2

from tinydeploy.codegen import cfmt
from tinydeploy.codegen.cfmt import c_type
from tinydeploy.errors import TinydeployError

TEMPLATES = Path(__file__).resolve().parents[2] / "firmware_templates"

_DTYPES = {"f32": "float32", "s8": "int8", "u8": "uint8", "s32": "int32"}


@dataclass(frozen=True)
class IsaC:
    """What generated C needs to know about an ISA: the header its intrinsics come from, and a
    pattern that code written for it always contains (its intrinsics, or the td_runtime.h
    helpers that wrap its instructions)."""
    header: str | None
    instructions: str


ISA_C = {
    "avx2": IsaC("immintrin.h", r"\b_mm256_\w+\("),
    "avx512": IsaC("immintrin.h", r"\b_mm512_\w+\("),
    "avx512bw": IsaC("immintrin.h", r"\b_mm512_(?:madd_epi16|cvtepi8_epi16|cvtepu8_epi16|unpack(?:lo|hi)_epi16|max_ep[iu]8)\("),
    "avx512-vnni": IsaC("immintrin.h", r"\b_mm512_dpbusd_epi32\("),
    "avx-vnni": IsaC("immintrin.h", r"\b_mm256_dpbusd_avx_epi32\("),
    "neon": IsaC("arm_neon.h", r"\bv(?:fmaq|ld1q|st1q)_\w+\(|\"fmla %\[\w+\]\.4s|\"(?:smlal|saddw)2? %\[\w+\]\.4s"),     # intrinsics or asm FMLA / SMLAL / SADDW
    "neon-dotprod": IsaC("arm_neon.h", r"\bvdotq_(?:laneq_)?[su]32\(|\"sdot v\d+\.4s"),     # intrinsics or asm SDOT
    "cortex-m4-dsp": IsaC("arm_acle.h", r"\b(?:__smla\w+|__[su]xtab16|__[su]xtb16|td_dsp_\w+)\("),
    "cortex-m4-fpu": IsaC(None, r"\btd_fpu_vfma\w*\("),
}


@dataclass(frozen=True)
class Variant:
    family: str
    dtypes: tuple[str, ...]
    isas: tuple[str, ...]
    template: str          # file in firmware_templates/kernels/


# The ISA variants (and the reference variants of templates that take the ISA as a parameter).
# Every other (family, dtype) is portable C only: <family>_<dtype>_ref.c.j2 or <family>_ref.c.j2.
_GEMM_ISAS = ("avx2", "avx512", "neon", "ref")
_Q8_ISAS = ("avx512-vnni", "avx512bw", "avx-vnni", "avx2", "neon-dotprod", "neon")
VARIANTS = (
    Variant("conv2d_gemm", ("f32",), _GEMM_ISAS, "conv2d_gemm_f32.c.j2"),
    Variant("conv2d_gemmt", ("f32",), _GEMM_ISAS, "conv2d_gemmt_f32.c.j2"),
    Variant("conv2d_igemm", ("f32",), _GEMM_ISAS, "conv2d_igemm_f32.c.j2"),
    Variant("conv2d_winograd", ("f32",), _GEMM_ISAS, "conv2d_winograd_f32.c.j2"),
    Variant("dense_packed", ("f32",), _GEMM_ISAS, "dense_packed_f32.c.j2"),
    Variant("conv2d_dw", ("f32",), ("avx2", "avx512", "neon"), "conv2d_dw_f32_simd.c.j2"),
    Variant("conv2d_first", ("f32",), ("avx2", "avx512", "neon"), "conv2d_first_f32.c.j2"),
    Variant("dense_gemv", ("f32",), ("avx2", "avx512", "neon"), "dense_gemv_f32.c.j2"),
    Variant("conv2d", ("f32",), ("cortex-m4-fpu",), "conv2d_f32_cortex-m4-fpu.c.j2"),
    Variant("qconv2d", ("s8", "u8"), ("cortex-m4-dsp",), "qconv2d_cortex-m4-dsp.c.j2"),
    # 8-bit on caching CPUs (schedule/q8.py picks the ISA per layer: the first of the target's
    # whose Q8 descriptor multiplies the layer's weight type)
    Variant("qconv2d_gemm", ("s8", "u8"), _Q8_ISAS, "qconv2d_gemm.c.j2"),
    Variant("qconv2d_igemm", ("s8", "u8"), _Q8_ISAS, "qconv2d_igemm.c.j2"),
    Variant("qconv2d_dw", ("s8", "u8"), ("avx512bw", "avx2", "neon-dotprod", "neon"), "qconv2d_dw.c.j2"),
    # exact integer Winograd F(2x2, 3x3) for 3x3 stride-1 layers (schedule/q8wino.py)
    Variant("qconv2d_winograd", ("s8", "u8"), ("avx2", "neon"), "qconv2d_winograd.c.j2"),
    # short K with the output pixels in the vector lanes, SMLAL by lane (schedule/q8lanes.py)
    Variant("qconv2d_lanes", ("s8", "u8"), ("neon",), "qconv2d_lanes.c.j2"),
    Variant("qdense_packed", ("s8", "u8"), _Q8_ISAS, "qdense_packed.c.j2"),
    Variant("qdense", ("s8", "u8"), ("cortex-m4-dsp",), "qdense_cortex-m4-dsp.c.j2"),
    Variant("qadd", ("s8", "u8"), ("cortex-m4-dsp",), "qadd_cortex-m4-dsp.c.j2"),
    Variant("qadd", ("s8", "u8"), ("avx512", "avx2"), "qadd_simd.c.j2"),
    Variant("qadd", ("s8", "u8"), ("neon",), "qadd_neon.c.j2"),
    # 8-bit max pooling, stride 1 or 2 across (byte maxima over rows, then over a row buffer); ResNet-50's
    # stem pool (3x3 s2, 64x112x112 uint8): AVX2 host 467 -> 39 us (bench --layers), rpi4 7.53 M -> 0.56 M
    # instructions (exact, qemu-aarch64)
    Variant("qpool2d", ("s8", "u8"), ("avx512bw", "avx2", "neon"), "qpool2d_simd.c.j2"),
)
_BY_KEY = {(v.family, d, i): v for v in VARIANTS for d in v.dtypes for i in v.isas}


# ---- what the kernels use from td_runtime.h ------------------------------------------------------

_NEEDS: ContextVar[set | None] = ContextVar("td_runtime_needs", default=None)


def _need(*what) -> str:
    """Called by templates (`need(...)`) for each td_runtime.h helper the C they emit calls;
    records it for the project being generated. Renders as nothing."""
    needs = _NEEDS.get()
    if needs is not None:
        needs.add(tuple(what))
    return ""


@contextmanager
def collecting_needs(needs: set):
    """Within the block, every rendered kernel adds the td_runtime.h helpers it calls to `needs`."""
    token = _NEEDS.set(needs)
    try:
        yield needs
    finally:
        _NEEDS.reset(token)


@lru_cache(maxsize=1)
def env() -> jinja2.Environment:
    if not TEMPLATES.is_dir():
        raise TinydeployError(f"firmware templates not found at {TEMPLATES}; install tinydeploy from a "
                              "checkout with `pip install -e .`")
    e = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                           keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    # Constants are folded here rather than left to the C compiler: `x - -128`, `k * 1`, `/ 1`.
    e.globals.update(need=_need, c_add=cfmt.c_add, c_plus=cfmt.c_plus, c_plusf=cfmt.c_plusf, c_mul=cfmt.c_mul,
                     c_div=cfmt.c_div, c_ceil_div=cfmt.c_ceil_div, c_terms=cfmt.c_terms,
                     c_strided=cfmt.c_strided, c_hex32=cfmt.c_hex32, c_pair16=cfmt.c_pair16, c_double=cfmt.c_double)
    return e


def _ref_template(family: str, dtype: str) -> str | None:
    for name in (f"{family}_{dtype}_ref.c.j2", f"{family}_ref.c.j2"):
        if (TEMPLATES / "kernels" / name).is_file():
            return f"kernels/{name}"
    return None


def variants(family: str, dtype: str) -> list[str]:
    """All ISAs with a variant of (family, dtype), 'ref' first."""
    isas = [i for (f, d, i) in _BY_KEY if f == family and d == dtype]
    if "ref" not in isas and _ref_template(family, dtype):
        isas.append("ref")
    return sorted(isas, key=lambda v: (v != "ref", v))


def has_variant(family: str, dtype: str, isa: str) -> bool:
    """Whether VARIANTS declares (family, dtype) for `isa`."""
    return (family, dtype, isa) in _BY_KEY


def resolve(family: str, dtype: str, isas: list[str]) -> tuple[str, str]:
    """(template path, isa chosen) for the first ISA in `isas` that has a variant, else ref."""
    for isa in list(isas) + ["ref"]:
        v = _BY_KEY.get((family, dtype, isa))
        if v is not None:
            return f"kernels/{v.template}", isa
    ref = _ref_template(family, dtype)
    if ref is None:
        raise TinydeployError(f"no kernel template for {family} ({dtype}); this is a tinydeploy bug")
    return ref, "ref"


def check_isa(source: str, isa: str, template: str) -> None:
    """Refuse C rendered for `isa` that contains none of its instructions (reference code under an
    ISA's name)."""
    facts = ISA_C.get(isa)
    if facts is None:
        if isa != "ref":
            raise TinydeployError(f"kernel ISA {isa!r} has no entry in codegen/kernels.py ISA_C; this is a "
                                  "tinydeploy bug")
        return
    if not re.search(facts.instructions, source):
        raise TinydeployError(f"kernel template {template} rendered for {isa} contains none of its "
                              f"instructions ({facts.instructions}); this is a tinydeploy bug")


def render(family: str, dtype: str, params: dict, fn: str, isas: list[str]) -> tuple[str, str]:
    """(C source of one specialised kernel function, isa chosen). A variant that does not apply to
    these parameters renders nothing; the next ISA (finally ref) is tried."""
    T = c_type(_DTYPES.get(dtype, dtype))
    remaining = list(isas)
    while True:
        path, isa = resolve(family, dtype, remaining)
        source = env().get_template(path).render({**params, "fn": fn, "T": T, "isa": isa})
        if source.strip() or isa == "ref":
            break
        remaining = remaining[remaining.index(isa) + 1:] if isa in remaining else []
    check_isa(source, isa, path)
    header = ISA_C[isa].header if isa in ISA_C else None
    if header:
        source = f"#include <{header}>\n" + source
    return source, isa
