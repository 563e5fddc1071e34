"""The host harness's I/O (firmware_templates/main.c.j2): `model_run IN.bin OUT.bin RUNS` reads
all inputs back to back from IN.bin, writes all outputs back to back to OUT.bin and, when RUNS > 0,
prints the median of RUNS timed inferences (`latency_us_median US`; built with -DTD_PROFILE also
one `layer_us_median STEP US` line per layer). The microcontroller firmware returns its outputs
the same way (rawout%). Here: packing, unpacking and parsing them, how many timed runs fit in a
time budget, and HarnessRunner, the base of the runners that start that binary (local, ssh)."""
from __future__ import annotations

import re
import time

import numpy as np

from tinydeploy.errors import TinydeployError
from tinydeploy.runners.base import Runner

MAX_RUNS = 1000           # timed runs per measurement (the harness itself takes up to 100000)
MIN_RUNS = 3

_LATENCY = re.compile(r"^latency_us_median ([0-9.]+)", re.M)
_LAYER = re.compile(r"^layer_us_median (\d+) ([0-9.]+)$", re.M)


def pack_inputs(feeds) -> bytes:
    """IN.bin (and the firmware's input buffer): every input's bytes, back to back."""
    return b"".join(np.ascontiguousarray(a).tobytes() for a in feeds)


def unpack_outputs(raw: bytes, out_specs, source: str = "the model binary") -> list[np.ndarray]:
    """OUT.bin (or the firmware's rawout%) split into the outputs [(shape, dtype)]; a clear error
    naming `source` when it holds fewer bytes than they need."""
    specs = [(tuple(shape), np.dtype(dt)) for shape, dt in out_specs]
    sizes = [int(np.prod(shape, dtype=np.int64)) * dt.itemsize for shape, dt in specs]
    if len(raw) < sum(sizes):
        raise TinydeployError(f"{source} returned {len(raw):,} output bytes; the model's outputs need {sum(sizes):,}")
    outs, pos = [], 0
    for (shape, dt), n in zip(specs, sizes):
        outs.append(np.frombuffer(raw[pos:pos + n], dtype=dt).reshape(shape).copy())
        pos += n
    return outs


def latency_us(stdout: str) -> float | None:
    """The harness's timed median in microseconds; None when it did not time (RUNS = 0)."""
    m = _LATENCY.search(stdout)
    return float(m.group(1)) if m else None


def median_ms(stdout: str) -> float | None:
    """The harness's timed median in milliseconds; None when it did not time."""
    us = latency_us(stdout)
    return None if us is None else us / 1000.0


def layer_times(stdout: str) -> tuple[float, dict[int, float]]:
    """(median latency in us, {step: median us}) printed by a harness built with -DTD_PROFILE."""
    total = latency_us(stdout)
    layers = {int(s): float(us) for s, us in _LAYER.findall(stdout)}
    if total is None or not layers:
        raise TinydeployError("the harness printed no per-layer times (was it built with -DTD_PROFILE?)")
    return total, layers


def runs_within(budget_s: float, once_s: float) -> int:
    """How many timed runs of `once_s` seconds fit in about budget_s: MIN_RUNS to MAX_RUNS."""
    return int(min(MAX_RUNS, max(MIN_RUNS, budget_s / max(once_s, 1e-6))))


def time_runs(runner, built, feeds, out_specs, budget_s: float, probe: int = 1) -> tuple[float, int]:
    """Median latency (ms) over as many runs as fit in about budget_s, and their number: `probe`
    timed runs say how long one takes. One inference's time is the harness's own figure, so the
    start-up of the process (or an ssh round trip) does not shrink the number of runs."""
    t0 = time.perf_counter()
    _, ms = runner.run(built, feeds, out_specs, runs=probe)
    runs = runs_within(budget_s, ms / 1000.0 if ms is not None else (time.perf_counter() - t0) / probe)
    _, ms = runner.run(built, feeds, out_specs, runs=runs)
    return ms, runs


def failure(what: str, returncode: int, stderr: str, hint: str = "") -> TinydeployError:
    """The error of a harness binary that exited with `returncode`: its last line on stderr."""
    from tinydeploy.codegen.cfmt import printable
    last = [ln for ln in stderr.splitlines() if ln.strip()]
    return TinydeployError(f"{what} (exit {returncode}): {printable(last[-1] if last else '', 200)}{hint}")


class HarnessRunner(Runner):
    """A runner of the harness binary: subclasses say how to start it (`harness`)."""

    def harness(self, exe, data: bytes, runs: int) -> tuple[bytes, str]:
        """Runs `exe IN.bin OUT.bin runs` with IN.bin = data: (OUT.bin's bytes, its stdout)."""
        raise NotImplementedError

    def run(self, exe, feeds, out_specs, runs: int = 0):
        raw, stdout = self.harness(exe, pack_inputs(feeds), int(runs))
        return unpack_outputs(raw, out_specs), median_ms(stdout)

    def capture(self, exe, feeds, out_specs, profile_runs: int = 0, send: bool = True):
        """A capture build (-DTD_CAPTURE -DTD_PROFILE): its outputs and layer records from OUT.bin
        and, after `profile_runs` timed runs, each layer's cost (layer_costs)."""
        from tinydeploy.runners.capture import Capture, parse_records
        raw, stdout = self.harness(exe, pack_inputs(feeds), int(profile_runs))
        outs = unpack_outputs(raw, out_specs)
        cap = Capture(outs, parse_records(raw[sum(o.nbytes for o in outs):]), self.where, self.emulated)
        if profile_runs:
            cap.cost_unit, cap.costs = self.layer_costs(stdout)
        return cap

    def layer_costs(self, stdout: str) -> tuple[str, dict[int, float]]:
        """(unit, {step: cost}) of a -DTD_PROFILE build's timed runs: the harness's median
        microseconds per layer. The seam for runners that count instead: one that runs the binary
        under qemu-aarch64 with an instruction-counting plugin overrides this and returns
        ("instructions", {step: count}); validate --profile and bench --layers show whatever
        unit it gives."""
        return "us", layer_times(stdout)[1]

    def profile(self, exe, feeds, runs: int) -> tuple[float, dict[int, float]]:
        """A -DTD_PROFILE build's (median latency in us, {step: median us}) over `runs` runs."""
        _, stdout = self.harness(exe, pack_inputs(feeds), int(runs))
        return layer_times(stdout)
