"""Each model built for the board, loaded, run on seeded inputs and held to the references
(tinydeploy.reference.check_outputs: 8-bit outputs bit for bit with tinydeploy's exact reference
and within 1 LSB of the oracle)."""
from __future__ import annotations

import numpy as np
import pytest

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
    # results% (the EnergyRunner's view) agrees with the raw output bytes
    res = dut.device.results()
    flat = np.concatenate([o.reshape(-1).astype(np.float64) for o in r["outputs"]])
    if all(o.dtype.kind in "iu" for o in r["outputs"]):
        assert res == [float(v) for v in flat]


def test_energyrunner_hex_load_gives_the_same_outputs(dut):
    """db load / db <hex>% (31-byte chunks, as the runner sends them) instead of the bulk load:
    the same bytes in, the same outputs out. IC models take uint8 pixels there (v - 128 on board).
    Inputs over HEX_LOAD_MAX bytes are left to the bulk load: VWW's 27 KB take a minute as hex
    under QEMU (test_protocol_conformance.py covers db load on every board)."""
    if dut.app.input_bytes > HEX_LOAD_MAX:
        pytest.skip(f"{dut.app.input_bytes:,} input bytes: hex load over {HEX_LOAD_MAX:,} B is too slow for this run")
    feeds, data = dut.app.inputs(7)
    first = dut.run(7)["raw"]
    if dut.app.model_id == "ic01" and all(dt == np.int8 for _, _, dt in dut.app.in_specs):
        data = bytes(b ^ 0x80 for b in data)        # int8 v  ->  uint8 v + 128
    dut.device.load_hex(data)
    dut.device.infer(1, 0)
    assert dut.device.outputs() == first
