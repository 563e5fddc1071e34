"""Every command of the MLPerf Tiny (EEMBC EnergyRunner performance mode) protocol and of
tinydeploy's extensions, on each board, with its conformance firmware (KWS when it fits).
The replies are checked line by line as the runner parses them."""
from __future__ import annotations

import re
import zlib

import numpy as np
import pytest

PROFILE = "ULPMark for tinyML Firmware V0.0.1"


def errors(lines):
    return [ln for ln in lines if ln.startswith("e-[")]


def serving(d):
    assert d.device.name() == f"tinydeploy {d.entry.manifest}"


def test_name(cdut):
    lines = cdut.device.command("name")
    assert lines == [f"m-name-dut-[tinydeploy {cdut.entry.manifest}]"]


def test_profile(cdut):
    assert cdut.device.command("profile") == [f"m-profile-[{PROFILE}]", f"m-model-[{cdut.app.model_id}]"]


def test_timestamp_counts_up(cdut):
    a = cdut.device.timestamp_us()
    b = cdut.device.timestamp_us()
    assert b > a


def test_db_load_chunks_and_db_print(cdut):
    d = cdut.device
    _, data = cdut.app.inputs(3)
    n = len(data)
    assert d.command(f"db load {n}") == [f"m-[Expecting {n} bytes]"]
    for i in range(0, n, 31):
        lines = d.command("db " + data[i:i + 31].hex())
        assert lines == (["m-load-done"] if i + 31 >= n else [])
    dump = d.command("db print")
    assert all(re.fullmatch(r"m-buffer-[0-9a-f]{2,64}", ln) for ln in dump), dump[:3]
    stored = bytes.fromhex("".join(ln[len("m-buffer-"):] for ln in dump))
    if cdut.app.fw.harness["db_subtract_128"]:
        stored = bytes(b ^ 0x80 for b in stored)     # the board stored v - 128
    assert stored == data


def test_infer_reply_sequence_and_results(cdut):
    d = cdut.device
    _, data = cdut.app.inputs(4)
    d.load(data)
    lines = d.command("infer 2 1", timeout=max(cdut.entry.timeout_s, 300))
    assert lines[:3] == ["m-warmup-start-1", "m-warmup-done", "m-infer-start-2"]
    t0, t1 = (re.fullmatch(r"m-lap-us-(\d+)", ln) for ln in lines[3:5])
    assert t0 and t1 and int(t1[1]) >= int(t0[1]), lines[3:5]
    assert lines[5] == "m-infer-done"
    assert re.fullmatch(r"m-results-\[-?\d+(\.\d+)?(,-?\d+(\.\d+)?)*\]", lines[6]), lines[6]
    assert len(lines) == 7
    assert d.command("results") == [lines[6]]


def test_bulk_load_and_rawout(cdut):
    d = cdut.device
    feeds, data = cdut.app.inputs(5)
    cmd = f"bload {len(data)} {zlib.crc32(data):08x}"
    d.write(cmd.encode() + b"%")
    d.expect(rf"^m-bload-ready-{len(data)}$")
    d.write(data, note=f"({len(data)} raw bytes)")
    _, lines = d.expect(r"^m-ready$", timeout=max(d.timeout, len(data) / 2000))
    assert lines == ["m-load-done"]
    d.infer(1, 0)
    lines = d.command("rawout")
    n = int(re.fullmatch(r"m-rawout-bytes-(\d+)", lines[0])[1])
    assert n == sum(int(np.prod(s)) * dt.itemsize for s, dt in cdut.app.out_specs)
    assert all(re.fullmatch(r"m-raw-[0-9a-f]{2,64}", ln) for ln in lines[1:])
    got = cdut.app.split_outputs(bytes.fromhex("".join(ln[6:] for ln in lines[1:])))
    want = cdut.app.reference(feeds)
    from tinydeploy.reference import compare_outputs
    assert compare_outputs(got, want, 1e-4)["outputs_match"]


