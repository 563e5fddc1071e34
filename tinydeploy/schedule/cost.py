"""What every fast-kernel planner shares: register tiles per ISA (targets/isa.py), the cost
model's constants, cache blocking, and the switches that force a choice (TINYDEPLOY_ALGO,
TINYDEPLOY_TILE)."""
from __future__ import annotations

import os

import numpy as np

from tinydeploy import ir
from tinydeploy.codegen import kernels as kreg
from tinydeploy.ops.registry import new_const
from tinydeploy.targets.isa import get_isa


def _tiles(isa: str) -> tuple[tuple[int, int, float], ...]:
    """The register tiles of an ISA's GEMM micro-kernels (targets/isa.py)."""
    return get_isa(isa).tiles


def ranked_tiles(isa: str, rows: int, cols: int, tiles=None) -> list[tuple[int, int]]:
    """The ISA's tiles (or `tiles`: the 8-bit ones of ISA.q8), least estimated cost first for a
    rows x cols output (padding + edge tiles)."""
    def cost(t):
        mr, nr, eff = t
        full = _round_up(rows, mr) * _round_up(cols, nr) * eff
        edges = (rows % mr != 0) * (cols // nr + 1) + (cols % nr != 0) * (rows // mr + 1)
        return full + edges * mr * nr
    return [(mr, nr) for mr, nr, _ in sorted(tiles if tiles is not None else _tiles(isa), key=cost)]


def pick_tile(isa: str, rows: int, cols: int, choice: dict | None = None) -> tuple[int, int]:
    """The tile with the least estimated cost, or the tuned `choice`'s when it is one of the ISA's."""
    forced = os.environ.get("TINYDEPLOY_TILE", "")      # e.g. "8x32": experiments and tests
    if forced:
        mr, nr = (int(v) for v in forced.lower().split("x"))
        return mr, nr
    if choice and choice.get("tile") and tuple(choice["tile"]) in {t[:2] for t in _tiles(isa)}:
        return tuple(choice["tile"])
    return ranked_tiles(isa, rows, cols)[0]

# Cost model, in units of one micro-kernel multiply-accumulate (on padded tiles); measured
# roughly on the host (AVX-512 / AVX2) with single layers of ResNet-8 and ResNet-50.
PACK_COST = 11.0         # per im2col element gathered into the panels
COPY_COST = 3.0          # per activation element copied (1x1 packing, padded planes)
GATHER_COST = 6.0        # per element gathered with a stride (phase planes of a strided conv)
TILE_COST = 40.0         # per micro-tile call (C tile load/store, loop, epilogue)
GEMMT_MAX_K = 2048       # conv2d_gemmt keeps K in one block: MR x K and K x NR panels in L2 (2048: ResNet-50 stage 4, measured 1.7x in the network)
IGEMM_MAX_TAPS = 49      # taps are unrolled in the implicit micro-kernel
IGEMM_L2_PENALTY = 0.0    # measured: no visible slowdown up to 256 channels (ResNet-50 14x14)
IM2COL_FACTOR = 1.15      # micro-kernel MACs of an im2col GEMM vs a 1x1 one (measured, ResNet-50)
MIN_MACS = 4096          # below this a layer keeps the reference kernel


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def blocking(target, mr: int, nr: int, k: int, rows: int, cols: int) -> tuple[int, int, int]:
    """(kc, mc, nc): a kc x NR micro-panel of B takes about half of L1, an mc x kc block of A
    about half of L2, a kc x nc packed block of B an eighth of L2 (it is scratch in the arena)."""
    l1 = int(getattr(target, "l1d_bytes", 32768) or 32768)
    l2 = int(getattr(target, "l2_bytes", 524288) or 524288)
    kc = max(32, min(1024, (l1 // 2) // (nr * 4) // 8 * 8))
    blocks = -(-k // kc)
    kc = min(k, _round_up(-(-k // blocks), 4))           # equal blocks, no tiny tail block
    mc = max(mr, (l2 // 2) // (kc * 4) // mr * mr)
    mc = min(mc, _round_up(rows, mr))
    nc = max(2 * nr, (l2 // 8) // (kc * 4) // nr * nr)
    nc = min(nc, _round_up(cols, nr))
    return kc, mc, nc


def tuned_blocking(target, mr: int, nr: int, k: int, rows: int, cols: int, choice: dict | None):
    """blocking(), or the tuned `choice`'s (kc, mc, nc) made valid for this layer and tile."""
    if not (choice and choice.get("blocking")):
        return blocking(target, mr, nr, k, rows, cols)
    kc, mc, nc = choice["blocking"]
    return (max(1, min(k, _round_up(kc, 4))), max(mr, min(_round_up(rows, mr), mc // mr * mr)),
            max(nr, min(_round_up(cols, nr), nc // nr * nr)))


def _algo_env() -> str:
    return os.environ.get("TINYDEPLOY_ALGO", "auto").strip() or "auto"


def _isa(family: str, target) -> str:
    _, isa = kreg.resolve(family, "f32", list(target.isas))
    return isa


def _add_const(g: ir.Graph, consts: dict, base: str, data: np.ndarray) -> str:
    """A float32 constant of the kernel being made (its `consts`), under a fresh name."""
    return new_const(g, consts, base, np.asarray(data, np.float32))
