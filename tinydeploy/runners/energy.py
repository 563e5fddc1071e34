"""Energy per inference on Jetson boards, from the INA3221 power monitors the kernel exposes in
sysfs (`tinydeploy measure --board jetson-orin --energy MODEL`, run on the board): EnergyRunner wraps
the runner of the board's binary (tinydeploy.runners.select_runner) while flow.measure times it.

The board manifest names the rails to sum (`power_monitor.rails`, e.g. Orin: VDD_CPU_CV and
VDDQ_VDD2_1V8AO) and where their channels live (`power_monitor.sysfs`): JetPack 5/6 use the
mainline hwmon driver (`.../ina3221/<i2c dev>/hwmon/hwmon*/in<n>_label`, `in<n>_input` in mV,
`curr<n>_input` in mA); JetPack 4 used NVIDIA's IIO driver (`.../ina3221x/<i2c dev>/iio:device*/
rail_name_<n>`, `in_voltage<n>_input`, `in_current<n>_input`). Rails are found by label under a
sysfs root (default /; tests point it at a fake tree).

While the harness does its timed runs, a background thread samples V*I of every rail at 10 Hz
(plus one sample at the start and one at the end); the samples are integrated with the
trapezoid rule. Energy per inference = mean power over the window x median latency, so process
start-up and the harness's warm-up runs, which share the window, do not count as inferences.
The rails measure the whole CPU cluster and DRAM, idle cores and other processes included.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.runners.base import Runner

SAMPLE_HZ = 10.0
MIN_WINDOW_S = 2.0        # default length of the measured window: 20 samples at 10 Hz
MAX_RUNS = 100000         # the harness's limit


@dataclass
class Rail:
    name: str
    voltage_mv: Path
    current_ma: Path

    def watts(self) -> float:
        try:
            mv = float(self.voltage_mv.read_text().split()[0])
            ma = float(self.current_ma.read_text().split()[0])
        except (OSError, ValueError, IndexError) as e:
            raise TinydeployError(f"cannot read power rail {printable(self.name)} ({self.voltage_mv}, "
                                  f"{self.current_ma}): {printable(str(e), 100)}; are they readable by this user?") from None
        return mv * ma / 1e6


def _where(board: dict, root: Path) -> str:
    return " or ".join(f"{root / lay['dirs'] / lay['label'].replace('{n}', 'N')}" for lay in board.power_monitor["sysfs"])


def find_rails(board: dict, root="/") -> list[Rail]:
    """The board's rails (in manifest order) by label under the sysfs `root`; a one-line error
    naming what was looked for, and where, when one is missing."""
    root = Path(root)
    pm = board.power_monitor
    if not pm:
        from tinydeploy.targets import boards
        known = [f"{b.id} ({', '.join(b.power_monitor['rails'])})" for b in boards.load_all().values()
                 if b.power_monitor]
        raise TinydeployError(f"board {board.id} has no power monitor in its manifest, so --energy cannot measure "
                              f"it; it reads the INA3221 rails of {', '.join(known)} from sysfs on the board")
    found, seen = {}, []
    for lay in pm["sysfs"]:
        for d in sorted(root.glob(lay["dirs"])):
            for n in lay["channels"]:
                try:
                    label = (d / lay["label"].format(n=n)).read_text().strip()
                except (OSError, UnicodeDecodeError):
                    continue
                seen.append(label)
                if label in pm["rails"] and label not in found:
                    found[label] = Rail(label, d / lay["voltage_mv"].format(n=n), d / lay["current_ma"].format(n=n))
    missing = [r for r in pm["rails"] if r not in found]
    if missing:
        raise TinydeployError(f"{board.id}: power rail{'s' if len(missing) > 1 else ''} {', '.join(missing)} not found "
                              f"(looked for the labels {', '.join(pm['rails'])} in {_where(board, root)}; found "
                              f"{printable(', '.join(seen), 120) or 'no labels'}); run on the board itself, or point "
                              "--sysfs-root at a copy of its sysfs")
    rails = [found[r] for r in pm["rails"]]
    for r in rails:
        r.watts()                  # readable now, not halfway through the measurement
    return rails


def integrate(times: list[float], watts: list[float]) -> float:
    """Joules from power samples (s, W) by the trapezoid rule."""
    return sum((t1 - t0) * (w0 + w1) / 2.0 for t0, t1, w0, w1 in zip(times, times[1:], watts, watts[1:]))


@dataclass
class PowerSampler:
    """Samples every rail's power in a background thread for the duration of a `with` block:
    once on entry, every `interval` seconds, once on exit."""
    rails: list
    interval: float = 1.0 / SAMPLE_HZ
    clock: object = time.monotonic
    times: list = field(default_factory=list)
    watts: list = field(default_factory=list)      # per sample: one value per rail

    def _sample(self) -> None:
        self.watts.append([r.watts() for r in self.rails])
        self.times.append(self.clock())

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self._sample()
        except TinydeployError as e:
            self._error = e

    def __enter__(self):
        self._stop, self._error = threading.Event(), None
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="tinydeploy-power", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self._error is not None and exc[0] is None:
            raise self._error
        if exc[0] is None:
            self._sample()
        return False

    def joules(self, rail: int | None = None) -> float:
        """Energy over the window, of one rail (by index) or all of them."""
        w = [sum(s) if rail is None else s[rail] for s in self.watts]
        return integrate(self.times, w)

    @property
    def seconds(self) -> float:
        return self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0


class EnergyRunner(Runner):
    """Wraps a runner of a Linux board's harness: every timed run (runs > 0) runs inside a
    PowerSampler; the last one is reported. With min_window_s, a timed run shorter than that is
    repeated with enough runs to fill it (the monitor's 10 Hz needs seconds, not milliseconds)."""

    def __init__(self, inner, rails: list[Rail], interval: float = 1.0 / SAMPLE_HZ, min_window_s: float = 0.0):
        super().__init__()
        self.inner, self.rails, self.interval, self.min_window_s = inner, rails, interval, min_window_s
        self.where, self.emulated = inner.where, inner.emulated
        self.sampler, self.median_ms, self.runs = None, None, 0

    def run(self, exe, feeds, out_specs, runs: int = 0):
        if not runs:
            return self.inner.run(exe, feeds, out_specs, runs=0)
        while True:
            with PowerSampler(self.rails, self.interval) as s:
                outs, ms = self.inner.run(exe, feeds, out_specs, runs=runs)
            self.sampler, self.median_ms, self.runs = s, ms, runs
            if not ms or s.seconds >= self.min_window_s or runs >= MAX_RUNS:
                return outs, ms
            runs = min(MAX_RUNS, max(2 * runs, int(self.min_window_s * 1.2 / (ms / 1000.0))))

    def close(self) -> None:
        self.inner.close()

    def report(self) -> dict:
        s = self.sampler
        if s is None or not self.median_ms or s.seconds <= 0:
            raise TinydeployError("no timed runs to measure energy over; give --runs N (N >= 1)")
        mean_w = s.joules() / s.seconds
        j = mean_w * self.median_ms / 1000.0
        return {"joules_per_inference": j, "inferences_per_joule": (1.0 / j) if j > 0 else None,
                "mean_power_w": {r.name: s.joules(i) / s.seconds for i, r in enumerate(self.rails)},
                "total_mean_power_w": mean_w, "window_s": s.seconds, "samples": len(s.times),
                "sample_hz": 1.0 / self.interval, "runs": self.runs,
                "rails": {r.name: [str(r.voltage_mv), str(r.current_ma)] for r in self.rails},
                "method": "mean power of the rails over the timed runs (trapezoid) x median latency"}
