"""The host side of the firmware's serial protocol (MLPerf Tiny / EEMBC EnergyRunner performance
mode plus tinydeploy's extensions; firmware_templates/mcu/harness.c documents the device side).

Device works over any pyserial URL or object: a real board (/dev/ttyACM0), QEMU's serial port
(socket://127.0.0.1:PORT) or loop:// in tests. Reads are expect-style with timeouts, and every
line sent or received is kept in Device.log, so a failure can show what the board last said."""
from __future__ import annotations

import re
import time
import zlib
from dataclasses import dataclass

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError

CMD_MAX = 80          # the device's command buffer (characters before '%')
DB_CHUNK = 31         # bytes per `db <hex>%` chunk, as the EnergyRunner sends them
CAPTURE_RESENDS = 3   # a tensor whose CRC-32 fails is asked for again this many times (harness.c)
INFER_WAIT_S = 600.0  # the longest a layer may run before its outputs arrive

_LAYER = re.compile(r"^m-layer-(\d+)-(\d+)-(\d+)-(\d+)-([0-9a-f]{8})$")
_LAYER_COUNT = re.compile(r"^m-layer-count-(\d+)-(\d+)$")


INFER_MAX = 1_000_000  # the most timed runs, and the most warm-up runs, one `infer N W%` may ask for


class _Timeout(TinydeployError):
    """No complete line in time (expect() turns it into its own message; other failures, such as a
    dropped connection, pass through as they are)."""


def malformed(cmd: str, line: str, why: str) -> TinydeployError:
    """A reply the protocol does not allow: the board's fault, quoted (sanitised)."""
    return TinydeployError(f"the board answered {printable(cmd, 40) + '%'!r} with a malformed line "
                           f"{printable(line, 160)!r} ({why}); is it running tinydeploy firmware for this model?")


_FLOAT = re.compile(r"-?(?:\d+(?:\.\d*)?(?:e[+-]?\d+)?|nan|inf)")


@dataclass
class Counts:
    """What `ticks%` reports about the last `infer N W%`."""
    runs: int
    ticks_total: int
    ticks_min: int
    ticks_max: int
    tick_hz: int
    count_total: int
    count_min: int
    count_max: int
    count_unit: str     # "instructions" (exact, QEMU -icount shift=0) or "ticks"

    @property
    def ticks_per_run(self) -> float:
        return self.ticks_total / self.runs if self.runs else 0.0

    @property
    def ms_per_run(self) -> float:
        """Latency per inference by the port's timer."""
        return self.ticks_per_run / self.tick_hz * 1000.0

    @property
    def instructions(self) -> int | None:
        """Instructions per inference when the device counts them (exact under QEMU -icount)."""
        return self.count_min if self.count_unit == "instructions" else None


