"""Microcontroller firmware through its serial protocol (tinydeploy.runners.protocol): one
inference exchange (load the inputs, infer, read the raw outputs back), the serial port of an
already flashed board, and the two runners over them: QemuSystemRunner (the firmware under
qemu-system-arm, started for each run) and SerialRunner (a board on a pyserial URL).

Both take a built firmware (tinydeploy.firmware.Firmware: .elf, .machine, .memory) and report
per run, in `last`: the protocol's counts, the instructions per inference (exact under QEMU) and
the stack high-water mark."""
from __future__ import annotations

import time
from fractions import Fraction

from tinydeploy.errors import TinydeployError
from tinydeploy.runners.base import Runner
from tinydeploy.runners.harness import pack_inputs, unpack_outputs

INFER_TIMEOUT_S = 600.0


def infer(dev, data: bytes, out_specs, runs: int = 1, warmup: int = 0, timeout: float | None = None,
          stack: bool = True, source: str = "the firmware") -> dict:
    """Loads `data` into a device that speaks the protocol (QEMU or a real board), runs `infer
    runs warmup%` and reads the outputs back: {"outputs", "raw", "counts"} (protocol.Counts) and,
    with `stack`, "stack_used_bytes" (its high-water mark). `timeout`: seconds for the inference's
    reply (default: the device's, which bounds every other wait)."""
    dev.load(data)
    dev.infer(runs, warmup, timeout=timeout)
    raw = dev.outputs()
    out = {"outputs": unpack_outputs(raw, out_specs, source), "raw": raw, "counts": dev.last_counts}
    if stack:
        out["stack_used_bytes"] = dev.stack()[0]
    return out


def input_data(memory: dict, inputs) -> bytes:
    """The firmware's input buffer: the inputs back to back, checked against its size."""
    data = pack_inputs(inputs)
    if len(data) != memory["input_buffer_bytes"]:
        raise TinydeployError(f"the inputs hold {len(data):,} bytes but the model takes {memory['input_buffer_bytes']:,}")
    return data


def open_serial(port: str, baudrate: int = 115200, timeout: float = 60.0, boot_timeout: float = 60.0,
                reappear_s: float = 0.0, resync: bool = False):
    """A protocol Device on an already flashed board's serial port (any pyserial URL), booted.
    A device path that is not there yet is retried for `reappear_s` seconds (a board being
    replugged); `resync` first ends whatever half-sent command the board holds."""
    from tinydeploy.runners.protocol import Device
    deadline = time.monotonic() + reappear_s
    while True:
        try:
            dev = Device(port, timeout=timeout, baudrate=baudrate)
            break
        except TinydeployError:
            if time.monotonic() > deadline or "://" in port:
                raise
            time.sleep(0.2)
    try:
        if resync:
            dev.drain(quiet=0.2, limit=2.0)
            dev.resync(timeout=boot_timeout)
        dev.wait_boot(timeout=boot_timeout)
    except BaseException:
        dev.close()
        raise
    return dev


def capture_exchange(dev, data: bytes, out_specs, send: bool, where: str, emulated: bool, timeout: float):
    """Loads `data` into a device running a capture build and runs `capture T%`: every layer's
    outputs (with `send`) and work count, and the model's outputs (rawout%): a Capture."""
    from tinydeploy.runners.capture import Capture, from_device
    dev.load(data)
    try:
        got = dev.capture(send, timeout=timeout)
    except TinydeployError as e:
        if "unknown command: capture" in str(e):
            raise TinydeployError("the firmware has no capture extension: it is not the capture build of "
                                  "`tinydeploy validate` (flash the folder validate built, e.g. `tinydeploy flash "
                                  "DIR --board B`, then run validate again)") from None
        raise
    cap = Capture(unpack_outputs(dev.outputs(), out_specs, "the firmware"), from_device(got, "the firmware"),
                  where, emulated)
    cap.costs = {k: float(v) for k, v in got["counts"].items()}
    cap.cost_unit = got["unit"]
    return cap


def instructions_per_tick(machine, tick_hz: int) -> Fraction:
    """Under -icount shift=N one instruction takes 2^N ns of virtual time."""
    shift = int(machine.qemu.get("icount_shift", 0))
    return Fraction(10 ** 9, tick_hz * 2 ** shift)


def _booted(fw, work, timeout: float):
    """Boots a built firmware under QEMU, hands the booted protocol Device to work(dev), ends the
    firmware (quit%) and checks its exit code: (what work returned, the device)."""
    from tinydeploy.runners.qemu_system import Emulator
    with Emulator(fw.elf, fw.machine) as emu:
        try:
            dev = emu.boot(timeout=timeout, boot_timeout=60)
            result = work(dev)
            dev.quit()
        except TinydeployError as e:
            raise emu.explain(e) from None
        code = emu.wait(10)
        if code not in (0, None):
            raise TinydeployError(f"the firmware ended with exit code {code}")
    return result, dev


