"""The rig's farm layer on labgrid (hil/LAB.md), free of pytest:

    exporter_config(...)   the exporter configuration of one lab host (YAML text)
    LoopbackLab            a coordinator and N lab hosts on 127.0.0.1, each an exporter publishing
                           one QEMU-emulated board (hil/emulated_board.py) as a place: what CI runs
    place_entry(...)       a labgrid place as a board of the rig (BoardEntry, transport labgrid)
    LabgridTransport       the rig's transport through a place: acquire, flash, serial, reset,
                           release (tinydeploy.runners.farm is the labgrid client)

    python -m hil.farm exporter-config --board nano33ble --serial-number ABC123 --name bench-1
    python -m hil.farm loopback [--hosts 2]      # a lab on this machine until Ctrl-C"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from hil import rig
from tinydeploy.runners import farm, mcu
from tinydeploy.runners.qemu_system import free_port

LAB_HOSTS = ("lab-a", "lab-b", "lab-c", "lab-d")
LOCK_PLACE = "lab-lock"            # a place with no board: the rig's lock test holds it as someone else


# ---- exporter configuration -------------------------------------------------------------------

def exporter_config(board: str, serial_number: str | None = None, host: str | None = None,
                    serial_port: int | None = None, flash_port: int | None = None, baud: int = 115200,
                    group: str = "board") -> str:
    """One lab host's exporter configuration for one board (labgrid-exporter CONFIG):
    a real board by its USB serial number (the exporter publishes it through ser2net, and the
    bootloader's port by the same serial number), or an emulated board's two TCP ports."""
    if serial_number:
        res = {"console": {"cls": "USBSerialPort", "match": {"ID_SERIAL_SHORT": serial_number}, "speed": baud}}
    elif serial_port and flash_port:
        net = {"cls": "NetworkSerialPort", "host": host or "127.0.0.1", "protocol": "raw", "speed": baud}
        res = {"console": dict(net, port=serial_port), "flash": dict(net, port=flash_port)}
    else:
        raise rig.RigError("exporter config: give a USB serial number, or the serial and flash ports of an emulated board")
    # labgrid reads the file as a jinja2 template whose line comments start with ##
    head = (f"## labgrid exporter configuration: {board} on this lab host (hil/LAB.md). Run:\n"
            f"##   labgrid-exporter -c COORDINATOR:20408 -n <lab host name> <this file>\n")
    return head + yaml.safe_dump({group: res}, sort_keys=False)


# ---- a lab on this machine --------------------------------------------------------------------

def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    path = str(here) if here.is_file() else shutil.which(name)
    if not path:
        raise rig.RigError(f"{name} not found: pip install -c constraints.txt labgrid")
    return path


def _listening(port: int, timeout: float, proc: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise rig.RigError(f"{what} exited with code {proc.returncode}: {log.read_text()[-400:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise rig.RigError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:g} s: {log.read_text()[-400:]}")


class LoopbackLab:
    """A coordinator and `hosts` lab hosts on 127.0.0.1 (each: an emulated board and an exporter
    publishing it), a place per board tagged board=<id>, kind=qemu, host=<lab host>, and the lock
    test's empty place. stop() ends every process it started (whole process groups)."""

    def __init__(self, root: Path, board: str = "mps2-an386", hosts: int = 2):
        self.root = Path(root)
        self.board = board
        self.hosts = list(LAB_HOSTS[:hosts])
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.address = None
        self.places: dict[str, str] = {}          # place -> lab host

    def _spawn(self, what: str, cmd: list[str], cwd: Path) -> tuple[subprocess.Popen, Path]:
        cwd.mkdir(parents=True, exist_ok=True)
        log = cwd / f"{what}.log"
        pp = os.environ.get("PYTHONPATH")
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(rig.REPO) + (os.pathsep + pp if pp else ""))
        p = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log.open("w"), stderr=subprocess.STDOUT,
                             start_new_session=True, env=env)
        self.procs.append((what, p))
        return p, log

    def start(self) -> "LoopbackLab":
        try:
            port = free_port()
            self.address = f"127.0.0.1:{port}"
            p, log = self._spawn("coordinator", [_bin("labgrid-coordinator"), "-l", self.address], self.root / "coordinator")
            _listening(port, 60, p, "labgrid-coordinator", log)
            for host in self.hosts:
                sp, fp = free_port(), free_port()
                d = self.root / host
                p, log = self._spawn("emulated-board", [sys.executable, "-m", "hil.emulated_board", "--board", self.board,
                                                        "--serial-port", str(sp), "--flash-port", str(fp)], d)
                _listening(fp, 60, p, f"the emulated board of {host}", log)
                (d / "exporter.yaml").write_text(exporter_config(self.board, host="127.0.0.1", serial_port=sp, flash_port=fp))
                self._spawn("exporter", [_bin("labgrid-exporter"), "-c", self.address, "-n", host, "--hostname",
                                         "127.0.0.1", str(d / "exporter.yaml")], d)
            c = farm.client(self.address)
            deadline = time.monotonic() + 60
            while set(self.hosts) - set(c.s.resources):
                if time.monotonic() > deadline:
                    raise rig.RigError(f"labgrid exporters {', '.join(sorted(set(self.hosts) - set(c.s.resources)))} "
                                       f"did not register with the coordinator: see {self.root}/*/exporter.log")
                c.sync()
                time.sleep(0.1)
            for host in self.hosts:
                name = f"{host}-{self.board}"
                c.ensure_place(name, {"board": self.board, "kind": "qemu", "host": host},
                               [f"{host}/board/NetworkSerialPort"])
                self.places[name] = host
            c.ensure_place(LOCK_PLACE, {"purpose": "lock-test"}, [])
        except BaseException:
            self.stop()
            raise
        return self

    def info(self) -> dict:
        return {"address": self.address, "board": self.board, "places": self.places, "root": str(self.root)}

    def stop(self) -> list[str]:
        """Ends every process (SIGTERM, then SIGKILL of the group); returns those that needed the KILL."""
        if self.address in farm._CLIENTS:
            farm._CLIENTS.pop(self.address).close()
        forced = []
        for what, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for what, p in reversed(self.procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                forced.append(what)
            try:
                os.killpg(p.pid, signal.SIGKILL)     # the group: QEMU started by an emulated board too
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        return forced

    def alive(self) -> list[int]:
        """Processes still running in the lab's process groups (should be none after stop())."""
        return [pid for pid in _pids_in_groups([p.pid for _, p in self.procs])]


def _pids_in_groups(pgids: list[int]) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) in pgids:
            out.append(int(stat.parent.name))
    return out


