"""Each model built for the board, loaded, run on seeded inputs and held to the references
(tinydeploy.reference.check_outputs: 8-bit outputs bit for bit with tinydeploy's exact reference
and within 1 LSB of the oracle)."""
from __future__ import annotations

import numpy as np
import pytest

from tinydeploy.firmware import profiles

SEEDS = (0, 1)
HEX_LOAD_MAX = 4096


@pytest.mark.parametrize("seed", SEEDS)
def test_model_matches_onnxruntime(dut, seed, record, request):
    seed += request.config.getoption("--hil-seed")
    r = dut.run(seed)
    cmp = r["compare"]
    record(max_lsb=cmp["max_abs_error"], identical_fraction=cmp.get("identical_fraction"),
           latency=r["latency"], latency_unit=r["latency_unit"])
    assert cmp["outputs_match"], (f"{dut.app.model} on {dut.entry.id}, seed {seed}: outputs differ from "
                                  f"the oracle: {cmp}")
    if "exact_reference" in cmp:
        assert cmp["exact_reference"]["identical"], f"{dut.app.model} on {dut.entry.id}: not the exact reference: {cmp}"
    # results% (what the MLCommons runner reads: dequantised %0.3f, or AD's MSE) agrees with the
    # raw output bytes, float32 step by float32 step (tinydeploy.firmware.profiles)
    lines = dut.device.command("results")
    h = dut.app.fw.harness
    window = profiles.dequantise(np.frombuffer(dut.app.inputs(seed)[1], np.int8), h["input"]["scale"],
                                 h["input"]["zero_point"]) if h["input"] else None
    assert lines == [profiles.printed_results(h, r["outputs"], window)]


def test_energyrunner_hex_load_gives_the_same_outputs(dut):
    """db load / db <hex>% (31-byte chunks, as the runner sends them) instead of the bulk load:
    the same inputs in, the same outputs out. What the runner sends is the profile's
    (profiles.json): IC and VWW uint8 pixels (v - 128 on board), AD float32 values quantised on
    board (here the dequantised inputs, which quantise back to the same bytes).
    Inputs over HEX_LOAD_MAX bytes are left to the bulk load: VWW's 27 KB take a minute as hex
    under QEMU (test_protocol_conformance.py covers db load on every board)."""
    if dut.app.input_bytes > HEX_LOAD_MAX:
        pytest.skip(f"{dut.app.input_bytes:,} input bytes: hex load over {HEX_LOAD_MAX:,} B is too slow for this run")
    feeds, data = dut.app.inputs(7)
    first = dut.run(7)["raw"]
    h = dut.app.fw.harness
    if h["db_subtract_128"]:
        data = bytes(b ^ 0x80 for b in data)        # int8 v  ->  uint8 v + 128
    if h["db_float32"]:
        i = h["input"]
        data = profiles.dequantise(np.frombuffer(data, np.int8), i["scale"], i["zero_point"]).tobytes()
    dut.device.load_hex(data)
    dut.device.infer(1, 0)
    assert dut.device.outputs() == first