class Device:
    """One board (or emulator) speaking the protocol.

    port: a pyserial URL or path (str), or an already open serial-like object (read/write/close).
    timeout: default seconds to wait for a reply line."""

    def __init__(self, port, timeout: float = 10.0, baudrate: int = 115200):
        if isinstance(port, str):
            import serial
            try:
                self.ser = serial.serial_for_url(port, baudrate=baudrate, timeout=0.05)
            except (serial.SerialException, OSError, ValueError) as e:
                raise TinydeployError(f"cannot open serial port {printable(port)!r}: {printable(str(e), 160)}") from None
            self.where = port
        else:
            self.ser = port
            self.where = getattr(port, "name", None) or getattr(port, "port", None) or "serial port"
        self.timeout = timeout
        self.log: list[str] = []
        self._buf = bytearray()

    # ---- plumbing ---------------------------------------------------------------------------

    def close(self) -> None:
        try:
            self.ser.close()
        except Exception:
            pass

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def write(self, data: bytes, note: str | None = None) -> None:
        self.log.append("> " + (note if note is not None else printable(data.decode("latin-1"), 200)))
        try:
            self.ser.write(data)
            if hasattr(self.ser, "flush"):
                self.ser.flush()
        except Exception as e:
            raise TinydeployError(f"writing to {printable(str(self.where))} failed: {printable(str(e), 160)}") from None

    def _fill(self, deadline: float) -> bool:
        """Reads whatever arrives before deadline into the buffer; False when nothing did."""
        try:
            waiting = getattr(self.ser, "in_waiting", 0)
            data = self.ser.read(max(1, waiting))
        except Exception as e:   # a dropped connection, an unplugged board: at once, not at the deadline
            tail = " | ".join(self.log[-4:]) or "(nothing)"
            raise TinydeployError(f"reading from {printable(str(self.where))} failed: {printable(str(e), 160)} "
                                  f"(the connection to the board was lost); last exchange: {printable(tail, 300)}") from None
        if data:
            self._buf += data
            return True
        return time.monotonic() < deadline

    def _stopped(self, waiting_for: str, timeout: float) -> TinydeployError:
        tail = " | ".join(self.log[-6:]) or "(nothing)"
        partial = f"; partial line {printable(self._buf.decode('latin-1'), 80)!r}" if self._buf else ""
        return TinydeployError(f"board stopped answering: no {waiting_for} within {timeout:g} s on "
                               f"{printable(str(self.where))}{partial}; last exchange: {printable(tail, 400)}")

    def readline(self, timeout: float | None = None, waiting_for: str = "reply") -> str:
        """The next line without its line end; raises TinydeployError after timeout seconds."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                raw = bytes(self._buf[:nl])
                del self._buf[:nl + 1]
                text = raw.decode("latin-1").rstrip("\r")
                self.log.append("< " + printable(text, 300))
                return text
            if time.monotonic() >= deadline:
                raise _Timeout(str(self._stopped(waiting_for, timeout)))
            self._fill(deadline)

    def expect(self, pattern: str, timeout: float | None = None, what: str | None = None) -> tuple[re.Match, list[str]]:
        """Reads lines until one matches the regular expression; returns the match and the lines
        read before it. `what` names the awaited answer in the timeout error."""
        timeout = self.timeout if timeout is None else timeout
        what = what or f"line matching {pattern!r}"
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        seen = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._stopped(what, timeout)
            try:
                line = self.readline(left, waiting_for=what)
            except _Timeout:
                raise self._stopped(what, timeout) from None
            m = rx.search(line)
            if m:
                return m, seen
            seen.append(line)

    def drain(self, quiet: float = 0.3, limit: float = 5.0) -> bytes:
        """Discards input until nothing arrives for `quiet` seconds (at most `limit` seconds, and
        never longer than the device's timeout)."""
        got = bytearray(self._buf)
        self._buf.clear()
        end = time.monotonic() + min(limit, self.timeout)
        last = time.monotonic()
        while time.monotonic() < end and time.monotonic() - last < quiet:
            try:
                data = self.ser.read(max(1, getattr(self.ser, "in_waiting", 0)))
            except Exception as e:
                raise TinydeployError(f"reading from {printable(str(self.where))} failed: {printable(str(e), 160)} "
                                      "(the connection to the board was lost)") from None
            if data:
                got += data
                last = time.monotonic()
        if got:
            self.log.append("< (discarded) " + printable(bytes(got).decode("latin-1"), 200))
        return bytes(got)

    def command(self, cmd: str, timeout: float | None = None, check: bool = True) -> list[str]:
        """Sends `cmd%` and returns the reply lines before m-ready. With check, an e-[...] line
        raises TinydeployError."""
        if len(cmd) > CMD_MAX:
            raise TinydeployError(f"command {printable(cmd, 40)!r} is longer than the device's {CMD_MAX} characters")
        self.write(cmd.encode("ascii") + b"%")
        _, lines = self.expect(r"^m-ready$", timeout, what=f"complete reply to {cmd + '%'!r}")
        if check:
            self.raise_errors(cmd, lines)
        return lines

    @staticmethod
    def raise_errors(cmd: str, lines: list[str]) -> None:
        errs = [ln for ln in lines if ln.startswith("e-[")]
        if errs:
            raise TinydeployError(f"the board refused {printable(cmd, 40)!r}: {printable('; '.join(errs), 300)}")

    # ---- the protocol -------------------------------------------------------------------------

    def wait_boot(self, timeout: float = 30.0) -> str:
        """Waits until the device answers (name%), skipping its boot banner, which a host that
        connects late (or pyserial's socket://, which flushes input on open) may miss in part.
        Returns the device's name. A byte lost while the device was still starting (QEMU's UART
        under load) garbles the command: the device answers e-[...] and it is sent again."""
        deadline = time.monotonic() + timeout
        for attempt in range(3):
            self.write(b"name%")
            m, _ = self.expect(r"^(?:m-name-dut-\[(.*)\]|(e-\[.*))$", max(0.1, deadline - time.monotonic()),
                               what="the answer to 'name%'")
            self.expect(r"^m-ready$", max(0.1, deadline - time.monotonic()))
            if m.group(2) is None:
                return m.group(1)
        raise TinydeployError(f"the board answered 'name%' with {printable(m.group(2), 80)} three times; "
                              "check the serial settings (115200 8N1) and that it runs tinydeploy firmware")

    def resync(self, timeout: float | None = None) -> None:
        """Ends whatever partial command the device holds ('%') and discards the answers."""
        self.write(b"%")
        self.expect(r"^m-ready$", timeout)
        self.drain()

    def name(self) -> str:
        return self._field(self.command("name"), r"^m-name-dut-\[(.*)\]$", "name")

    def profile(self) -> dict:
        lines = self.command("profile")
        return {"profile": self._field(lines, r"^m-profile-\[(.*)\]$", "profile"),
                "model": self._field(lines, r"^m-model-\[(.*)\]$", "profile")}

    def timestamp_us(self) -> int:
        return int(self._field(self.command("timestamp"), r"^m-lap-us-(\d+)$", "timestamp"))

    def load(self, data: bytes, timeout: float | None = None) -> None:
        """Fills the input buffer with the binary bulk load (bload N CRC%), checked by CRC-32."""
        if not data:
            raise TinydeployError("nothing to load: the model's inputs are empty")
        cmd = f"bload {len(data)} {zlib.crc32(data):08x}"
        self.write(cmd.encode() + b"%")
        m, before = self.expect(r"^(m-bload-ready-\d+|m-ready)$", timeout)
        if m.group(1) == "m-ready":
            self.raise_errors(cmd, before)
            raise TinydeployError(f"the board did not accept {cmd!r}: {printable(' | '.join(before), 200)}")
        self.write(data, note=f"({len(data)} raw bytes)")
        # about 18 KB/s through QEMU's UART, 11 KB/s at 115200 baud: within the device's timeout
        _, lines = self.expect(r"^m-ready$", self.timeout if timeout is None else timeout)
        self.raise_errors(cmd, lines)
        if "m-load-done" not in lines:
            raise TinydeployError(f"bulk load of {len(data)} bytes did not complete: {printable(' | '.join(lines), 200)}")

    def load_hex(self, data: bytes, chunk: int = DB_CHUNK) -> None:
        """Fills the input buffer the EnergyRunner way: db load N%, then db <hex>% chunks."""
        self.command(f"db load {len(data)}")
        for i in range(0, len(data), chunk):
            lines = self.command("db " + data[i:i + chunk].hex())
        if "m-load-done" not in lines:
            raise TinydeployError(f"db load of {len(data)} bytes did not complete")

    def infer(self, n: int = 1, warmup: int = 0, timeout: float | None = None) -> float:
        """Runs `infer n warmup%` (1 <= n and 0 <= warmup, each at most INFER_MAX); returns the
        latency in port ticks per inference (see counts()). `timeout`: seconds for the whole reply
        (default: the device's)."""
        for what, v, lo in (("runs", n, 1), ("warm-up runs", warmup, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= INFER_MAX:
                raise TinydeployError(f"{what} must be a whole number from {lo} to {INFER_MAX}, not {printable(str(v), 20)}")
        cmd = f"infer {n} {warmup}"
        lines = self.command(cmd, self.timeout if timeout is None else timeout)
        if "m-infer-done" not in lines:
            raise TinydeployError(f"infer did not complete: {printable(' | '.join(lines[-4:]), 200)}")
        self.last_results = self._results(lines, cmd)
        self.last_counts = self.counts()
        if self.last_counts.runs != n:
            raise malformed("ticks", f"runs-{self.last_counts.runs}", f"{n} runs were asked for")
        return self.last_counts.ticks_per_run

    def counts(self) -> Counts:
        lines = self.command("ticks")
        t = self._match(lines, r"^m-ticks-total-(\d+)-runs-(\d+)-min-(\d+)-max-(\d+)-hz-(\d+)$", "ticks")
        c = self._match(lines, r"^m-count-total-(\d+)-min-(\d+)-max-(\d+)-unit-\[(\w+)\]$", "ticks")
        counts = Counts(runs=int(t[2]), ticks_total=int(t[1]), ticks_min=int(t[3]), ticks_max=int(t[4]),
                        tick_hz=int(t[5]), count_total=int(c[1]), count_min=int(c[2]), count_max=int(c[3]),
                        count_unit=c[4])
        if counts.tick_hz <= 0:
            raise malformed("ticks", t[0], "a tick rate of 0 Hz")
        if counts.runs and not (counts.ticks_min <= counts.ticks_max and counts.count_min <= counts.count_max):
            raise malformed("ticks", t[0] + " | " + c[0], "the slowest run is faster than the fastest")
        return counts

    def results(self) -> list[float]:
        return self._results(self.command("results"))

    def outputs(self) -> bytes:
        """Every output tensor's raw bytes, back to back (rawout%)."""
        lines = self.command("rawout")
        n = int(self._field(lines, r"^m-rawout-bytes-(\d+)$", "rawout"))
        chunks = []
        for ln in lines:
            if ln.startswith("m-raw-"):
                if not re.fullmatch(r"m-raw-(?:[0-9a-fA-F]{2})+", ln):
                    raise malformed("rawout", ln, "not an even number of hexadecimal digits")
                chunks.append(bytes.fromhex(ln[len("m-raw-"):]))
        data = b"".join(chunks)
        if len(data) != n:
            raise malformed("rawout", f"m-rawout-bytes-{n}", f"it announced {n} bytes but sent {len(data)}")
        return data

    def read_exact(self, n: int, timeout: float | None = None, what: str = "raw bytes") -> bytes:
        """Exactly n raw bytes (binary: line ends are data here); raises after timeout seconds."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while len(self._buf) < n:
            if time.monotonic() >= deadline:
                raise self._stopped(f"{what} ({len(self._buf):,} of {n:,} bytes arrived)", timeout)
            self._fill(deadline)
        data = bytes(self._buf[:n])
        del self._buf[:n]
        self.log.append(f"< ({n} raw bytes)")
        return data

    def capture(self, send: bool = True, timeout: float | None = None, resends: int = CAPTURE_RESENDS) -> dict:
        """`capture T%` of the capture build (harness.c's capture extension): one inference of the
        loaded input, every layer's outputs received one at a time and checked by CRC-32 (a
        mismatch asks for the same tensor again, at most `resends` times), and the work counter
        around each layer. Returns {"tensors": {(step, index): (dtype code, bytes)}, "counts":
        {step: count}, "unit": the counter's unit, "results": the results line's values}."""
        cmd = f"capture {int(bool(send))}"
        timeout = self.timeout if timeout is None else timeout
        self.write(cmd.encode() + b"%")
        tensors, counts, unit, lines, failed, gave_up = {}, {}, None, [], 0, None
        while True:
            ln = self.readline(max(timeout, INFER_WAIT_S), waiting_for=f"the next layer of {cmd + '%'!r}")
            m = _LAYER.match(ln)
            if m:
                step, index, dtype, n, crc = int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5], 16)
                data = self.read_exact(n, max(timeout, n / 2000), what=f"layer {step}'s tensor")
                if zlib.crc32(data) == crc:
                    tensors[(step, index)] = (dtype, data)
                    failed = 0
                    self.write(b"+", note="(next layer)")
                elif failed < resends:
                    failed += 1
                    self.write(b"r", note="(CRC-32 mismatch: the same tensor again)")
                else:
                    gave_up = step
                    self.write(b"x", note="(CRC-32 mismatch again: stop)")
                continue
            m = _LAYER_COUNT.match(ln)
            if m:
                counts[int(m[1])] = int(m[2])
                continue
            m = re.match(r"^m-count-unit-\[(\w+)\]$", ln)
            if m:
                unit = m[1]
                continue
            if ln == "m-ready":
                break
            lines.append(ln)
        if gave_up is not None:
            raise TinydeployError(f"layer {gave_up}'s tensor failed its CRC-32 {resends + 1} times in a row: the serial "
                                  f"link on {printable(str(self.where))} loses or changes bytes (check the cable and the "
                                  "baud rate)")
        self.raise_errors(cmd, lines)
        if not any(ln.startswith("m-capture-done-") for ln in lines):
            raise TinydeployError(f"the board did not complete {cmd + '%'!r}: {printable(' | '.join(lines[-4:]), 200)}")
        return {"tensors": tensors, "counts": counts, "unit": unit, "results": self._results(lines)}

    def stack(self) -> tuple[int, int]:
        m = self._match(self.command("stack"), r"^m-stack-used-(\d+)-of-(\d+)$", "stack")
        return int(m[1]), int(m[2])

    def select_model(self, name: str) -> None:
        """Firmware with several models: `model NAME%` makes the following commands act on it."""
        lines = self.command(f"model {name}")
        if f"m-model-selected-[{name}]" not in lines:
            raise TinydeployError(f"the board did not select model {printable(name, 40)!r}: "
                                  f"{printable(' | '.join(lines), 200)}")

    def models(self) -> tuple[list[str], str]:
        """The models of a firmware with several, and the selected one (`model%`)."""
        m = self._match(self.command("model"), r"^m-models-\[(.*)\]-selected-\[(.*)\]$", "model")
        return m.group(1).split(), m.group(2)

    def quit(self, timeout: float = 5.0) -> None:
        self.write(b"quit%")
        self.expect(r"^m-bye$", timeout)

    # ---- parsing helpers --------------------------------------------------------------------

    def _match(self, lines: list[str], pattern: str, what: str) -> re.Match:
        for ln in lines:
            m = re.match(pattern, ln)
            if m:
                return m
        raise TinydeployError(f"the board's answer to {printable(what, 40) + '%'!r} lacks the line it must have: "
                              f"{printable(' | '.join(lines), 200) or '(nothing)'}; is it running tinydeploy firmware?")

    def _field(self, lines, pattern, what) -> str:
        return self._match(lines, pattern, what).group(1)

    def _results(self, lines: list[str], cmd: str = "results") -> list[float]:
        m = self._match(lines, r"^m-results-\[(.*)\]$", cmd)
        values = [x for x in m.group(1).split(",") if x]
        bad = next((x for x in values if not _FLOAT.fullmatch(x)), None)
        if bad is not None:
            raise malformed(cmd, m.group(0), f"{printable(bad, 20)!r} is not a number")
        return [float(x) for x in values]
