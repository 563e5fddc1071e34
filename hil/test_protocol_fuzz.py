"""The protocol fuzzer (hil/protofuzz.py) against each board: --protofuzz N seeded faults
(garbage, boundaries, interleavings; --hil-seed), each followed by a correct name% and an
inference bit for bit equal to the one before the first fault, which itself matches the
references."""
from __future__ import annotations

from hil import protofuzz


def test_every_fault_is_followed_by_name_and_a_bit_identical_inference(cdut, request, record):
    n = request.config.getoption("--protofuzz")
    seed = request.config.getoption("--hil-seed")
    before = cdut.run(seed)
    assert before["compare"]["outputs_match"], before["compare"]
    _, data = cdut.app.inputs(seed)
    rep = protofuzz.fuzz(cdut.device, f"tinydeploy {cdut.entry.manifest}", data, cdut.app.out_specs, before["raw"],
                         n=n, seed=seed, timeout=max(cdut.entry.timeout_s, 60.0))
    record(protofuzz_faults=rep.faults, protofuzz_retries=rep.retries, protofuzz_seconds=round(rep.seconds, 1))
    print(f"\n{cdut.entry.id}: {rep.line()}")
    assert rep.faults == n
