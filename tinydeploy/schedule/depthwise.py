"""Depthwise convolutions (conv2d_dw): the scratch and geometry of the kernel the target's ISA
renders. The portable kernel (conv2d_dw_f32_ref.c.j2) pads each plane and runs one flat loop; the
vector kernel (conv2d_dw_f32_simd.c.j2: avx2, avx512, neon) reads column-phase planes row by
row, RB output rows per block (see the template)."""
from __future__ import annotations

from tinydeploy.ops import Kernel
from tinydeploy.ops.registry import scratch_arg
from tinydeploy.schedule.cost import _isa, _round_up
from tinydeploy.targets.isa import get_isa


def _ref_scratch_floats(p: dict) -> int:
    """The portable kernel's padded plane (4 phase planes at stride 2), zero slack and flat
    accumulator."""
    hp = (p["OH"] - 1) * p["SH"] + (p["KH"] - 1) * p["DH"] + 1
    wp = (p["OW"] - 1) * p["SW"] + (p["KW"] - 1) * p["DW"] + 1
    planes, flat = hp * wp, 0
    if p["SH"] == p["SW"] == 1:
        flat = _round_up((p["OH"] - 1) * wp + p["OW"], 16)
    elif p["SH"] == p["SW"] == 2 and p["DH"] == p["DW"] == 1:    # 4 phase planes
        planes = 4 * ((hp + 1) // 2) * ((wp + 1) // 2)
        flat = _round_up((p["OH"] - 1) * ((wp + 1) // 2) + p["OW"], 16)
    return planes + 2 * flat


def ref_scratch_bytes(p: dict) -> int:
    """The portable kernel's scratch in bytes (what a patch-based chain's depthwise layer takes)."""
    return 4 * _ref_scratch_floats(p)


def simd_geometry(p: dict, lanes: int, registers: int) -> dict:
    """The vector kernel's parameters: VW lanes, RB output rows per block, the column-phase planes
    (HPD rows of RSP floats; per phase its padded-column phase px and the plane columns [lo, hi)
    that hold image data), the taps (row offset, phase plane, column offset), the padded rows
    with image data [RLO, RHI), whether any padding must be zeroed, whether the weights stay in
    registers."""
    sh, sw, dh, dw = p["SH"], p["SW"], p["DH"], p["DW"]
    hpd = (p["OH"] - 1) * sh + (p["KH"] - 1) * dh + 1
    used = sorted({(kx * dw) % sw for kx in range(p["KW"])})
    maxcol = max((kx * dw) // sw for kx in range(p["KW"]))
    rsp = _round_up(p["OW"], lanes) + maxcol        # the last vector's lanes stay within the row
    phases = []
    for px in used:     # plane column j holds padded column j*SW + px = image column j*SW + px - PL
        lo = min(max(0, -(-(p["PL"] - px) // sw)), rsp)
        hi = max(min(rsp, -(-(p["W"] + p["PL"] - px) // sw)), lo)
        phases.append({"px": px, "lo": lo, "hi": hi})
    taps = [{"t": ky * p["KW"] + kx, "kx": kx, "row": ky * dh, "ph": used.index((kx * dw) % sw),
             "col": (kx * dw) // sw} for ky in range(p["KH"]) for kx in range(p["KW"])]
    # stride 2 with both column phases: the plane columns [lo, hi) both phases take from the image,
    # in whole vectors of 8, are split from 16 consecutive image columns at a time (avx2: the
    # template's SPLIT8); every read stays in the row (phase 1's hi bounds column 2j + 1 - PL)
    split = None
    if sw == 2 and [ph["px"] for ph in phases] == [0, 1]:
        lo, hi = max(ph["lo"] for ph in phases), min(ph["hi"] for ph in phases)
        if hi - lo >= 8:
            split = {"lo": lo, "hi": lo + (hi - lo) // 8 * 8}
    rlo = min(p["PT"], hpd)
    rhi = max(min(p["PT"] + p["H"], hpd), rlo)
    zero = rlo > 0 or rhi < hpd or any(ph["lo"] > 0 or ph["hi"] < rsp for ph in phases)
    t = p["KH"] * p["KW"]
    rb = min(p["OH"], 4 if registers <= 16 else 8) if t <= 9 else min(p["OH"], 2 if registers <= 16 else 4)
    out = {"VW": lanes, "RB": max(1, rb), "RSP": rsp, "HPD": hpd, "PLANE": hpd * rsp, "PHASES": phases,
           "TAPS": taps, "RLO": rlo, "RHI": rhi, "ZERO": zero, "SPLIT8": split, "WREG": t + rb + 3 <= registers, "FLAT": False}
    if sh == sw == 1 and p["OW"] == p["W"] and p["OW"] < lanes:
        out.update(flat_geometry(p, lanes), WREG=t + 4 <= registers)
    out["BUF"] = len(out["PHASES"]) * out["PLANE"]
    # planes in flight: the copy of a channel runs DIST channels ahead of its computation (small
    # planes: a few hundred cycles of work, or the loads of the tap vectors would wait for the
    # copy's stores to retire)
    work = p["OH"] * p["OW"] * (p["M"] // p["C"])
    out["DIST"] = 1 if work >= 256 else 2 if work >= 64 else 3
    return out


def flat_geometry(p: dict, lanes: int) -> dict:
    """Narrow stride-1 planes whose output is as wide as the input ("same" columns): the plane is
    copied whole (one contiguous copy) below PT zero rows, and every output vector is VW
    consecutive outputs of the flat plane; tap (ky, kx) reads the copy at the flat index plus
    ky*DH*W + kx*DW. Lanes whose column the tap takes from the row before or after (the left and
    right padding) are masked to zero: MASKS[kx] lists, per output vector, which lanes keep their
    value (columns shifted by kx*DW - PL, the shift 0 needs none)."""
    w, n = p["W"], p["OH"] * p["OW"]
    lv = _round_up(n, lanes)
    masks = {}
    for kx in range(p["KW"]):
        s = kx * p["DW"] - p["PL"]
        if s:
            masks[kx] = [-1 if 0 <= (j % w) + s < w else 0 for j in range(lv)]
    span = lv + (p["KH"] - 1) * p["DH"] * w + (p["KW"] - 1) * p["DW"]
    return {"FLAT": True, "LV": lv, "D0": p["PT"] * w + p["PL"], "PLANE": span, "MASKS": masks, "ZERO": True,
            "PHASES": [{"px": 0, "lo": 0, "hi": 0}]}


def select_dw(kern: Kernel, step: int, target) -> Kernel:
    """conv2d_dw for one depthwise layer: the vector kernel where the target's ISA has one, else
    the portable kernel."""
    p = dict(kern.params)
    isa = _isa("conv2d_dw", target)
    p.update(algo="conv2d_dw", MULT=p["M"] // p["C"])
    if isa == "ref":
        floats = _ref_scratch_floats(p)
        desc = f"[conv2d_dw {isa}] {kern.desc}"
    else:
        g = simd_geometry(p, get_isa(isa).lanes, get_isa(isa).registers)
        p.update(g, isa=isa)
        floats = (g["DIST"] + 1) * g["BUF"]
        shape = (f"flat {g['VW']} lanes" if g["FLAT"] else
                 f"{g['RB']} rows x {g['VW']} lanes, {len(g['PHASES'])} x {g['HPD']}x{g['RSP']} planes")
        desc = f"[conv2d_dw {isa} {shape}] {kern.desc}"
    args = list(kern.args) + [scratch_arg(step)]
    return Kernel("conv2d_dw", kern.dtype, p, args, 4 * floats, desc, consts=dict(kern.consts))
