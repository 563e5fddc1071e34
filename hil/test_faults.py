"""Faults: garbage bytes, oversized and truncated commands and loads, a bad CRC, a hang, QEMU
killed mid-run, the port going away. Each must end with a clear error (the host's
TinydeployError or the board's e-[...] line), and the next test must start from a known state:
every test here finishes by checking the board serves again, using the board's reset strategy
where the fault leaves it in an unknown state."""
from __future__ import annotations

import re
import time
import zlib

import numpy as np
import pytest

from tinydeploy.errors import TinydeployError


def errors(lines):
    return [ln for ln in lines if ln.startswith("e-[")]


def serving(d):
    assert d.device.name() == f"tinydeploy {d.entry.manifest}"


def test_garbage_bytes(cdut):
    d = cdut.device
    junk = bytes(np.random.default_rng(99).integers(0, 256, 2000, dtype=np.uint8))
    d.write(junk, note="(2000 random bytes)")
    d.write(b"%")
    d.drain(quiet=1.0, limit=30)
    d.resync()
    # on a loaded machine, and through a lab host's extra hop, the board may still be reading the
    # junk after a second of quiet: each '%' in it ends a "command longer than 80 characters"
    for _ in range(5):
        if not errors(d.command("name", check=False)):
            break
        d.drain(quiet=1.0, limit=30)
    serving(cdut)


def test_non_printable_bytes_in_a_command(cdut):
    lines = cdut.device.command("na\x01me", check=False)
    assert errors(lines) == ["e-[command has bytes that are not printable ASCII]"]
    serving(cdut)


def test_oversized_command(cdut):
    d = cdut.device
    d.write(b"name " + b"y" * 300 + b"%")
    _, lines = d.expect(r"^m-ready$")
    assert errors(lines) == ["e-[command longer than 80 characters]"]
    with pytest.raises(TinydeployError, match="longer than the device's 80 characters"):
        d.command("z" * 81)
    serving(cdut)


def test_truncated_command_times_out_clearly_then_resyncs(cdut):
    d = cdut.device
    d.write(b"name")                                     # no '%': the board waits for the rest
    with pytest.raises(TinydeployError, match=r"board stopped answering: no .* within 1 s on .*last exchange: .*name"):
        d.expect(r"^m-name-dut-", timeout=1.0)
    d.resync()                                           # '%' ends it: the board answers "name"
    serving(cdut)


def test_oversized_loads_are_refused(cdut):
    d = cdut.device
    n = cdut.app.input_bytes
    with pytest.raises(TinydeployError, match=rf"the board refused 'bload {n + 1} [0-9a-f]+'.*N must be 1\.\.{n}"):
        d.load(bytes(n + 1))
    assert errors(d.command(f"db load {n + 1}", check=False)) == [f"e-[db load: N must be 1..{n} (the input buffer size)]"]
    d.command("db load 4")
    assert errors(d.command("db 0011223344", check=False)) == ["e-[db: more bytes than db load announced]"]
    serving(cdut)


def test_truncated_hex_load_blocks_inference(cdut):
    d = cdut.device
    d.command("db load 8")
    d.command("db 0011")
    assert errors(d.command("infer 1 0", check=False)) == ["e-[db load is not complete]"]
    d.load(cdut.app.inputs(0)[1])                        # a bulk load replaces the unfinished one
    d.infer(1, 0)
    serving(cdut)