def test_ticks_counts_every_timed_run(cdut):
    d = cdut.device
    d.load(cdut.app.inputs(6)[1])
    d.infer(3, 1)
    lines = d.command("ticks")
    assert len(lines) == 2 and lines[0].startswith("m-ticks-total-") and lines[1].startswith("m-count-total-")
    c = d.counts()
    assert c.runs == 3 and c.tick_hz > 0 and c.ticks_min <= c.ticks_max and c.ticks_total >= 3 * c.ticks_min
    assert c.count_min <= c.count_max and c.count_total >= 3 * c.count_min > 0
    if cdut.kind == "qemu":
        assert c.count_unit == "instructions" and c.count_min == c.count_max and c.tick_hz == 25_000_000
    else:
        assert c.count_unit in ("cycles", "ticks", "instructions")


def test_stack_high_water_mark(cdut):
    cdut.device.load(cdut.app.inputs(0)[1])
    cdut.device.infer(1, 0)
    used, reserved = cdut.device.stack()
    assert 0 < used < reserved
    assert reserved == cdut.app.fw.memory["stack_reserved_bytes"]


def test_results_before_any_inference_is_an_error(cdut):
    if cdut.kind != "qemu":
        pytest.skip("needs a freshly booted board; the serial reset strategy (reopen) does not reboot it")
    d = cdut.reset("this test needs a freshly booted board")
    assert errors(d.command("results", check=False)) == ["e-[results: no inference has run yet]"]
    serving(cdut)


@pytest.mark.parametrize("cmd, err", [
    ("fly", "e-[unknown command: fly]"),
    ("name extra", "e-[unknown command: name]"),
    ("a b c d e", "e-[too many arguments: a]"),
    ("infer 0 0", "e-[usage: infer N W (1 <= N <= 1000000 timed runs after W <= 1000000 warm-up runs)]"),
    ("infer x", "e-[usage: infer N W (1 <= N <= 1000000 timed runs after W <= 1000000 warm-up runs)]"),
    ("infer 1 4294967295", "e-[usage: infer N W (1 <= N <= 1000000 timed runs after W <= 1000000 warm-up runs)]"),
    ("infer 1000001 0", "e-[usage: infer N W (1 <= N <= 1000000 timed runs after W <= 1000000 warm-up runs)]"),
    ("infer 99999999999 0", "e-[usage: infer N W (1 <= N <= 1000000 timed runs after W <= 1000000 warm-up runs)]"),
    ("db", "e-[usage: db load N | db <hex> | db print]"),
    ("db 00ff", "e-[db: no db load in progress]"),
    ("bload 10", "e-[usage: bload N CRC32HEX]"),
    ("bload 10 xyz", "e-[usage: bload N CRC32HEX]"),
    ("db load 0", "e-[db load: N must be 1..{N} (the input buffer size)]"),
    ("db load {N1}", "e-[db load: N must be 1..{N} (the input buffer size)]"),
    ("bload {N1} 0", "e-[bload: N must be 1..{N} (the input buffer size)]"),
])
def test_bad_commands_answer_one_error_and_the_board_keeps_serving(cdut, cmd, err):
    n = cdut.app.input_bytes
    cmd, err = cmd.format(N=n, N1=n + 1), err.format(N=n, N1=n + 1)
    assert errors(cdut.device.command(cmd, check=False)) == [err]
    serving(cdut)


def test_commands_may_end_with_newlines(cdut):
    cdut.device.write(b"\r\nname\r\n%")
    m, before = cdut.device.expect(r"^m-name-dut-\[(.*)\]$")
    cdut.device.expect(r"^m-ready$")
    assert m[1] == f"tinydeploy {cdut.entry.manifest}"


def test_quit_says_bye_and_the_reset_strategy_brings_the_board_back(cdut):
    cdut.device.quit()
    if cdut.kind == "qemu":
        assert cdut.transport.exit_code(30) == 0      # the firmware ended QEMU with exit code 0
    cdut.reset("quit% ends the firmware")
    serving(cdut)
