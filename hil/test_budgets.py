"""Latency and memory per board and model against hil/budgets.yml: instructions per inference
under QEMU (exact, -icount shift=0), microseconds on hardware, flash and RAM from the ELF. A
figure fails when it exceeds its budget by more than the file's margin_percent; it must also fit
the board. A figure far below its budget is reported so the budget can be tightened."""
from __future__ import annotations

import warnings

import pytest


def test_latency_and_memory_within_budget(dut, hil, record):
    mem = dut.app.fw.memory
    r = dut.run(0, runs=2)
    counts = r["counts"]
    if counts.count_unit == "instructions":
        assert counts.count_min == counts.count_max, \
            f"instruction counts differ between runs ({counts.count_min} to {counts.count_max}): is QEMU running with -icount?"
    used, reserved = dut.device.stack()
    measured = {"flash_bytes": mem["flash_used_bytes"], "ram_bytes": mem["ram_used_bytes"],
                "instructions" if r["latency_unit"] == "instructions" else "us": round(r["latency"])}
    record(latency=r["latency"], latency_unit=r["latency_unit"], flash_used_bytes=mem["flash_used_bytes"],
           ram_used_bytes=mem["ram_used_bytes"], stack_used_bytes=used, measured=measured)
    assert mem["flash_used_bytes"] <= mem["flash_bytes"] and mem["ram_used_bytes"] <= mem["ram_bytes"], mem
    assert 0 < used < reserved, f"stack: {used} of {reserved} B used"
    if hil.config.getoption("--update-budgets"):
        return                        # the session writes the measured figures into budgets.yml
    budget = hil.budgets.get(dut.entry.id, dut.app.model)
    line = f"{dut.entry.id}: {{{dut.app.model}: {{{', '.join(f'{k}: {v}' for k, v in sorted(measured.items()))}}}}}"
    if not budget:
        pytest.skip(f"no budget for {dut.app.model} on {dut.entry.id} in {hil.config.getoption('--budgets')}; "
                    f"measured now: {line}")
    over = hil.budgets.check(dut.entry.id, dut.app.model, measured)
    assert not over, (f"{dut.app.model} on {dut.entry.id} regressed: " + "; ".join(over)
                      + f" (measured {line})")
    slack = {k: v for k, v in measured.items()
             if k in budget and v < budget[k] * (1 - 2 * hil.budgets.margin_percent[k] / 100.0)}
    if slack:
        warnings.warn(f"{dut.app.model} on {dut.entry.id} is well under budget, tighten hil/budgets.yml: {line}")
    missing = sorted(set(measured) - set(budget))
    assert not missing, f"budgets.yml has no {', '.join(missing)} for {dut.app.model} on {dut.entry.id}: {line}"
