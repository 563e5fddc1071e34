"""The one interface every runner has: run a built model (a harness binary, or a microcontroller
firmware) on inputs and hand back its outputs and its median latency.

    with select_runner(board, emulate=True) as r:          # tinydeploy.runners.select_runner
        outputs, median_ms = r.run(build.exe, feeds, out_specs, runs=100)

`runs` = 0 runs the model once, untimed (median_ms is None, except for firmware, whose single
inference is always counted); N times N inferences and reports their median. `last` holds what the
last run said beyond that (firmware: instructions, stack high-water mark, the protocol's counts)."""
from __future__ import annotations


class Runner:
    where = "here"            # where the model runs, for messages and reports
    emulated = False          # under QEMU: results are real, times say nothing about the board

    def __init__(self):
        self.last: dict = {}

    def run(self, built, feeds, out_specs, runs: int = 0):
        """(outputs, median latency in ms or None) of `built` on the inputs `feeds` (a list, in
        the model's input order); out_specs: [(shape, dtype)] of the outputs."""
        raise NotImplementedError

    def capture(self, built, feeds, out_specs, profile_runs: int = 0, send: bool = True):
        """A capture build's one inference (runners.capture.Capture): the outputs, every layer's
        outputs (`send`; False: only the per-layer costs, on firmware) and, with `profile_runs`
        (Linux boards: timed runs after it; firmware always counts), each layer's cost."""
        from tinydeploy.errors import TinydeployError
        raise TinydeployError(f"{type(self).__name__} cannot capture a model's layers")

    def close(self) -> None:
        """Lets go of what the runner holds (a folder on a board); safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