def run_under_qemu(fw, inputs, out_specs, runs: int = 1, warmup: int = 0,
                   timeout: float = INFER_TIMEOUT_S) -> tuple[list, int, dict]:
    """Runs a built firmware under QEMU on `inputs`: (outputs, instructions per inference,
    details: ticks_per_inference, tick_hz, runs, stack_used_bytes, counts, log)."""
    data = input_data(fw.memory, inputs)
    got, dev = _booted(fw, lambda dev: infer(dev, data, out_specs, runs, warmup, timeout), timeout)
    counts = got["counts"]
    if counts.instructions is not None:
        if counts.count_min != counts.count_max:
            raise TinydeployError(f"instruction counts differ between runs ({counts.count_min} to {counts.count_max}); "
                                  "is QEMU running with -icount shift=0?")
        instructions = counts.instructions
    else:
        instructions = int(round(counts.ticks_total / counts.runs * instructions_per_tick(fw.machine, counts.tick_hz)))
    details = {"ticks_per_inference": counts.ticks_per_run, "tick_hz": counts.tick_hz, "runs": counts.runs,
               "stack_used_bytes": got["stack_used_bytes"], "counts": counts, "log": dev.log}
    return got["outputs"], instructions, details


def run_models_under_qemu(fw, jobs, timeout: float = INFER_TIMEOUT_S) -> dict:
    """Firmware holding several models (built by flow.build_library) under QEMU, booted once:
    for each job (name, inputs, out_specs) `model NAME%`, then load, infer and read back as
    run_under_qemu. Returns {name: (outputs, instructions per inference)}."""
    from tinydeploy.runners.harness import pack_inputs

    def each(dev):
        out = {}
        for name, inputs, out_specs in jobs:
            dev.select_model(name)
            got = infer(dev, pack_inputs(inputs), out_specs, 1, 0, timeout, stack=False)
            out[name] = (got["outputs"], got["counts"].instructions)
        return out
    return _booted(fw, each, timeout)[0]


class QemuSystemRunner(Runner):
    """Firmware under QEMU, started for each run. median_ms = instructions per inference / the
    board's clock (None without one): a lower bound on the real board."""
    emulated = True

    def __init__(self, timeout: float = INFER_TIMEOUT_S):
        super().__init__()
        self.timeout = timeout
        self.where = "under QEMU"

    def run(self, fw, feeds, out_specs, runs: int = 0):
        outs, instructions, details = run_under_qemu(fw, feeds, out_specs, max(1, runs), timeout=self.timeout)
        self.last = dict(details, instructions=instructions)
        clock = fw.board.clock_hz
        return outs, instructions / clock * 1000.0 if clock else None


    def capture(self, fw, feeds, out_specs, profile_runs: int = 0, send: bool = True):
        from tinydeploy.runners.qemu_system import Emulator
        with Emulator(fw.elf, fw.machine) as emu:
            try:
                dev = emu.boot(timeout=self.timeout, boot_timeout=60)
                cap = capture_exchange(dev, input_data(fw.memory, feeds), out_specs, send, self.where, True,
                                       self.timeout)
                dev.quit()
            except TinydeployError as e:
                raise emu.explain(e) from None
        return cap


class SerialRunner(Runner):
    """Firmware already flashed on a board, over its serial port (a pyserial URL: /dev/ttyACM0, or
    socket://127.0.0.1:N for QEMU's). median_ms by the board's own timer."""

    def __init__(self, port: str, baudrate: int = 115200, timeout: float = 60.0):
        super().__init__()
        self.port, self.baudrate, self.timeout = port, baudrate, timeout
        self.where = f"on {port}"

    def run(self, fw, feeds, out_specs, runs: int = 0):
        data = input_data(fw.memory, feeds)
        with open_serial(self.port, self.baudrate, self.timeout, boot_timeout=self.timeout) as dev:
            got = infer(dev, data, out_specs, runs=max(1, runs), timeout=self.timeout)
        counts = got["counts"]
        self.last = {"counts": counts, "instructions": counts.instructions, "runs": counts.runs,
                     "stack_used_bytes": got["stack_used_bytes"], "log": dev.log}
        return got["outputs"], counts.ms_per_run

    def capture(self, fw, feeds, out_specs, profile_runs: int = 0, send: bool = True):
        with open_serial(self.port, self.baudrate, self.timeout, boot_timeout=self.timeout) as dev:
            return capture_exchange(dev, input_data(fw.memory, feeds), out_specs, send, self.where, False,
                                    self.timeout)
