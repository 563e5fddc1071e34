"""Run the open MLCommons runner (mlcommons/tiny, benchmark/runner/main.py), unchanged, against a
board whose serial port it cannot see: a QEMU-emulated board, a labgrid network serial port, or
any pyserial URL. Standalone on purpose (Python standard library and pyserial only), so it runs
in the runner's own environment.

    python hil/mlcommons_shim.py --serial socket://127.0.0.1:5555 --runner ~/tiny/benchmark/runner \\
        [--realtime] [--workdir DIR] -- --mode p --dataset_path DATA \\
        --device_list devices_kws_ic_vww.yaml --test_script tests_performance.yaml

What it does, and nothing else:
1. A pseudo-terminal (/dev/pts/N) bridged to the board (--serial, any pyserial URL), so the
   runner's serial.Serial(port, baud) opens a real device path.
2. The runner finds its DUT only by USB VID:PID (device_manager.py: list_ports.comports()). The
   shim adds the pty to what list_ports.comports() returns, as a USB port with the VID:PID of the
   device list's `dut` entry (the l4r5zi entry of the stock lists, 0483:374B), so the runner's
   own discovery picks it. When pyusb has no libusb backend, usb.core.find() (only used for the
   runner's USB power monitors) returns no devices instead of failing.
3. --realtime: an emulated board runs faster than the board it stands for, and the runner checks
   host time (a performance loop must last >= 10 s). The bridge then forwards the end of each
   `infer` reply no earlier than the board's own timestamps say (m-lap-us-N, which tinydeploy's
   emulated ports count at the board's clock), so host time follows the board's.
Relative --device_list / --test_script names that do not exist in the working folder are taken
from the runner's folder. The runner writes sessions/ into --workdir (default: the current
folder). Exit code: the runner's."""
from __future__ import annotations

import argparse
import os
import re
import runpy
import sys
import threading
import time
import tty

LAP = re.compile(rb"m-lap-us-(\d+)")


class PtyBridge:
    """A pseudo-terminal whose other end is the board (a pyserial URL). `path` is the device to
    open. One end of the pty stays open here, so the runner may close and reopen it."""

    def __init__(self, url: str, baud: int = 115200, realtime: bool = False):
        import serial
        self.ser = serial.serial_for_url(url, baudrate=baud, timeout=0.05)
        self.master, self._slave = os.openpty()
        tty.setraw(self._slave)
        self.path = os.ttyname(self._slave)
        self.realtime = realtime
        self.paced_s = 0.0                       # host time added by --realtime
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._to_board, daemon=True),
                         threading.Thread(target=self._to_host, daemon=True)]
        for t in self._threads:
            t.start()

    def _to_board(self) -> None:
        import select
        while not self._stop.is_set():
            r, _, _ = select.select([self.master], [], [], 0.1)
            if not r:
                continue
            try:
                data = os.read(self.master, 4096)
            except OSError:                      # nobody has the pty open at the moment
                time.sleep(0.05)
                continue
            if data:
                self.ser.write(data)

    def _to_host(self) -> None:
        line = bytearray()
        first = None                             # (host time, device us) at the first m-lap-us of an infer
        while not self._stop.is_set():
            try:
                data = self.ser.read(max(1, getattr(self.ser, "in_waiting", 0)))
            except Exception:
                return                           # the board went away: the runner times out
            for b in data:
                line.append(b)
                if b != 0x0A:
                    continue
                m = LAP.search(line)
                if self.realtime and b"m-infer-start-" in line:
                    first = None
                elif self.realtime and m and first is None:
                    first = (time.monotonic(), int(m.group(1)))
                elif self.realtime and m:
                    due = first[0] + (int(m.group(1)) - first[1]) / 1e6
                    wait = due - time.monotonic()
                    if wait > 0:
                        self.paced_s += wait
                        time.sleep(wait)
                    first = None
                os.write(self.master, bytes(line))
                line.clear()

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2)
        for fd in (self.master, self._slave):
            try:
                os.close(fd)
            except OSError:
                pass
        self.ser.close()


