"""Running firmware under QEMU (qemu-system-arm), with its serial port on a loopback TCP port.

    with Emulator(elf, board) as emu:          # board: a qemu-system board manifest (mps2-an386)
        dev = emu.boot()                       # a booted tinydeploy.runners.protocol.Device on socket://127.0.0.1:PORT

QEMU runs with -icount shift=0: every instruction takes 1 ns of virtual time, so the board's
timers count instructions exactly and counts repeat run to run. QEMU is always stopped on the
way out (normal exit, exceptions, KeyboardInterrupt): its whole process group is killed."""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError

_LIVE: set["Emulator"] = set()


def _stop_all() -> None:
    for emu in list(_LIVE):
        emu.stop()


atexit.register(_stop_all)


def _die_with_parent() -> list[str]:
    """A command prefix that makes QEMU get SIGKILL when this Python process dies, even by a
    signal that skips all cleanup (util-linux setpriv; without it, cleanup relies on stop())."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def qemu_processes(parent: int | None = None) -> list[int]:
    """Live qemu-system-* processes whose parent is `parent` (default: this process)."""
    me, found = parent or os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        if comm.startswith("qemu-system") and int(fields[1]) == me and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def qemu_binary(board) -> str:
    q = board.qemu or {}
    name = q.get("binary", "qemu-system-arm")
    path = shutil.which(name)
    if path is None:
        raise TinydeployError(f"{name} not found: emulating {board.id} needs QEMU "
                              "(Debian: apt-get install qemu-system-arm)")
    return path


class Emulator:
    """One QEMU process running `elf` on a qemu-system board; a context manager."""

    def __init__(self, elf, board, boot_timeout: float = 30.0, port: int | None = None, wait: bool = True):
        """port: a fixed loopback TCP port for the serial line (default: a free one); wait=False
        boots the guest at once and lets clients come and go (an emulated board in a lab)."""
        if not board.is_qemu_machine or not board.qemu:
            raise TinydeployError(f"board {board.id!r} is not a QEMU machine")
        self.elf = Path(elf)
        if not self.elf.is_file():
            raise TinydeployError(f"firmware {printable(str(self.elf))!r} does not exist")
        self.board = board
        self.boot_timeout = boot_timeout
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.fixed_port = port
        self.wait_for_client = wait
        self.returncode: int | None = None
        self._log = None
        self._devices = []

    @property
    def icount_shift(self) -> int:
        return int(self.board.qemu.get("icount_shift", 0))

    @property
    def url(self) -> str:
        return f"socket://127.0.0.1:{self.port}"

    def command_line(self, port: int) -> list[str]:
        q = self.board.qemu
        return [qemu_binary(self.board), "-M", q["machine"], "-display", "none", "-monitor", "none",
                "-nodefaults", "-icount", f"shift={self.icount_shift}",
                "-semihosting-config", "enable=on,target=native",
                "-serial", f"tcp:127.0.0.1:{port},server=on,wait={'on' if self.wait_for_client else 'off'}", "-kernel", str(self.elf)]

    def start(self) -> "Emulator":
        """Starts QEMU; it then waits (wait=on) for the first connection before running the guest."""
        try:
            self._log = tempfile.TemporaryFile(prefix="tinydeploy-qemu-")
            for attempt in range(3):
                self.port = self.fixed_port or free_port()
                if attempt and self.fixed_port:
                    time.sleep(0.5)       # the previous QEMU's socket may still be closing
                self.proc = subprocess.Popen(_die_with_parent() + self.command_line(self.port),
                                             stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                             start_new_session=True)
                _LIVE.add(self)
                if self._wait_listening():
                    return self
                text = self.output()
                self.stop()
                if "Address already in use" not in text:
                    raise TinydeployError(f"QEMU did not start (machine {printable(self.board.qemu['machine'])!r}, "
                                          f"firmware {printable(self.elf.name)}): {printable(text.strip(), 300) or 'no message'}")
            raise TinydeployError("QEMU could not get a free loopback port after 3 attempts")
        except BaseException:          # including KeyboardInterrupt: never leave QEMU behind
            self.close()
            raise

    def close(self) -> None:
        """stop(), and forget QEMU's output."""
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _wait_listening(self) -> bool:
        """True once QEMU accepts TCP connections (it waits for one before running the guest)."""
        deadline = time.monotonic() + self.boot_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            # QEMU's listening socket shows up in /proc/net/tcp before we connect; probing by
            # connecting would use up the one connection QEMU waits for, so look it up instead.
            if self._listening():
                return True
            time.sleep(0.02)
        raise TinydeployError(f"QEMU did not open its serial port within {self.boot_timeout:g} s")

    def _listening(self) -> bool:
        want = f"0100007F:{self.port:04X}"
        try:
            with open("/proc/net/tcp") as f:
                return any(line.split()[1] == want and line.split()[3] == "0A" for line in list(f)[1:])
        except OSError:
            time.sleep(0.5)        # no /proc: give QEMU a moment and let the connect retry
            return True

    def output(self) -> str:
        if self._log is None:
            return ""
        try:
            self._log.seek(0)
            return self._log.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""

    def device(self, timeout: float = 10.0):
        """A protocol Device on QEMU's serial port (connects, retrying for a few seconds)."""
        from tinydeploy.runners.protocol import Device
        deadline = time.monotonic() + 10.0
        while True:
            try:
                dev = Device(self.url, timeout=timeout)
                self._devices.append(dev)
                return dev
            except TinydeployError:
                if time.monotonic() > deadline or (self.proc and self.proc.poll() is not None):
                    raise
                time.sleep(0.05)

    def boot(self, timeout: float = 10.0, boot_timeout: float | None = None):
        """Starts QEMU (unless running), connects and waits for the firmware to answer: the
        protocol Device. On failure QEMU keeps running for output() and explain(); close() it."""
        if self.proc is None:
            self.start()
        dev = self.device(timeout=timeout)
        dev.wait_boot(timeout=self.boot_timeout if boot_timeout is None else boot_timeout)
        return dev

    def messages(self) -> str:
        """What QEMU printed, less the lines it always prints."""
        noise = ("QEMU waiting for connection", "has no peer")
        return "\n".join(ln for ln in self.output().splitlines() if ln.strip() and not any(n in ln for n in noise))

    def explain(self, e: TinydeployError) -> TinydeployError:
        """`e` (a device error) with how QEMU ended and what it said."""
        said = self.messages().strip()
        ended = self.wait(0.5)
        why = {3: " (the firmware crashed: hard fault)", 4: " (unexpected interrupt)"}.get(ended, "")
        return TinydeployError(f"{e}" + (f"; QEMU exited with code {ended}{why}" if ended is not None else "")
                               + (f"; QEMU said: {printable(said, 200)}" if said else ""))

    def kill(self) -> None:
        """SIGKILLs QEMU as a crash would (the rig's fault tests)."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def wait(self, timeout: float) -> int | None:
        """Waits for QEMU to exit by itself (the firmware's port_exit); its exit code or None."""
        if self.proc is None:
            return self.returncode
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return self.returncode

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Stops QEMU and everything it started; safe to call twice."""
        for dev in self._devices:
            dev.close()
        self._devices.clear()
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        if proc.poll() is None:
            # QEMU keeps no state worth saving: SIGKILL the group at once (SIGTERM can take seconds
            # on a loaded machine while the vCPU spins), then reap it.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        self.returncode = proc.returncode

    def __enter__(self) -> "Emulator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def kill_left_behind() -> list[int]:
    """Stops every Emulator still registered and SIGKILLs any QEMU child left; returns the pids
    that were still running."""
    left = sorted(set(qemu_processes()))
    _stop_all()
    for pid in qemu_processes():
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    return left