# ---- places as boards of the rig --------------------------------------------------------------

def place_entry(name: str, tags: dict, inventory: dict[str, rig.BoardEntry]) -> rig.BoardEntry:
    """The rig's board for a labgrid place: its board id from the tag board=<id> (a boards/ manifest,
    settings from the inventory entry of that id when there is one)."""
    bid = tags.get("board")
    if not bid:
        raise rig.RigError(f"labgrid place {name!r} has no tag board=<id> (labgrid-client -p {name} set-tags board=<id>)")
    base = inventory.get(bid)
    manifest = base.manifest if base else bid
    from tinydeploy.targets import boards
    if manifest not in boards.load_all():
        raise rig.RigError(f"labgrid place {name!r}: tag board={bid} names no boards/{bid}.json")
    b = boards.get_board(manifest)
    emulated = tags.get("kind") == "qemu"
    return rig.BoardEntry(id=name, manifest=manifest, transport="labgrid", reset="restart" if emulated else "reopen",
                          baud=base.baud if base else b.serial_baud, flash=None if emulated else (base.flash if base else None),
                          timeout_s=base.timeout_s if base else 60.0, boot_timeout_s=base.boot_timeout_s if base else 60.0,
                          place=name, lg_emulated=emulated, notes=f"labgrid place {name}")


