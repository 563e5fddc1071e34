"""The tuning database: per target, the measured best algorithm of each fp32 conv/dense layer
shape, which kernel selection (select.py) uses before its cost model.

One JSON file per target, `<target name>-<ISA>.json` in this folder (e.g. host-avx512.json: an
AVX2-only host never reads AVX-512 measurements), written by `tinydeploy tune`:
  {"format": 1, "target": "host-avx512", "cpu": "...",
   "layers": {"<layer signature>": {"algo": "conv2d_igemm", "tile": [8, 32], "blocking": null,
                                    "us": 12.5, "cost_model": {"algo": ..., "us": 20.1}, ...}}}
Boards tuned without the board (`tinydeploy tune --emulate`: the Cortex-A targets under user-mode
QEMU) rank candidates by exact instructions per inference: their entries carry "instructions"
where the timed ones carry "us", and "measured" says so.
A layer signature is a readable string of everything that decides the kernel (layer_signature).
"algo", "tile" ([MR, NR] or null) and "blocking" ([kc, mc, nc] or null) are what select uses;
the rest documents the measurement ("cost_model": what the cost model chose when it was tuned,
timed in the same run; "speedup": its time over the best's).

TINYDEPLOY_TUNING=off ignores the database, =PATH reads that file instead (its "target" must
still match). A missing file is no database; an unreadable or malformed one is ignored with a
note (printed by `tinydeploy build`), never an error: tuning only ever changes speed.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
from pathlib import Path

FORMAT = 1
DIR = Path(__file__).resolve().parent

# A choice applied to every conv/dense layer, set by the tuner around the build of a one-layer
# candidate model (see forced()).
_FORCED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tinydeploy_tuning_forced", default=None)
_CACHE: dict[tuple, tuple[dict, str | None]] = {}


def target_key(target, isa: str) -> str:
    """The database name of a target: its name and the ISA of its GEMM micro-kernels."""
    return f"{target.name}-{isa}"


def db_path(key: str) -> Path | None:
    """The database file select reads for a target key (None: TINYDEPLOY_TUNING=off)."""
    env = os.environ.get("TINYDEPLOY_TUNING", "").strip()
    if env.lower() in ("off", "0", "no", "none"):
        return None
    return Path(env) if env else DIR / f"{key}.json"


def layer_signature(kern) -> str | None:
    """'conv f32 n1 c64 h56 w56 m64 k3x3 s1x1 p1x1 d1x1 g1 o56x56 relu' or
    'dense f32 m1 k256 n10 linear'; None for other kernels."""
    p = kern.params
    if kern.family == "conv2d":
        return (f"conv {kern.dtype} n{p['N']} c{p['C']} h{p['H']} w{p['W']} m{p['M']} k{p['KH']}x{p['KW']} "
                f"s{p['SH']}x{p['SW']} p{p['PT']}x{p['PL']} d{p['DH']}x{p['DW']} g{p['G']} "
                f"o{p['OH']}x{p['OW']} {p['activation'].name}")
    if kern.family == "dense":
        return f"dense {kern.dtype} m{p['M']} k{p['K']} n{p['N']} {p['activation'].name}"
    return None


def _ints(v, n: int) -> bool:
    return isinstance(v, list) and len(v) == n and all(isinstance(i, int) and i > 0 for i in v)


def valid_entry(e) -> bool:
    return (isinstance(e, dict) and isinstance(e.get("algo"), str)
            and (e.get("tile") is None or _ints(e["tile"], 2))
            and (e.get("blocking") is None or _ints(e["blocking"], 3)))


def read(path: Path) -> dict:
    """The whole database file (for the tuner: raises OSError / ValueError when unreadable)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("layers"), dict) or not isinstance(data.get("target"), str):
        raise ValueError("not a tinydeploy tuning database (needs \"target\" and \"layers\")")
    return data


def load(key: str) -> tuple[dict[str, dict], str | None]:
    """(entries by layer signature, a one-line note when the file was ignored). Cached by file
    identity, so each build costs one stat()."""
    from tinydeploy.codegen.cfmt import printable
    path = db_path(key)
    if path is None:
        return {}, None
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, f"tuning database {printable(str(path))} unreadable ({printable(str(e), 80)}): ignored"
    ident = (str(path), st.st_mtime_ns, st.st_size, key)
    if ident not in _CACHE:
        why, entries = None, {}
        try:
            data = read(path)
            if data["target"] != key:
                why = f"it is for target {printable(data['target'], 40)}, not {key}"
            else:
                entries = {k: v for k, v in data["layers"].items() if valid_entry(v)}
                if len(entries) < len(data["layers"]):
                    why = f"{len(data['layers']) - len(entries)} malformed entries"
        except (OSError, ValueError, UnicodeDecodeError) as e:
            why = printable(str(e), 80)
        note = None
        if why:
            note = (f"tuning database {printable(str(path))} {'partly ' if entries else ''}ignored ({why}); "
                    "re-run `tinydeploy tune` or delete the file")
        _CACHE[ident] = (entries, note)
    return _CACHE[ident]


# schedule/q8.py's overrides of its own choices (tests, experiments): in build keys where set, so
# that a build forced by one is not reused without it
_OVERRIDES = ("TINYDEPLOY_DW_FORM", "TINYDEPLOY_TRANS", "TINYDEPLOY_GEMM_PLANES")


def state(key: str) -> str:
    """What the selection depends on besides the model (database contents and overrides), for
    build keys: a reused build must have been made with the same database."""
    path = db_path(key)
    h = hashlib.sha256(json.dumps([os.environ.get("TINYDEPLOY_ALGO", ""), os.environ.get("TINYDEPLOY_TILE", ""),
                                   _FORCED.get()] + [f"{v}={os.environ[v]}" for v in _OVERRIDES
                                                     if os.environ.get(v)],
                                  sort_keys=True).encode())
    try:
        h.update(path.read_bytes() if path is not None else b"off")
    except OSError:
        h.update(b"missing")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def forced(choice: dict):
    """Within the block, select applies `choice` ({"algo", "tile", "blocking"}) to every fp32
    conv/dense layer (the tuner's one-layer candidate models)."""
    token = _FORCED.set(dict(choice))
    try:
        yield
    finally:
        _FORCED.reset(token)


def forced_choice() -> dict | None:
    return _FORCED.get()
