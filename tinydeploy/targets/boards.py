"""Boards are data: boards/<id>.json, validated against boards/schema.json, read into a typed
`Board` that the rest of tinydeploy is handed once and asks: what kind of board it is, how its
builds run, which QEMU machine stands in for it, and the Target (compiler, flags, ISAs, caches)
its code is compiled for. Nothing outside tinydeploy/targets and boards/ compares board ids."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import jsonschema

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError

BOARDS_DIR = Path(__file__).resolve().parents[2] / "boards"
DEFAULT_STACK_BYTES = 8192


@dataclass(frozen=True)
class Board:
    """One board manifest. Units are in the names; optional facts are None when the manifest
    leaves them out. `runner` says how its builds run: "native" (this machine), "qemu-system" (the
    board is a QEMU machine), "serial" (a real microcontroller on a serial port), "ssh" (a Linux
    board reached over ssh)."""
    id: str
    name: str
    target: str                    # name of the Target its code is compiled for (targets.get_target)
    kind: str                      # "linux" or "mcu"
    runner: str
    alignment_bytes: int
    cpu: str | None = None
    clock_hz: int | None = None
    cores: int | None = None
    ram_bytes: int | None = None
    flash_bytes: int | None = None
    flash_origin: int = 0
    ram_origin: int = 0
    stack_bytes: int = DEFAULT_STACK_BYTES
    l1d_bytes: int | None = None
    l2_bytes: int | None = None
    l3_bytes: int | None = None
    upload: dict | None = None
    qemu: dict = field(default_factory=dict)
    emulate_with: str | None = None
    notes: str = ""
    port: str | None = None
    serial_baud: int = 115200
    power_monitor: dict | None = None
    platformio: dict | None = None
    memory_regions: tuple = ()      # dicts: name, kind ("ram" or "flash"), origin, bytes, notes

    # ---- what kind of board -----------------------------------------------------------------
    @property
    def is_mcu(self) -> bool:
        return self.kind == "mcu"

    @property
    def is_linux(self) -> bool:
        return self.kind == "linux"

    @property
    def runs_here(self) -> bool:
        """Its builds are this machine's own programs (the host board)."""
        return self.runner == "native"

    @property
    def is_qemu_machine(self) -> bool:
        """The board is a QEMU machine (its firmware only ever runs emulated)."""
        return self.runner == "qemu-system"

    @property
    def qemu_user(self) -> list[str] | None:
        """How to run a Linux board's binary here under user-mode QEMU (`qemu-aarch64 -cpu X`),
        or None when the manifest names no emulator."""
        q = self.qemu
        return [q["user"], "-cpu", q["cpu"]] if q.get("user") and q.get("cpu") else None

    def emulator(self) -> "Board":
        """The QEMU machine that runs this microcontroller's firmware: itself, or the board its
        manifest names in emulate_with (the firmware is then built with this board's limits)."""
        if self.is_qemu_machine:
            return self
        if not self.emulate_with:
            raise TinydeployError(f"board {self.id!r} cannot be emulated (its manifest names no emulate_with)")
        machine = get_board(self.emulate_with)
        if not machine.is_qemu_machine:
            raise TinydeployError(f"boards/{self.id}.json: emulate_with {self.emulate_with!r} is not a QEMU machine")
        return machine

    def require_mcu(self) -> "Board":
        """This board, checked to be a microcontroller with the facts firmware needs."""
        if not self.is_mcu:
            raise TinydeployError(f"board {self.id!r} is not a microcontroller (kind {self.kind})")
        for key in ("flash_bytes", "ram_bytes", "port"):
            if not getattr(self, key):
                raise TinydeployError(f"boards/{self.id}.json: a microcontroller board needs {key!r}")
        return self

    # ---- what its code is compiled for ------------------------------------------------------
    def make_target(self):
        """The Target for this board: the named target with the board's own facts applied (data
        cache sizes, alignment), so the compiler side never needs the board id."""
        from tinydeploy.targets import get_target
        t = get_target(self.target)
        changes = {"alignment": max(t.alignment, self.alignment_bytes)}
        if self.l1d_bytes:
            changes["l1d_bytes"] = self.l1d_bytes
        if self.l2_bytes:
            changes["l2_bytes"] = self.l2_bytes
        return dataclasses.replace(t, **changes)

    def region_for(self, section: str, kind: str) -> dict:
        """Where a firmware section of its own goes: the memory region named by its first word
        (".psram.weights" -> PSRAM, any case), else the main one (kind "ram": RAM, "flash": FLASH);
        a region of flash for something written at run time is refused."""
        word = section.lstrip(".").split(".")[0].upper()
        for r in self.memory_regions:
            if r["name"] == word:
                if kind == "ram" and r["kind"] != "ram":
                    raise TinydeployError(f"section {printable(section)} names the {r['kind']} region {r['name']} of "
                                          f"{self.id}, but it is written at run time: choose a RAM region "
                                          f"({', '.join(x['name'] for x in self.memory_regions if x['kind'] == 'ram') or 'none'}) "
                                          "or another name (then it goes into the main RAM)")
                return dict(r)
        if kind == "ram":
            return {"name": "RAM", "kind": "ram", "origin": self.ram_origin, "bytes": self.ram_bytes}
        return {"name": "FLASH", "kind": "flash", "origin": self.flash_origin, "bytes": self.flash_bytes}

    @property
    def clock_note(self) -> str:
        return f"{self.clock_hz / 1e6:g} MHz" if self.clock_hz else "clock unknown"


_FIELDS = {f.name for f in dataclasses.fields(Board)}


@lru_cache(maxsize=1)
def _validator():
    schema = json.loads((BOARDS_DIR / "schema.json").read_text())
    return jsonschema.Draft202012Validator(schema)


def validate(data: dict, where: str = "board") -> dict:
    try:
        _validator().validate(data)
    except jsonschema.ValidationError as e:
        path = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise TinydeployError(f"{where}: invalid board manifest at {path}: {printable(e.message, 200)}") from None
    return data


def from_manifest(data: dict, where: str = "board") -> Board:
    """A Board from manifest data (validated first; keys the manifest leaves out or sets to null
    take the Board's defaults)."""
    validate(data, where)
    fields = {k: v for k, v in data.items() if k in _FIELDS and v is not None}
    if "memory_regions" in fields:
        fields["memory_regions"] = tuple(fields["memory_regions"])
    return Board(**fields)


@lru_cache(maxsize=1)
def load_all() -> dict[str, Board]:
    out = {}
    for p in sorted(BOARDS_DIR.glob("*.json")):
        if p.name == "schema.json":
            continue
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise TinydeployError(f"{p.name}: not valid JSON ({e.msg} at line {e.lineno})") from None
        board = from_manifest(data, p.name)
        if board.id != p.stem:
            raise TinydeployError(f"{p.name}: id {board.id!r} does not match the file name")
        out[board.id] = board
    return out


def manifest_data(board_id: str) -> dict:
    """The manifest of a shipped board as its JSON says it (for tools and tests that edit one)."""
    return json.loads((BOARDS_DIR / f"{get_board(board_id).id}.json").read_text())


def get_board(board) -> Board:
    """The Board of an id (a Board is returned as it is)."""
    if isinstance(board, Board):
        return board
    boards = load_all()
    if board not in boards:
        raise TinydeployError(f"unknown board {printable(str(board))!r}; known boards: {', '.join(boards)} "
                              "(see `tinydeploy boards`)")
    return boards[board]
