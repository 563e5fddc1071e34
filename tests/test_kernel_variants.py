"""The kernel-variant registry (tinydeploy/codegen/kernels.py): every template is declared, a
template written for several ISAs takes the ISA as a parameter (no per-ISA stubs), every
registered variant renders its ISA's instructions, and reference code can never pass for an ISA
variant: a variant that does not apply falls back under the name `ref`, and C rendered under an
ISA's name without its instructions stops the build. Generation only (no compiler, no QEMU): the
variants' results are held against the reference in test_fast_kernels.py, test_winograd.py and
test_cortex_m_kernels.py."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx
import pytest

from test_cortex_m_kernels import _add_model, _conv_model, _dense_model, _f32_conv_model
from test_fast_kernels import conv_model, dense_model, use_host
from test_q8_kernels import chain_model, pool_model
from tinydeploy import targets
from tinydeploy.codegen import kernels as kreg
from tinydeploy.errors import TinydeployError
from tinydeploy.pipeline import compile_model
from tinydeploy.targets import boards, get_target

KERNELS = kreg.TEMPLATES / "kernels"


def test_every_template_is_declared_and_none_is_a_stub():
    declared = {v.template for v in kreg.VARIANTS}
    for v in kreg.VARIANTS:
        assert (KERNELS / v.template).is_file(), v
        assert set(v.isas) <= set(kreg.ISA_C) | {"ref"}, v
    for p in sorted(KERNELS.glob("*.c.j2")):
        assert p.name in declared or p.name.endswith("_ref.c.j2"), f"{p.name} is neither in VARIANTS nor a reference"
        code = re.sub(r"\{#.*?#\}", "", p.read_text(), flags=re.S)
        statements = [ln.strip() for ln in code.splitlines() if ln.strip()]
        assert not all(s.startswith(("{% include", "{% set", "#include")) for s in statements), \
            f"{p.name} only sets parameters and includes another template: declare the ISA in VARIANTS instead"
    # the lookup rule: the first ISA in the target's order with a variant, else ref
    assert kreg.resolve("conv2d_gemm", "f32", ["neon-dotprod", "neon"]) == ("kernels/conv2d_gemm_f32.c.j2", "neon")
    assert kreg.resolve("conv2d_gemm", "f32", ["cortex-m4-dsp"]) == ("kernels/conv2d_gemm_f32.c.j2", "ref")
    assert kreg.resolve("qconv2d", "u8", ["cortex-m4-dsp"]) == ("kernels/qconv2d_cortex-m4-dsp.c.j2", "cortex-m4-dsp")
    assert kreg.resolve("qconv2d", "u8", ["avx2"]) == ("kernels/qconv2d_ref.c.j2", "ref")
    assert kreg.variants("conv2d_gemm", "f32") == ["ref", "avx2", "avx512", "neon"]


def _save(model: onnx.ModelProto, tmp_path, name: str):
    p = tmp_path / f"{name}.onnx"
    onnx.save(model, p)
    return p


def test_every_registered_variant_renders_its_isa(tmp_path, monkeypatch):
    """Each (template, ISA) of VARIANTS rendered for real layers; render() checks the ISA's
    instructions each time (a spy records what it checked)."""
    seen = set()
    real = kreg.check_isa

    def spy(source, isa, template):
        real(source, isa, template)
        seen.add((template.split("/")[-1], isa))
    monkeypatch.setattr(kreg, "check_isa", spy)

    conv = _save(conv_model(c=8, h=9, w=9, m=16, act="relu"), tmp_path, "conv")
    conv1x1 = _save(conv_model(c=16, h=6, w=6, m=24, k=(1, 1), pads=(0, 0, 0, 0)), tmp_path, "conv1x1")
    dense = _save(dense_model(m=3, k=40, n=30), tmp_path, "dense")
    dw = _save(conv_model(c=8, h=9, w=9, m=8, group=8, act="relu"), tmp_path, "dw")
    first = _save(conv_model(c=3, h=9, w=9, m=16, stride=(2, 2), act="relu"), tmp_path, "first")
    gemv = _save(dense_model(m=1, k=40, n=30), tmp_path, "gemv")
    f32 = [(conv, "conv2d_gemm"), (conv, "conv2d_igemm"), (conv, "conv2d_winograd2"), (conv1x1, "conv2d_gemmt"),
           (dense, "dense_packed"), (dw, "conv2d_dw"), (first, "conv2d_first"), (gemv, "dense_gemv")]
    for isa in ("avx2", "avx512", "ref"):
        with monkeypatch.context() as mp:
            use_host(mp, isa)
            for path, algo in f32:
                mp.setenv("TINYDEPLOY_ALGO", algo)
                compile_model(path, get_target("host"), board="host")
    rpi4 = boards.get_board("rpi4").make_target()
    for path, algo in f32:
        monkeypatch.setenv("TINYDEPLOY_ALGO", algo)
        compile_model(path, rpi4, board="rpi4")
    monkeypatch.delenv("TINYDEPLOY_ALGO")

    # 8-bit (schedule/q8.py): a chain that takes all four families under each ISA that has them
    q8 = _save(chain_model(np.int8), tmp_path, "q8")
    monkeypatch.setenv("TINYDEPLOY_ALGO", "qconv2d_igemm")       # igemm on KxK, im2col on the grouped one
    for isa in ("avx512-vnni", "avx512bw", "avx-vnni", "avx2"):
        with monkeypatch.context() as mp:
            mp.setitem(targets.TARGETS, "host",
                       lambda isa=isa: dataclasses.replace(targets.host(), isas=[isa, "avx2"]))
            compile_model(q8, get_target("host"), board="host")
    for board in ("rpi4", "jetson-orin"):                  # neon; neon-dotprod (then neon)
        compile_model(q8, boards.get_board(board).make_target(), board=board)
    monkeypatch.delenv("TINYDEPLOY_ALGO")
    compile_model(q8, rpi4, board="rpi4")         # by itself: qconv2d_winograd for its 3x3 stride-1 layer (neon)
    with monkeypatch.context() as mp:              # and on an AVX2 host
        mp.setitem(targets.TARGETS, "host", lambda: dataclasses.replace(targets.host(), isas=["avx2"]))
        compile_model(q8, get_target("host"), board="host")
    add = _save(_add_model((1, 8, 4, 5), (1, 8, 4, 5), -128, 4, -128, 0.05, 0.11, 0.12), tmp_path, "add")
    for isa in ("avx512", "avx2"):                          # qadd in int32 lanes (x86)
        with monkeypatch.context() as mp:
            mp.setitem(targets.TARGETS, "host", lambda isa=isa: dataclasses.replace(targets.host(), isas=[isa, "avx2"]))
            compile_model(add, get_target("host"), board="host")
    compile_model(_save(_add_model((1, 8, 4, 5), (1, 8, 4, 5), -128, 4, -128, 0.05, 0.11, 0.12), tmp_path, "add"),
                  rpi4, board="rpi4")
    pool = _save(pool_model(np.uint8), tmp_path, "pool")         # 8-bit max pooling
    for isa in ("avx512bw", "avx2"):
        with monkeypatch.context() as mp:
            mp.setitem(targets.TARGETS, "host", lambda isa=isa: dataclasses.replace(targets.host(), isas=[isa, "avx2"]))
            compile_model(pool, get_target("host"), board="host")
    compile_model(pool, rpi4, board="rpi4")

    m4 = boards.get_board("mps2-an386").make_target()
    for i, model in enumerate([_conv_model(C=16, M=16, H=6, W=6, k=(1, 1)),
                               _conv_model(C=8, M=8, H=7, W=7, k=(3, 3), pads=(1, 1, 1, 1), group=8),
                               _conv_model(C=16, M=12, H=5, W=6, k=(1, 1), xz=128, u8=True),
                               _dense_model(M=1, K=64, N=10), _dense_model(M=1, K=33, N=10, xz=128, u8=True),
                               _add_model((1, 8, 4, 4), (1, 8, 4, 4), -128, 4, -128, 0.05, 0.11, 0.12),
                               _add_model((1, 8, 4, 4), (1, 8, 4, 4), 128, 100, 0, 0.05, 0.07, 0.1, u8=True),
                               _f32_conv_model(C=4, M=8, H=6, W=6, k=(3, 3), pads=(1, 1, 1, 1))]):
        compile_model(_save(model, tmp_path, f"m4_{i}"), m4, board="mps2-an386")

    wanted = {(v.template, isa) for v in kreg.VARIANTS for isa in v.isas}
    assert wanted <= seen, f"never rendered: {sorted(wanted - seen)}"


def test_a_variant_that_does_not_apply_is_labelled_ref(tmp_path):
    """A broadcasting Add is no case for the Cortex-M4 qadd: the reference renders it, under its
    own name, and nothing in the C claims the DSP variant."""
    path = _save(_add_model((1, 4, 3, 3), (1, 4, 1, 1), -128, 0, 0, 0.05, 0.05, 0.1), tmp_path, "bcast")
    c = compile_model(path, boards.get_board("mps2-an386").make_target(), board="mps2-an386")
    src = c.files["td_kernels.c"]
    assert "/* qadd s8 (ref)" in src
    assert "cortex-m4-dsp" not in src and "smlal" not in src and "arm_acle.h" not in src


def test_reference_code_under_an_isa_name_stops_the_build(tmp_path, monkeypatch):
    """Were a registered variant to render reference code, render() refuses it."""
    monkeypatch.setitem(kreg._BY_KEY, ("qadd", "s8", "cortex-m4-dsp"),
                        kreg.Variant("qadd", ("s8",), ("cortex-m4-dsp",), "qadd_ref.c.j2"))
    path = _save(_add_model((1, 8, 4, 4), (1, 8, 4, 4), -128, 4, -128, 0.05, 0.11, 0.12), tmp_path, "add")
    with pytest.raises(TinydeployError, match="rendered for cortex-m4-dsp contains none of its instructions"):
        compile_model(path, boards.get_board("mps2-an386").make_target(), board="mps2-an386")
    with pytest.raises(TinydeployError, match="contains none of its instructions"):
        kreg.check_isa("void f(float *y) { y[0] = 0.0f; }", "avx2", "kernels/x.c.j2")
    kreg.check_isa("void f(float *y) { _mm256_storeu_ps(y, _mm256_setzero_ps()); }", "avx2", "kernels/x.c.j2")
    assert np.all([re.search(kreg.ISA_C[i].instructions, s) for i, s in
                   [("neon", "vst1q_f32(y, c);"), ("avx512", "_mm512_storeu_ps(y, c);"),
                    ("cortex-m4-dsp", "a = __smlad(x, w, a);"), ("cortex-m4-fpu", "td_fpu_vfma_4x2_u2(&a00, &xp)")]])