def test_truncated_bulk_load_times_out_on_the_board(cdut):
    d = cdut.device
    _, data = cdut.app.inputs(1)
    d.write(f"bload {len(data)} {zlib.crc32(data):08x}%".encode())
    d.expect(rf"^m-bload-ready-{len(data)}$")
    d.write(data[:len(data) // 2])
    _, lines = d.expect(r"^m-ready$", timeout=max(d.timeout, 60))
    assert errors(lines) == [f"e-[timeout: bulk load got {len(data) // 2} of {len(data)} bytes]"]
    with pytest.raises(TinydeployError, match="the board refused 'bload.*timeout: bulk load got"):
        d.raise_errors(f"bload {len(data)}", lines)
    serving(cdut)


def test_bad_crc(cdut):
    d = cdut.device
    _, data = cdut.app.inputs(2)
    d.write(f"bload {len(data)} {zlib.crc32(data) ^ 0x10:08x}%".encode())
    d.expect(rf"^m-bload-ready-{len(data)}$")
    d.write(data)
    _, lines = d.expect(r"^m-ready$", timeout=max(d.timeout, len(data) / 2000))
    assert errors(lines) == [f"e-[crc mismatch: received data has crc {zlib.crc32(data):08x}]"]
    d.load(data)                                         # the same bytes with the right CRC
    serving(cdut)


def test_host_timeout_during_a_long_run_then_reset(cdut):
    """The host gives up while the board is busy (what a hang looks like from the host): a clear
    error with the last exchange, then the reset strategy brings back an idle board."""
    d = cdut.device
    d.load(cdut.app.inputs(0)[1])
    runs = 500 if cdut.kind == "qemu" else 20        # a real board is waited for by the reopen's resync
    with pytest.raises(TinydeployError, match=rf"board stopped answering: no complete reply to 'infer {runs} 0%' within 0.5 s"):
        d.command(f"infer {runs} 0", timeout=0.5)
    cdut.reset("the board is still busy with infer 500")
    serving(cdut)


def test_qemu_killed_mid_run(cdut):
    if cdut.kind != "qemu":
        pytest.skip("QEMU only (the hardware counterpart is test_port_disappears)")
    d = cdut.device
    d.load(cdut.app.inputs(0)[1])
    d.write(b"infer 500 0%")
    d.expect(r"^m-infer-start-500$")
    cdut.transport.kill()
    t = time.monotonic()
    with pytest.raises(TinydeployError) as e:
        d.expect(r"^m-infer-done$", timeout=10)
        d.command("name", timeout=5)
    assert re.search(r"board stopped answering|reading from .* failed|writing to .* failed", str(e.value)), str(e.value)
    assert time.monotonic() - t < 30
    assert not cdut.transport.alive()
    cdut.ready()                      # the transport is gone: the rig restarts QEMU
    assert cdut.resets >= 1
    serving(cdut)


def test_port_disappears(cdut):
    """The port goes away under the host (a USB cable pulled, QEMU's socket closed): the next
    command fails with a clear error naming the port; the rig's reset reopens it."""
    d = cdut.device
    d.ser.close()
    with pytest.raises(TinydeployError, match=r"(writing to|reading from) .* failed"):
        d.command("name", timeout=5)
    assert not cdut.transport.alive()
    cdut.ready()
    serving(cdut)


def test_the_board_is_in_a_known_state_after_the_faults(cdut):
    """Runs after the fault tests: a full inference works and matches onnxruntime."""
    r = cdut.run(0)
    assert r["compare"]["outputs_match"], r["compare"]


def test_serial_transport_and_reopen_reset_against_the_real_firmware(cdut):
    """The hardware code path (SerialTransport, reset by reopening the port) against the real
    firmware: QEMU's serial port stands in for a board's USB serial port."""
    from hil import rig
    if not isinstance(cdut.transport, rig.QemuTransport):
        pytest.skip("runs the serial transport against the rig's own QEMU; on hardware and through labgrid "
                    "places every test already goes through a serial port")
    url = cdut.transport.emu.url
    cdut.device.close()                    # QEMU serves one connection at a time
    cdut.dirty = True                      # the next test gets a freshly started emulator
    # built directly: the inventory refuses transport serial for a QEMU machine's manifest
    entry = rig.BoardEntry(id="sim", manifest=cdut.entry.manifest, transport="serial", reset="reopen", port=url,
                           timeout_s=30, boot_timeout_s=30, reappear_timeout_s=5)
    d = rig.Dut(app=cdut.app, transport=rig.SerialTransport(entry))
    try:
        d.start()
        d.device.write(b"na")              # half a command: the board waits for the rest
        d.ready()                          # the ping's reply is an error -> reopen + resync
        log = d.full_log()
        assert d.resets == 1 and "# reset (reopen)" in log, log
        r = d.run(0)
        assert r["compare"]["outputs_match"], r["compare"]
    finally:
        d.close()
