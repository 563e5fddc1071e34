"""Boards are data: boards/<id>.json, validated against boards/schema.json."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import jsonschema

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError

BOARDS_DIR = Path(__file__).resolve().parents[2] / "boards"


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


def load_all() -> dict[str, dict]:
    out = {}
    for p in sorted(BOARDS_DIR.glob("*.json")):
        if p.name == "schema.json":
            continue
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise TinydeployError(f"{p.name}: not valid JSON ({e.msg} at line {e.lineno})") from None
        validate(data, p.name)
        if data["id"] != p.stem:
            raise TinydeployError(f"{p.name}: id {data['id']!r} does not match the file name")
        out[data["id"]] = data
    return out


def get_board(board_id: str) -> dict:
    boards = load_all()
    if board_id not in boards:
        raise TinydeployError(f"unknown board {printable(board_id)!r}; known boards: {', '.join(boards)} "
                              "(see `tinydeploy boards`)")
    return boards[board_id]