class LabgridTransport(rig.Transport):
    """A board through a labgrid place: acquired on first use (waiting up to `wait_s` while
    someone else holds it), flashed through its `flash` port (emulated boards) or the inventory's
    flash command, talked to through its serial resource, released by release()."""

    def __init__(self, entry: rig.BoardEntry, app: rig.App, address: str | None, wait_s: float = 300.0, say=None):
        self.entry, self.app, self.address, self.wait_s, self.say = entry, app, address, wait_s, say
        self.kind = "qemu" if entry.lg_emulated else "serial"
        self.strategy = "restart (labgrid)" if entry.lg_emulated else "reopen (labgrid)"
        self.place: farm.Place | None = None
        self.client: farm.Client | None = None
        self.dev = None
        self.flashed = None

    def acquire(self) -> farm.Place:
        if self.place is None:
            self.client = farm.client(self.address)
            self.place = self.client.acquire(self.entry.place, None, self.wait_s, say=self.say)
        return self.place

    def _control(self, cmd: str, data: bytes = b"", timeout: float = 120.0) -> str:
        from tinydeploy.errors import TinydeployError
        try:
            return self.acquire().control(cmd, data, timeout)
        except TinydeployError as e:
            raise rig.RigError(str(e)) from None

    def flash(self) -> None:
        place = self.acquire()
        if self.entry.lg_emulated:
            self._control(f"flash {len(image := Path(self.app.fw.elf).read_bytes())}", image)
        elif self.entry.flash:
            rig.run_flash(self.entry, self.app, place.serial_url)
        self.flashed = self.app.model

    def open(self):
        self.close()
        place = self.acquire()
        if self.flashed != self.app.model:
            self.flash()
        e = self.entry
        baud = (self.app.fw.harness or {}).get("baud") or e.baud
        self.dev = mcu.open_serial(place.serial_url, baud, e.timeout_s, e.boot_timeout_s, 5.0, resync=True)
        return self.dev

    def reset(self):
        self.close()
        if self.entry.lg_emulated:
            self._control("reset")
        return self.open()

    def kill(self) -> None:
        self._control("kill")

    def exit_code(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self._control("status")
            if st.startswith("exited") and st.split()[1].lstrip("-").isdigit():
                return int(st.split()[1])
            time.sleep(0.2)
        return None

    def alive(self) -> bool:
        if self.dev is None or not getattr(self.dev.ser, "is_open", True):
            return False
        return not self.entry.lg_emulated or self._control("status") == "running"

    def close(self) -> None:
        if self.dev is not None:
            self.dev.close()
            self.dev = None

    def release(self) -> None:
        self.close()
        if self.client is not None:
            if self.place is not None:
                self.client.release(self.place.name)
        self.client = self.place = None
        self.flashed = None

    def latency_unit(self) -> str:
        return "instructions" if self.entry.lg_emulated else "us"

    def where(self) -> dict:
        p = self.place
        return {"place": self.entry.place, "lab_host": p.exporter if p else None, "coordinator": self.address}


# ---- command line -----------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hil.farm", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("exporter-config", help="print a lab host's exporter configuration for one board")
    e.add_argument("--board", required=True)
    e.add_argument("--serial-number", help="the board's USB serial number (python -m serial.tools.list_ports -v)")
    e.add_argument("--serial-port", type=int, help="emulated board: its serial TCP port")
    e.add_argument("--flash-port", type=int, help="emulated board: its programming TCP port")
    e.add_argument("--host", help="emulated board: the address clients reach it at")
    e.add_argument("--baud", type=int, default=115200)
    lp = sub.add_parser("loopback", help="a coordinator and lab hosts with emulated boards on 127.0.0.1, until Ctrl-C")
    lp.add_argument("--hosts", type=int, default=2)
    lp.add_argument("--board", default="mps2-an386")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "exporter-config":
            print(exporter_config(a.board, a.serial_number, a.host, a.serial_port, a.flash_port, a.baud), end="")
            return 0
        import tempfile
        lab = LoopbackLab(Path(tempfile.mkdtemp(prefix="tinydeploy-lab-")), a.board, a.hosts).start()
        print(json.dumps(lab.info()), flush=True)
        print(f"export LG_COORDINATOR={lab.address}   # Ctrl-C stops the lab", flush=True)
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
        finally:
            lab.stop()
        return 0
    except rig.RigError as err:
        print(f"hil.farm: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