def dut_vid_pid(device_list: str) -> tuple[int, int]:
    """VID and first PID of the `type: dut` entry of a runner device list."""
    import yaml
    with open(device_list) as f:
        for dev in yaml.safe_load(f) or []:
            if isinstance(dev, dict) and dev.get("type") == "dut" and dev.get("usb"):
                vid, pids = next(iter(dev["usb"].items()))
                return int(vid), int(pids[0] if isinstance(pids, list) else pids)
    raise SystemExit(f"mlcommons_shim: {device_list} has no 'type: dut' entry with a usb VID:PID")


def present_as_usb(path: str, vid: int, pid: int) -> None:
    """Makes serial.tools.list_ports.comports() also list `path` as a USB port VID:PID (only the
    latest `path`: a second call replaces the first)."""
    from serial.tools import list_ports, list_ports_common
    info = list_ports_common.ListPortInfo(path, skip_link_detection=True)
    info.vid, info.pid = vid, pid
    info.description = f"tinydeploy board on {path} (mlcommons_shim)"
    info.serial_number = "tinydeploy-shim"
    real = getattr(list_ports.comports, "shim_real", list_ports.comports)   # replaces an earlier call's pty

    def comports(include_links=False):
        return [p for p in real(include_links) if p.device != path] + [info]
    comports.shim_real = real
    list_ports.comports = comports
    try:
        import usb.core
        try:
            usb.core.find(find_all=True)
        except Exception:                        # no libusb backend: no USB-only devices
            usb.core.find = lambda *a, **k: iter(()) if k.get("find_all") else None
    except ImportError:
        pass


def _option(argv: list[str], names: tuple[str, ...]) -> int | None:
    for i, a in enumerate(argv):
        if a in names and i + 1 < len(argv):
            return i + 1
        for n in names:
            if n.startswith("--") and a.startswith(n + "="):
                return i
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serial", required=True, help="the board's serial port: a device or pyserial URL")
    ap.add_argument("--runner", required=True, help="the runner's folder (benchmark/runner of mlcommons/tiny)")
    ap.add_argument("--baud", type=int, default=115200, help="rate towards the board (ignored by sockets)")
    ap.add_argument("--realtime", action="store_true", help="pace infer replies to the board's own timestamps")
    ap.add_argument("--workdir", default=".", help="where the runner writes sessions/ (default: here)")
    ap.add_argument("runner_args", nargs=argparse.REMAINDER, help="-- then main.py's own arguments")
    args = ap.parse_args(argv)
    rargs = args.runner_args[1:] if args.runner_args[:1] == ["--"] else args.runner_args
    runner = os.path.abspath(os.path.expanduser(args.runner))
    if not os.path.isfile(os.path.join(runner, "main.py")):
        print(f"mlcommons_shim: no main.py in {runner}", file=sys.stderr)
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    os.chdir(args.workdir)
    for names, default in ((("-d", "--device_list"), "devices.yaml"), (("-t", "--test_script"), None)):
        i = _option(rargs, names)
        value = rargs[i].split("=", 1)[1] if i is not None and rargs[i].startswith("--") else (rargs[i] if i is not None else default)
        if value and not os.path.exists(value) and os.path.exists(os.path.join(runner, value)):
            full = os.path.join(runner, value)
            if i is None:
                rargs += [names[1], full]
            elif rargs[i].startswith("--"):
                rargs[i] = f"{names[1]}={full}"
            else:
                rargs[i] = full
    i = _option(rargs, ("-d", "--device_list"))
    dl = rargs[i].split("=", 1)[1] if rargs[i].startswith("--") else rargs[i]
    bridge = PtyBridge(args.serial, args.baud, args.realtime)
    present_as_usb(bridge.path, *dut_vid_pid(dl))
    sys.path.insert(0, runner)
    sys.argv = [os.path.join(runner, "main.py")] + rargs
    out = sys.__stdout__
    code = 0
    try:
        runpy.run_path(os.path.join(runner, "main.py"), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        bridge.close()
        if args.realtime:
            print(f"mlcommons_shim: --realtime held infer replies for {bridge.paced_s:.1f} s of host time",
                  file=out, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
