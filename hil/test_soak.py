"""Many inferences in a row (--soak N, small in CI): no drift (the same input gives the same
output bytes and, under QEMU, the same instruction count every time), no hang (every command
answers within the board's timeout), no creeping stack use."""
from __future__ import annotations

import statistics
import time

RELOAD_MAX = 4096    # inputs up to this size are reloaded before every inference, larger ones twice


def test_soak(dut, request, record):
    n = max(2, request.config.getoption("--soak"))
    d = dut.device
    seeds = (11, 12)
    inputs = {s: dut.app.inputs(s)[1] for s in seeds}
    first_out, lat, stacks = {}, [], set()
    t = time.monotonic()
    loaded = None
    for i in range(n):
        seed = seeds[i % 2] if len(inputs[seeds[0]]) <= RELOAD_MAX else seeds[2 * i // n]
        if seed != loaded or len(inputs[seed]) <= RELOAD_MAX:
            d.load(inputs[seed])
            loaded = seed
        d.infer(1, 0)
        out = d.outputs()
        assert first_out.setdefault(seed, out) == out, f"inference {i + 1} of {n}: outputs drifted for seed {seed}"
        lat.append(dut.latency(d.last_counts)[0])
        stacks.add(d.stack()[0])
    # and one command with all N runs back to back
    d.infer(n, 0, timeout=max(dut.entry.timeout_s, 120.0 * n))
    c = d.counts()
    assert c.runs == n
    unit = dut.latency(c)[1]
    record(soak_runs=2 * n, soak_seconds=time.monotonic() - t)
    if unit == "instructions":
        assert c.count_min == c.count_max, f"instruction counts vary over {n} runs: {c.count_min}..{c.count_max}"
        assert len({int(x) for x in lat}) <= len(seeds), f"instruction counts drift: {sorted(set(lat))}"
    else:
        med = statistics.median(lat)
        assert max(lat) <= 1.10 * med and min(lat) >= 0.90 * med, f"latency drifts: {lat} us"
        assert c.ticks_max <= 1.10 * c.ticks_min, f"latency spread over {n} runs: {c.ticks_min}..{c.ticks_max} ticks"
    assert len(stacks) == 1, f"stack high-water mark changed between inferences: {sorted(stacks)}"
    assert dut.device.name() == f"tinydeploy {dut.entry.manifest}"
