"""The farm layer (hil/farm.py, tinydeploy/runners/farm.py): exporter configurations, and, through
the loopback lab's coordinator, a place someone else holds: waited for, then refused naming the
holder, or acquired once they release it. The protocol, model and fault tests run through the
lab's places by themselves (marker labgrid)."""
from __future__ import annotations

import os
import sys
import subprocess
import threading
import time

import pytest
import yaml

from hil import farm, rig
from tinydeploy.errors import TinydeployError
from tinydeploy.runners import farm as lgfarm


@pytest.mark.host
def test_exporter_config_for_a_nano_by_usb_serial_number_and_for_an_emulated_board():
    nano = yaml.safe_load(farm.exporter_config("nano33ble", serial_number="ABCDEF0123456789"))
    assert nano == {"board": {"console": {"cls": "USBSerialPort", "match": {"ID_SERIAL_SHORT": "ABCDEF0123456789"},
                                          "speed": 115200}}}
    emu = yaml.safe_load(farm.exporter_config("mps2-an386", host="127.0.0.1", serial_port=5001, flash_port=5002))
    assert emu["board"]["console"]["port"] == 5001 and emu["board"]["flash"]["protocol"] == "raw"
    text = farm.exporter_config("mps2-an386", host="127.0.0.1", serial_port=5001, flash_port=5002)
    assert all(ln.startswith("##") for ln in text.splitlines() if ln.startswith("#"))   # labgrid's jinja comments
    with pytest.raises(rig.RigError, match="USB serial number, or the serial and flash ports"):
        farm.exporter_config("nano33ble")


@pytest.mark.host
def test_place_entries_take_the_board_from_the_tag():
    inv = rig.load_inventory(rig.HIL_DIR / "boards.yml")
    e = farm.place_entry("bench-1", {"board": "nano33ble"}, inv)
    assert (e.manifest, e.transport, e.place, e.emulated, e.flash) == ("nano33ble", "labgrid", "bench-1", False, inv["nano33ble"].flash)
    assert farm.place_entry("lab-a", {"board": "mps2-an386", "kind": "qemu"}, inv).emulated
    with pytest.raises(rig.RigError, match="no tag board=<id>"):
        farm.place_entry("x", {}, inv)
    with pytest.raises(rig.RigError, match="names no boards/nope.json"):
        farm.place_entry("x", {"board": "nope"}, inv)
    with pytest.raises(TinydeployError, match="not KEY=VALUE"):
        lgfarm.parse_tags(["board"])


@pytest.fixture
def lab(hil):
    if not hil.lab:
        pytest.skip("no loopback lab in this run (--lg-loopback 0, --lg-place or no emulated board)")
    return hil.lab


def _as_someone_else(lab, *args):
    env = dict(os.environ, LG_USERNAME="someone-else", LG_COORDINATOR=lab["address"])
    r = subprocess.run([farm._bin("labgrid-client"), "-p", farm.LOCK_PLACE, *args], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.labgrid
@pytest.mark.xdist_group("labgrid-lock")
def test_a_place_held_by_someone_else_is_waited_for_then_refused_naming_the_holder(lab):
    _as_someone_else(lab, "acquire")
    c = lgfarm.client(lab["address"])
    said = []
    t = time.monotonic()
    with pytest.raises(TinydeployError, match=rf"{farm.LOCK_PLACE} still held after waiting 2 s: "
                                              rf"{farm.LOCK_PLACE} by [^/]+/someone-else"):
        c.acquire(farm.LOCK_PLACE, timeout=2, poll=0.2, say=said.append)
    assert 2 <= time.monotonic() - t < 15
    assert said and "someone-else" in said[0]
    # released while we wait: then it is ours
    threading.Timer(1.0, _as_someone_else, (lab, "release")).start()
    p = c.acquire(farm.LOCK_PLACE, timeout=60, poll=0.2)
    assert c.places()[farm.LOCK_PLACE].acquired == c.me
    c.release(p.name)
    assert not c.places()[farm.LOCK_PLACE].acquired


@pytest.mark.host
def test_xdist_scheduling_groups_every_test_of_a_board_or_place():
    from hil.plugin import board_of_test
    ids = ["mps2-an386", "lab-a-mps2-an386", "lab-b-mps2-an386"]
    assert board_of_test("hil/test_faults.py::test_bad_crc[lab-a-mps2-an386]", ids) == "lab-a-mps2-an386"
    assert board_of_test("hil/test_models.py::test_m[lab-b-mps2-an386-kws_dscnn_int8-0]", ids) == "lab-b-mps2-an386"
    assert board_of_test("hil/test_models.py::test_m[0-mps2-an386-ic_resnet8_int8]", ids) == "mps2-an386"
    assert board_of_test("hil/test_farm.py::test_lock", ids) is None
    assert board_of_test("hil/test_mlcommons.py::test_flows[kws_dscnn_int8]", ids) is None


def _tinydeploy(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "tinydeploy", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONPATH=str(rig.REPO), **(env or {})))


@pytest.mark.host
def test_bench_and_tune_on_a_place_without_labgrid_installed_say_so_in_one_line(tmp_path):
    fake = tmp_path / "nolabgrid" / "labgrid"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('labgrid is not here')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(rig.REPO), str(fake.parent)])}
    for verb in ("bench", "tune"):
        r = subprocess.run([sys.executable, "-m", "tinydeploy", verb, "--lg-place", "bench-1", "m.onnx"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, env=dict(os.environ, **env))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "labgrid is not installed" in r.stderr


@pytest.mark.labgrid
def test_bench_and_tune_accept_a_labgrid_place(tmp_path):
    """`tinydeploy bench --lg-place` flashes and times a model on a place of a lab of its own (one
    lab host with an emulated board: the session's places are held by the rig's workers); an
    unknown place, and tuning a microcontroller place, are one line and exit code 2."""
    kws = rig.REPO.parent / "shared" / "models" / "mlperf_tiny" / "kws_dscnn_int8.onnx"
    if not kws.is_file():
        pytest.skip(f"{kws} is missing")
    lab = farm.LoopbackLab(tmp_path / "lab", "mps2-an386", 1).start()
    try:
        place = next(iter(lab.places))
        r = _tinydeploy("bench", "--lg-place", place, "--lg-coordinator", lab.address, "--json", str(kws), cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        import json
        row, = json.loads(r.stdout)
        assert (row["board"], row["place"], row["lab_host"], row["outputs_match"]) == ("mps2-an386", place, "lab-a", True)
        assert row["median_ms"] > 0
        assert not lgfarm.client(lab.address).places()[place].acquired        # released at the end
        for args, said in ((("bench", "--lg-place", "nope"), "no labgrid place named 'nope'"),
                           (("tune", "--lg-place", place), "mps2-an386 is a microcontroller: nothing to tune")):
            r = _tinydeploy(*args, "--lg-coordinator", lab.address, str(kws), cwd=tmp_path)
            assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not lgfarm.client(lab.address).places()[place].acquired
    finally:
        lab.stop()
    assert not lab.alive()
