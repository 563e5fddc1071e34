"""The MLCommons runner's performance and accuracy flows against tinydeploy firmware under QEMU,
through a pty (hil/mlcommons_shim.py's bridge, which the real runner uses too), on the board its
device lists describe: the NUCLEO-L4R5ZI (`l4r5zi`, emulated at its own 120 MHz clock).

CI cannot fetch the runner (mlcommons/tiny), so this test keeps its checks re-implemented from
its source and documentation (hil/mlcommons.py; none of its code is here). The real runner,
unchanged, was run through hil/mlcommons_shim.py against the same firmware for the four models
(hil/LAB.md, "The MLCommons runner": how, and what it reported). Both must find: the
board identified, every reply within the runner's timeouts, a performance loop of at least 10 s
of host time (the bridge paces infer replies to the board's own timestamps, --realtime), the
throughput of `tinydeploy run` at the board's clock, and the accuracy and AUC that the
dequantised outputs of tinydeploy's exact reference give."""
from __future__ import annotations

import numpy as np
import pytest

from hil import mlcommons, rig
from hil.mlcommons_shim import PtyBridge, present_as_usb

BOARD = "nucleo-l4r5zi"
MODELS = ["kws_dscnn_int8", "ic_resnet8_int8", "vww_mobilenetv1_int8", "ad_autoencoder_int8"]
# accuracy needs every class among the labels (the AUC); AD: one file per class, two windows each.
# Every file goes through the runner's hex download (31 bytes per command), which the emulated
# UART takes at about 1 KB of hex per second: VWW's 27 KB images cost about a minute each, so
# its flows run only with --mlcommons-full (the real runner's run on VWW: hil/LAB.md).
FILES = {"kws01": 12, "ic01": 10, "vww01": 5, "ad01": 2}
AD_WINDOWS = 2


@pytest.fixture(scope="module")
def l4r5zi(hil):
    if BOARD not in hil.inventory or not hil.inventory[BOARD].emulated:
        pytest.skip(f"{BOARD} is not an emulated board of the inventory")
    return hil.inventory[BOARD]


@pytest.mark.qemu
@pytest.mark.mlcommons
@pytest.mark.xdist_group("mlcommons")
@pytest.mark.parametrize("model", MODELS)
def test_runner_flows_complete_and_agree(l4r5zi, model, hil, tmp_path_factory, tmp_path, record, request):
    if model.startswith("vww") and not request.config.getoption("--mlcommons-full"):
        pytest.skip("VWW's runner flows download 10 images of 27 KB as hex, about 10 minutes under QEMU: "
                    "--mlcommons-full runs them (hil/LAB.md has the real runner's run on VWW)")
    app = hil.cache(tmp_path_factory).get(l4r5zi, model)
    h = app.fw.harness
    ds = mlcommons.make_dataset(app, tmp_path / "datasets", FILES[h["model_id"]], ad_windows=AD_WINDOWS)
    want = mlcommons.expected_values(app, ds)
    t = rig.QemuTransport(app.fw)
    dev = t.open()
    url = t.emu.url
    dev.close()                              # QEMU serves one connection: the bridge's
    bridge = PtyBridge(url, h["baud"], realtime=True)
    try:
        present_as_usb(bridge.path, 0x0483, 0x374B)
        from serial.tools import list_ports
        found = [p.device for p in list_ports.comports() if (p.vid, p.pid) == (0x0483, 0x374B)]
        assert found == [bridge.path]         # the runner's discovery sees the pty as the l4r5zi
        dut = mlcommons.RunnerDut(bridge.path, h["baud"])
        try:
            assert dut.identify() == (f"tinydeploy {BOARD}", h["model_id"])
            perf = mlcommons.performance(dut, h["model_id"], ds)
            acc = mlcommons.accuracy_flow(dut, ds)
        finally:
            dut.close()
    finally:
        bridge.close()
        t.close()
    # throughput: N inferences over the window at the board's clock, as `tinydeploy run` reports
    budget = hil.budgets.get(BOARD, model) or {}
    ins = budget.get("instructions")
    if ins:
        run_throughput = app.fw.board.clock_hz / ins
        assert perf["median_throughput"] == pytest.approx(run_throughput, rel=0.01), perf
    assert acc["results"] == want, "the runner's results differ from the dequantised exact reference"
    expect = mlcommons.summarise(want, ds.labels)
    assert (acc["accuracy"], acc["auc"]) == (expect["accuracy"], expect["auc"])
    record(median_throughput=perf["median_throughput"], host_s=perf["host_s"], accuracy=acc["accuracy"],
           auc=acc["auc"], paced_s=bridge.paced_s)
