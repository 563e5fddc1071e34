"""The model table of an image: the C that puts one or more library-form models (project.Api)
behind the classic single-model API the harnesses speak (model.h: td_run(), td_input(i), ...),
so the host harness (main.c) and the firmware harness (harness.c) run any of them unchanged.

    model.h       TD_NUM_INPUTS, TD_INPUTk_BYTES, ... as the most any model needs; td_run() and
                  the accessors act on the selected model; with several, TD_MODEL_SELECT and
                  td_select_model(name)
    td_models.c   one context per model (on the model's static arena, an arena of the table's own
                  for --arena caller, or one arena all models share when they never run at the
                  same time), and a switch per function
"""
from __future__ import annotations

from dataclasses import dataclass

from tinydeploy import __version__
from tinydeploy.codegen import kernels as kreg


@dataclass(frozen=True)
class ImageModel:
    """What the table needs of one model: its prefix and header, its arena, its inputs' and
    outputs' sizes and types (the caller's: states excluded), its schedule length and whether
    the EnergyRunner's uint8 image bytes become its int8 inputs (db_subtract_128)."""
    name: str
    header: str
    arena_static: bool
    arena_bytes: int
    alignment: int
    input_bytes: tuple[int, ...]
    output_bytes: tuple[int, ...]
    output_dtypes: tuple[int, ...]
    num_steps: int
    has_states: bool


def _most(lists) -> list[int]:
    """Element-wise maximum of lists of different lengths."""
    n = max(len(v) for v in lists)
    return [max((v[i] for v in lists if i < len(v)), default=0) for i in range(n)]


def generate(models: list[ImageModel], share_arena: bool, header: str, arena_section: str | None = None) -> dict:
    """model.h and td_models.c for `models` (in the order `model NAME%` lists them)."""
    shared = max(m.arena_bytes for m in models) if share_arena else 0
    align = max(m.alignment for m in models)
    total = shared or sum(m.arena_bytes for m in models)
    dtypes = {m.output_dtypes for m in models}
    env = kreg.env()
    common = dict(models=models, share=share_arena, shared_bytes=shared, alignment=align, version=__version__,
                  arena_section=arena_section)
    return {
        "model.h": env.get_template("image.h.j2").render(
            header=header.replace("@FILE@", "model.h: the models of this image behind one API"),
            arena_total=total, num_steps=max(m.num_steps for m in models), inputs=_most([m.input_bytes for m in models]),
            outputs=_most([m.output_bytes for m in models]),
            out_dtypes=list(next(iter(dtypes))) if len(dtypes) == 1 else None, **common),
        "td_models.c": env.get_template("image.c.j2").render(
            header=header.replace("@FILE@", "td_models.c: the model table"), **common),
    }
