"""The rig's own logic, without a board or QEMU (marked `host`: `pytest hil -m host`): inventory
parsing and validation, port selection by USB serial number, budgets, timeouts and the device
log over pyserial's loop:// and a fake board on socket://, the reset strategy, and the HTML and
JUnit reports."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from hil import rig
from hil.report import collect_report, render_html, write_html
from tinydeploy.errors import TinydeployError
from tinydeploy.runners.protocol import Device

pytestmark = pytest.mark.host


# ---- inventory ------------------------------------------------------------------------------

def test_the_shipped_inventory_is_valid():
    inv = rig.load_inventory(rig.HIL_DIR / "boards.yml")
    assert inv["mps2-an386"].transport == "qemu" and inv["mps2-an386"].reset == "restart"
    nano = inv["nano33ble-qemu"]
    assert nano.manifest == "nano33ble" and nano.emulated and nano.board.ram_bytes == 262_144
    real = inv["nano33ble"]
    assert real.transport == "serial" and real.reset in ("reopen", "touch1200") and real.baud == 115200
    assert "{port}" in real.flash


@pytest.mark.parametrize("text, error", [
    ("boards: [", r"not valid YAML at line 1"),
    ("- a\n- b\n", r"expected a mapping with a non-empty 'boards:'"),
    ("boards: {}\n", r"non-empty 'boards:'"),
    ("boards: {x: {}}\nextra: 1\n", r"unknown top-level key\(s\) extra"),
    ("boards: {Bad Name: {}}\n", r"board id 'Bad Name' must be lower-case"),
    ("boards: {mps2-an386: 3}\n", r"board 'mps2-an386': expected a mapping of settings, got int"),
    ("boards: {mps2-an386: {prot: x}}\n", r"board 'mps2-an386': unknown key\(s\) prot; known: "),
    ("boards: {b1: {manifest: nope}}\n", r"board 'b1': no board manifest boards/nope.json"),
    ("boards: {b1: {manifest: host}}\n", r"board 'b1': boards/host.json is not a microcontroller"),
    ("boards: {mps2-an386: {transport: usb}}\n", r"transport must be one of qemu, serial, not 'usb'"),
    ("boards: {mps2-an386: {transport: serial}}\n", r"is a QEMU machine; use transport: qemu"),
    ("boards: {mps2-an386: {reset: reopen}}\n", r"reset 'reopen' is not possible with transport qemu \(choose restart\)"),
    ("boards: {nano33ble: {reset: restart}}\n", r"reset 'restart' is not possible with transport serial"),
    ("boards: {nano33ble: {reset: touch1200}}\n", r"touch1200 leaves the board in its bootloader; it needs a flash: command"),
    ("boards: {nano33ble: {serial_number: 1234}}\n", r"serial_number must be a string \(quote numbers"),
    ("boards: {nano33ble: {serial_number: 'A', port: /dev/ttyACM0}}\n", r"give serial_number or port, not both"),
    ("boards: {mps2-an386: {port: /dev/ttyACM0}}\n", r"serial_number/port make no sense with transport qemu"),
    ("boards: {nano33ble: {baud: -5}}\n", r"baud must be a positive integer, not -5"),
    ("boards: {nano33ble: {baud: fast}}\n", r"baud must be a positive integer, not 'fast'"),
    ("boards: {nano33ble: {timeout_s: 0}}\n", r"timeout_s must be a positive number of seconds, not 0"),
    ("boards: {nano33ble: {flash: 'bossac {firmware}'}}\n", r"flash command has an unknown placeholder 'firmware'"),
    ("boards: {nano33ble: {flash_port: /dev/ttyACM1}}\n", r"flash_serial_number/flash_port without a flash: command"),
])
def test_bad_inventories_are_refused_clearly(text, error, tmp_path):
    p = tmp_path / "boards.yml"
    p.write_text(text)
    with pytest.raises(rig.RigError, match=error) as e:
        rig.load_inventory(p)
    assert str(p) in str(e.value)


def test_missing_inventory_file():
    with pytest.raises(rig.RigError, match=r"cannot read the inventory /nonexistent/boards.yml: No such file"):
        rig.load_inventory("/nonexistent/boards.yml")


def test_board_selection():
    inv = rig.parse_inventory("boards: {mps2-an386: {}, nano33ble-qemu: {manifest: nano33ble, transport: qemu}}")
    assert [e.id for e in rig.select_boards(inv, ["all"])] == ["mps2-an386", "nano33ble-qemu"]
    assert [e.id for e in rig.select_boards(inv, ["nano33ble-qemu", "nano33ble-qemu"])] == ["nano33ble-qemu"]
    with pytest.raises(rig.RigError, match=r"--board 'nope' is not in inv.yml \(boards there: mps2-an386, nano33ble-qemu\)"):
        rig.select_boards(inv, ["nope"], "inv.yml")
    # defaults: the transport follows the manifest's runner, the reset follows the transport
    inv = rig.parse_inventory("boards: {nano33ble: {}, mps2-an386: {}}")
    assert (inv["nano33ble"].transport, inv["nano33ble"].reset, inv["nano33ble"].baud) == ("serial", "reopen", 115200)
    assert (inv["mps2-an386"].transport, inv["mps2-an386"].reset) == ("qemu", "restart")


# ---- ports by USB serial number ---------------------------------------------------------------

def port(device, serial_number, description="n/a"):
    return SimpleNamespace(device=device, serial_number=serial_number, description=description)


def test_port_is_found_by_serial_number_whatever_the_order():
    a, b = port("/dev/ttyACM0", "AAAA1111", "Nano 33 BLE"), port("/dev/ttyACM1", "BBBB2222", "CP2102")
    assert rig.find_port("bbbb2222", lambda: [a, b]) == "/dev/ttyACM1"
    # replugged: the kernel numbered them the other way round
    a2, b2 = port("/dev/ttyACM1", "AAAA1111"), port("/dev/ttyACM0", "BBBB2222")
    assert rig.find_port("BBBB2222", lambda: [a2, b2]) == "/dev/ttyACM0"


def test_port_selection_errors_list_what_is_plugged_in():
    ports = [port("/dev/ttyACM0", "AAAA1111", "Nano 33 BLE"), port("/dev/ttyUSB0", None, "CP2102")]
    with pytest.raises(rig.RigError, match=r"no serial port with USB serial number 'CCCC' is plugged in; seen: "
                                           r"/dev/ttyACM0 \(serial number AAAA1111, Nano 33 BLE\), /dev/ttyUSB0 \(serial number none"):
        rig.find_port("CCCC", lambda: ports)
    with pytest.raises(rig.RigError, match="no serial ports at all"):
        rig.find_port("CCCC", lambda: [])
    with pytest.raises(rig.RigError, match=r"2 serial ports have USB serial number 'DUP': /dev/ttyACM0, /dev/ttyACM1; pass --port"):
        rig.find_port("DUP", lambda: [port("/dev/ttyACM0", "DUP"), port("/dev/ttyACM1", "DUP")])


def test_port_resolution_order():
    inv = rig.parse_inventory("boards: {nb: {manifest: nano33ble, serial_number: 'AB12'}, "
                              "nf: {manifest: nano33ble, port: 'socket://127.0.0.1:9'}, n0: {manifest: nano33ble}}")
    ports = lambda: [port("/dev/ttyACM3", "AB12")]  # noqa: E731
    assert rig.resolve_port(inv["nb"], "/dev/ttyS9", ports) == "/dev/ttyS9"        # --port wins
    assert rig.resolve_port(inv["nb"], None, ports) == "/dev/ttyACM3"
    assert rig.resolve_port(inv["nf"], None, ports) == "socket://127.0.0.1:9"
    with pytest.raises(rig.RigError, match="board 'n0' needs a serial port: pass --port PORT or set serial_number"):
        rig.resolve_port(inv["n0"], None, ports)


def test_serial_transport_waits_for_a_replugged_port():
    entry = rig.parse_inventory("boards: {nb: {manifest: nano33ble, serial_number: 'AB12', reappear_timeout_s: 5}}")["nb"]
    calls = []

    def ports():
        calls.append(time.monotonic())
        return [] if len(calls) < 3 else [port("/dev/ttyACM7", "AB12")]
    assert rig.SerialTransport(entry, list_ports=ports)._port() == "/dev/ttyACM7"
    assert len(calls) == 3
    entry.reappear_timeout_s = 0.3
    with pytest.raises(rig.RigError, match="no serial port with USB serial number 'AB12'"):
        rig.SerialTransport(entry, list_ports=lambda: [])._port()


def test_flash_command_placeholders(tmp_path):
    entry = rig.parse_inventory("boards: {nb: {manifest: nano33ble, flash_serial_number: 'F1', "
                                "flash: 'bossac --port={port_name} -w {bin} -R'}}")["nb"]
    app = SimpleNamespace(fw=SimpleNamespace(outdir=tmp_path, elf=tmp_path / "build" / "firmware.elf"))
    port_ = rig.flash_port(entry, None, lambda: [port("/dev/ttyACM2", "F1")])
    assert rig.flash_command(entry, app, port_) == ["bossac", "--port=ttyACM2", "-w",
                                                    str(tmp_path / "build" / "firmware.bin"), "-R"]
    entry.flash = f"{sys.executable} -c 'import sys; sys.exit(3)'"
    with pytest.raises(rig.RigError, match="flashing nb failed \\(exit 3\\)"):
        rig.run_flash(entry, app, "/dev/null")


# ---- budgets --------------------------------------------------------------------------------

def test_budgets_check_with_the_margin():
    b = rig.parse_budgets("margin_percent: {instructions: 5, us: 10, flash_bytes: 2, ram_bytes: 2}\n"
                          "boards: {b: {m: {instructions: 1000000, flash_bytes: 1000}}}\n")
    assert b.check("b", "m", {"instructions": 1_050_000, "flash_bytes": 1020}) == []
    over = b.check("b", "m", {"instructions": 1_050_001, "flash_bytes": 900})
    assert over == ["instructions: 1,050,001 is over the budget 1,000,000 + 5% = 1,050,000 (+5.0%)"]
    assert b.get("b", "other") is None and b.get("x", "m") is None


@pytest.mark.parametrize("text, error", [
    ("boards: {}", "expected 'margin_percent:'"),
    ("margin_percent: {instructions: 5}\nboards: {}", "margin_percent lacks flash_bytes, ram_bytes, us"),
    ("margin_percent: {instructions: -1, us: 1, flash_bytes: 1, ram_bytes: 1}", "margin_percent.instructions"),
    ("margin_percent: {instructions: 5, us: 10, flash_bytes: 2, ram_bytes: 2}\nboards: {b: {m: {cycles: 5}}}",
     "boards.b.m.cycles: want one of"),
    ("margin_percent: {instructions: 5, us: 10, flash_bytes: 2, ram_bytes: 2}\nboards: {b: {m: {us: 1.5}}}",
     "boards.b.m.us"),
])
def test_bad_budgets_are_refused(text, error):
    with pytest.raises(rig.RigError, match=error):
        rig.parse_budgets(text, "budgets.yml")


def test_update_budgets_keeps_the_header_margins_and_other_entries(tmp_path):
    p = tmp_path / "budgets.yml"
    p.write_text("# my header\n# second line\n\nmargin_percent: {instructions: 3, us: 10, flash_bytes: 2, ram_bytes: 2}\n"
                 "boards:\n  b: {old: {instructions: 5}, m: {instructions: 7, ram_bytes: 9}}\n")
    rig.update_budgets(p, {"b": {"m": {"instructions": 1234.4, "flash_bytes": 99, "ram_bytes": 10}},
                           "c": {"n": {"us": 17}}})
    text = p.read_text()
    assert text.startswith("# my header\n# second line\n\nmargin_percent: {instructions: 3, us: 10,")
    b = rig.parse_budgets(text)
    assert b.boards == {"b": {"old": {"instructions": 5}, "m": {"instructions": 1234, "flash_bytes": 99, "ram_bytes": 10}},
                        "c": {"n": {"us": 17}}}
    assert b.margin_percent["instructions"] == 3


def test_the_shipped_budgets_are_valid():
    b = rig.load_budgets(rig.HIL_DIR / "budgets.yml")
    assert b.margin_percent["instructions"] > 0
    for models in b.boards.values():
        for m in models:
            assert m in rig.DEFAULT_MODELS


# ---- the device layer without a board: loop:// --------------------------------------------------

def test_timeout_is_clear_and_the_log_keeps_every_line():
    dev = Device("loop://", timeout=0.3)
    dev.ser.write(b"m-hello\r\n")
    assert dev.readline() == "m-hello"
    t = time.monotonic()
    with pytest.raises(TinydeployError, match=r"board stopped answering: no complete reply to 'profile%' within 0.3 s "
                                              r"on loop://; partial line 'profile%'"):
        dev.command("profile")                 # loop:// echoes the command, which never ends in a newline
    assert time.monotonic() - t < 3
    assert dev.log[:2] == ["< m-hello", "> profile%"]


# ---- a fake board on socket:// -----------------------------------------------------------------

class FakeBoard:
    """A TCP server speaking a little of the protocol, one client at a time. hang=True: it reads
    but never answers until the next connection (what a reopen reset fixes)."""

    def __init__(self):
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.hang = False
        self.connections = 0
        self.stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.connections += 1
            self.hang = False
            with conn:
                buf = b""
                while True:
                    try:
                        data = conn.recv(1024)
                    except OSError:
                        break
                    if not data:
                        break
                    buf += data
                    while b"%" in buf:
                        cmd, buf = buf.split(b"%", 1)
                        cmd = cmd.strip().decode("latin-1")
                        if self.hang:
                            continue
                        if cmd == "hang":
                            self.hang = True
                            continue
                        reply = {"name": "m-name-dut-[fake board]\r\n", "": ""}.get(cmd, f"e-[unknown command: {cmd}]\r\n")
                        conn.sendall(reply.encode() + b"m-ready\r\n")

    def close(self):
        self.stop = True
        self.srv.close()


@pytest.fixture
def fake():
    f = FakeBoard()
    yield f
    f.close()


def test_serial_transport_reopen_reset_recovers_a_hung_board(fake):
    entry = rig.parse_inventory(f"boards: {{fb: {{manifest: nano33ble, port: 'socket://127.0.0.1:{fake.port}', "
                                "timeout_s: 1, boot_timeout_s: 5}}")["fb"]
    d = rig.Dut(app=SimpleNamespace(entry=entry, model="fake"), transport=rig.SerialTransport(entry))
    d.start()
    assert d.device.name() == "fake board" and fake.connections == 1
    d.begin_test()
    d.device.write(b"hang%")
    with pytest.raises(TinydeployError, match=r"board stopped answering: no complete reply to 'name%' within 1 s on "
                                              rf"socket://127.0.0.1:{fake.port}; last exchange: .*> hang% \| > name%$"):
        d.device.name()
    d.ready()                              # the ping fails -> reset (reopen) -> the board answers again
    assert d.resets == 1 and fake.connections == 2
    assert d.device.name() == "fake board"
    log = d.full_log()
    assert "> hang%" in log and "# reset (reopen): no answer to name%" in log and "< m-name-dut-[fake board]" in log
    # a dirty board is reset before the next test even when it still answers
    d.dirty = True
    d.ready()
    assert d.resets == 2 and fake.connections == 3
    # the port goes away: a clear error, then the reset reopens it
    d.device.ser.close()
    with pytest.raises(TinydeployError, match=rf"writing to socket://127.0.0.1:{fake.port} failed"):
        d.device.name()
    assert not d.transport.alive()
    d.ready()
    assert d.device.name() == "fake board"
    d.close()


def test_serial_transport_gives_a_clear_error_when_nothing_answers():
    with socket.create_server(("127.0.0.1", 0)) as s:
        free = s.getsockname()[1]          # nobody listens there once closed
    entry = rig.parse_inventory(f"boards: {{fb: {{manifest: nano33ble, port: 'socket://127.0.0.1:{free}', "
                                "reappear_timeout_s: 0.5}}")["fb"]
    with pytest.raises(TinydeployError, match=rf"cannot open serial port 'socket://127.0.0.1:{free}'"):
        rig.SerialTransport(entry).open()


# ---- reports ----------------------------------------------------------------------------------

def records():
    props = [("hil_board", "mps2-an386"), ("hil_transport", "qemu")]
    return [
        {"nodeid": "hil/test_models.py::t[kws]", "when": "setup", "outcome": "passed", "duration": 1.0,
         "props": props + [("hil_model", "kws")], "message": ""},
        {"nodeid": "hil/test_models.py::t[kws]", "when": "call", "outcome": "passed", "duration": 2.0,
         "props": props + [("hil_model", "kws"), ("hil", '{"max_lsb": 0.0, "latency": 26584995, '
                                                          '"latency_unit": "instructions"}'),
                           ("hil", '{"flash_used_bytes": 44352, "ram_used_bytes": 33056}')], "message": ""},
        {"nodeid": "hil/test_models.py::t[ic]", "when": "call", "outcome": "failed", "duration": 3.0,
         "props": props + [("hil_model", "ic"), ("hil", '{"max_lsb": 3.0}'),
                           ("hil_device_log", "> infer 1 0%\n< m-<script>alert(1)</script>")],
         "message": "AssertionError: outputs differ"},
        {"nodeid": "hil/test_budgets.py::b[vww]", "when": "setup", "outcome": "skipped", "duration": 0.0,
         "props": props + [("hil_model", "vww")], "message": "no budget for vww"},
        {"nodeid": "hil/test_rig_logic.py::x", "when": "call", "outcome": "passed", "duration": 0.1, "props": [],
         "message": ""},
    ]


def test_report_collects_one_entry_per_test():
    tests = {t["nodeid"]: t for t in collect_report(records())}
    kws = tests["hil/test_models.py::t[kws]"]
    assert kws["outcome"] == "passed" and kws["duration"] == 3.0 and kws["board"] == "mps2-an386"
    assert kws["figures"] == {"max_lsb": 0.0, "latency": 26584995, "latency_unit": "instructions",
                              "flash_used_bytes": 44352, "ram_used_bytes": 33056}
    assert tests["hil/test_models.py::t[ic]"]["outcome"] == "failed"
    assert tests["hil/test_models.py::t[ic]"]["log"].startswith("> infer")
    assert tests["hil/test_budgets.py::b[vww]"]["outcome"] == "skipped"


def test_html_report_is_self_contained_and_shows_the_figures(tmp_path):
    meta = {"boards": {"mps2-an386": {"manifest": "mps2-an386", "transport": "qemu", "name": "MPS2",
                                      "flash_bytes": 4194304, "ram_bytes": 4194304}},
            "not_fitting": {"mps2-an386": {"big_model": "does not fit: needs 5 MB"}},
            "duration_s": 12.0, "command": "hil --board mps2-an386"}
    path = write_html(tmp_path / "sub" / "r.html", collect_report(records()), meta)
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "FAILED" in page
    assert "<script" not in page and "src=" not in page and "href=" not in page       # self-contained, escaped
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "26,584,995 instructions" in page and "0 LSB" in page and "3 LSB" in page
    assert "44,352 / 4,194,304 B (1.1%)" in page and "33,056 / 4,194,304 B" in page
    assert "1 passed, 0 failed, 0 skipped" in page and "0 passed, 1 failed, 0 skipped" in page   # kws, ic
    assert "AssertionError: outputs differ" in page and "big_model" in page
    assert not list((tmp_path / "sub").glob("*.tmp"))
    # hardware latency in microseconds
    rec = records()[:2]
    rec[1] = dict(rec[1], props=[("hil_board", "nano33ble"), ("hil_model", "kws"),
                                 ("hil", '{"latency": 12345.6, "latency_unit": "us"}')])
    assert "12,346 µs" in render_html(collect_report(rec), {"boards": {}})


def test_junit_xml_and_html_report_from_a_real_pytest_run(tmp_path):
    """pytest --junitxml works as is next to the rig's plugin; the rig's HTML report carries the
    figures and the device log of the failing test."""
    (tmp_path / "test_fake.py").write_text(textwrap.dedent("""
        def test_good(record):
            record(max_lsb=0, latency=1234, latency_unit="instructions")

        def test_bad(record, hil_log):
            hil_log(lambda: "> infer 1 0%\\n< m-infer-start-1")
            assert 1 == 2, "outputs differ"
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(rig.REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "hil.plugin", "-p", "no:cacheprovider",
                        "-p", "no:xdist", "--junitxml", "junit.xml", "--report-html", "out/r.html", "test_fake.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "device log (call)" in r.stdout and "m-infer-start-1" in r.stdout
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert suite.get("tests") == "2" and suite.get("failures") == "1"
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["test_bad"].find("failure") is not None
    props = {p.get("name"): p.get("value") for p in cases["test_bad"].iter("property")}
    assert "m-infer-start-1" in props["hil_device_log"]
    page = (tmp_path / "out" / "r.html").read_text()
    assert "m-infer-start-1" in page and "outputs differ" in page and "test_fake.py::test_good" in page
