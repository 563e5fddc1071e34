"""A misbehaving board for tests: a TCP server (pyserial's socket:// URL reaches it) that speaks
just enough of the firmware's protocol (name, bload, infer, rawout, ticks, stack) to get through
`tinydeploy measure`, with one fault chosen by the test:

    FakeBoard(out_bytes, fault="silent-infer")   never answers infer%
    fault="drop-on-infer"                         closes the connection when infer% arrives
    fault="bad-results" / "bad-raw" / "zero-hz"    malformed m-results-[...], m-raw-..., hz-0 lines
    fault=None                                     a well-behaved board whose outputs are zeros
"""
from __future__ import annotations

import socket
import threading


class FakeBoard:
    def __init__(self, out_bytes: int, fault: str | None = None, name: str = "tinydeploy mps2-an386"):
        self.out_bytes, self.fault, self.name = out_bytes, fault, name
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(4)
        self.url = f"socket://127.0.0.1:{self.srv.getsockname()[1]}"
        self.seen: list[str] = []
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop = True
        try:
            self.srv.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            with conn:
                try:
                    self._session(conn)
                except OSError:
                    pass

    def _session(self, conn: socket.socket) -> None:
        buf = b""
        pending_load = 0
        while True:
            data = conn.recv(4096)
            if not data:
                return
            buf += data
            while True:
                if pending_load:
                    take = min(pending_load, len(buf))
                    buf, pending_load = buf[take:], pending_load - take
                    if pending_load:
                        break
                    conn.sendall(b"m-load-done\r\nm-ready\r\n")
                    continue
                if b"%" not in buf:
                    break
                cmd, _, buf = buf.partition(b"%")
                text = cmd.decode("latin-1").strip()
                self.seen.append(text)
                reply, pending_load, close = self._reply(text)
                if close:
                    conn.close()
                    return
                if reply is not None:
                    conn.sendall(reply)

    def _reply(self, cmd: str) -> tuple[bytes | None, int, bool]:
        words = cmd.split()
        lines: list[str] = []
        load = 0
        if not words:
            lines = []
        elif words[0] == "name":
            lines = [f"m-name-dut-[{self.name}]"]
        elif words[0] == "bload":
            load = int(words[1])
            return f"m-bload-ready-{load}\r\n".encode(), load, False
        elif words[0] == "infer":
            if self.fault == "silent-infer":
                return None, 0, False
            if self.fault == "drop-on-infer":
                return None, 0, True
            n = int(words[1])
            results = "abc,1.0" if self.fault == "bad-results" else ",".join(["0"] * 4)
            lines = [f"m-warmup-start-{words[2] if len(words) > 2 else 0}", "m-warmup-done", f"m-infer-start-{n}",
                     "m-lap-us-1", "m-lap-us-2", "m-infer-done", f"m-results-[{results}]"]
        elif words[0] == "ticks":
            hz = 0 if self.fault == "zero-hz" else 1000000
            lines = [f"m-ticks-total-100-runs-1-min-100-max-100-hz-{hz}",
                     "m-count-total-100-min-100-max-100-unit-[ticks]"]
        elif words[0] == "rawout":
            raw = "zz" * self.out_bytes if self.fault == "bad-raw" else "00" * self.out_bytes
            lines = [f"m-rawout-bytes-{self.out_bytes}"] + [f"m-raw-{raw[i:i + 64]}" for i in range(0, len(raw), 64)]
        elif words[0] == "stack":
            lines = ["m-stack-used-100-of-1000"]
        else:
            lines = [f"e-[unknown command: {words[0]}]"]
        return "".join(ln + "\r\n" for ln in lines + ["m-ready"]).encode(), load, False
