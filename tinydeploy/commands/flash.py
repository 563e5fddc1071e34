"""`tinydeploy flash`: upload a built firmware project to a real board (PlatformIO upload)."""
from __future__ import annotations

from pathlib import Path

from tinydeploy.commands.common import Context
from tinydeploy.errors import TinydeployError


def add_parser(sub) -> None:
    p = sub.add_parser("flash", help="flash a built firmware project to a board (PlatformIO upload)")
    p.add_argument("builddir", nargs="?", help="the project folder `tinydeploy build` wrote")
    p.add_argument("--board", required=True)
    p.add_argument("--port", help="serial port of the board (default: PlatformIO finds it)")


def main(args, ctx: Context) -> int:
    from tinydeploy.firmware import mcu_board, pio
    board = mcu_board(args.board)
    if board.runner != "serial":
        raise TinydeployError(f"{args.board} is not a board to flash (it runs via {board.runner})")
    folder = Path(args.builddir) if args.builddir else None
    if folder is None or not (folder / "platformio.ini").is_file():
        raise TinydeployError(f"give the folder `tinydeploy build --board {args.board}` wrote (it holds platformio.ini)")
    pio.pio_upload(folder, board.id, args.port)
    print(f"flashed {folder} to {board.id}")
    return 0
