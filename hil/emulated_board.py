"""An emulated board on a lab host: QEMU running whatever firmware was last flashed, its serial line
on a fixed TCP port (what the host's labgrid exporter publishes as a NetworkSerialPort), and a
programming port beside it (published as the NetworkSerialPort named `flash`), the emulated
counterpart of a board's bootloader:

    python -m hil.emulated_board --board mps2-an386 --serial-port 5001 --flash-port 5002

The programming port takes one command per line: `flash N` followed by N bytes of ELF image
(QEMU restarts with it; `ok` once its serial port listens), `reset` (restart with the same
image), `kill` (SIGKILL QEMU, as a crash would), `status` (`running`, or `exited CODE`). Each
answer is one line; errors are `error <why>`. QEMU keeps running between clients (the serial
port is `server=on,wait=off`), as a board keeps running between connections. SIGTERM stops QEMU
and the server."""
from __future__ import annotations

import argparse
import signal
import socketserver
import sys
import tempfile
import threading
from pathlib import Path

from tinydeploy.errors import TinydeployError
from tinydeploy.runners.qemu_system import Emulator
from tinydeploy.targets import boards

MAX_IMAGE = 64 << 20


class Board:
    def __init__(self, board_id: str, serial_port: int):
        self.board = boards.get_board(board_id)
        if not self.board.is_qemu_machine:
            raise TinydeployError(f"{board_id} is not a QEMU machine")
        self.serial_port = serial_port
        self.dir = Path(tempfile.mkdtemp(prefix="tinydeploy-emulated-board-"))
        self.elf = None
        self.emu = None
        self.lock = threading.Lock()

    def start(self) -> None:
        self.stop()
        self.emu = Emulator(self.elf, self.board, boot_timeout=30, port=self.serial_port, wait=False)
        self.emu.start()

    def stop(self) -> None:
        if self.emu is not None:
            self.emu.close()
            self.emu = None

    def handle(self, cmd: str, rfile) -> str:
        with self.lock:
            words = cmd.split()
            if words[:1] == ["flash"] and len(words) == 2 and words[1].isdigit() and 0 < int(words[1]) <= MAX_IMAGE:
                data = rfile.read(int(words[1]))
                if len(data) != int(words[1]):
                    return "error short image"
                self.elf = self.dir / "firmware.elf"
                self.elf.write_bytes(data)
                self.start()
                return "ok"
            if cmd == "reset":
                if self.elf is None:
                    return "error nothing flashed yet"
                self.start()
                return "ok"
            if cmd == "kill":
                if self.emu is not None:
                    self.emu.kill()
                return "ok"
            if cmd == "status":
                if self.emu is not None and self.emu.running():
                    return "running"
                return f"exited {self.emu.wait(0) if self.emu is not None else 'none'}"
            return "error unknown command (flash N | reset | kill | status)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--board", default="mps2-an386", help="a QEMU machine of boards/ (default mps2-an386)")
    ap.add_argument("--serial-port", type=int, required=True)
    ap.add_argument("--flash-port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    a = ap.parse_args(argv)
    try:
        board = Board(a.board, a.serial_port)
    except TinydeployError as e:
        print(f"emulated_board: {e}", file=sys.stderr)
        return 2

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            while True:
                line = self.rfile.readline(200)
                if not line:
                    return
                try:
                    answer = board.handle(line.decode("ascii", "replace").strip(), self.rfile)
                except TinydeployError as e:
                    answer = f"error {e}"
                self.wfile.write(answer.encode() + b"\n")

    # one client at a time, in the main thread: QEMU is started with a parent-death signal, which
    # Linux ties to the thread that started it (a handler thread would take QEMU with it)
    socketserver.TCPServer.allow_reuse_address = True
    srv = socketserver.TCPServer((a.host, a.flash_port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=srv.shutdown).start())
    print(f"emulated board {a.board}: serial tcp {a.host}:{a.serial_port}, flash tcp {a.host}:{a.flash_port}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        board.stop()
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
