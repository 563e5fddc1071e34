"""The harness binary on this machine: natively, or under user-mode QEMU (qemu-aarch64 -cpu X,
the board manifest's `qemu.user`) for a Linux board of another architecture; there, with `count`,
its instructions per inference counted exactly by tinydeploy's QEMU plugin (runners/icount.py)."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from tinydeploy.errors import TinydeployError
from tinydeploy.runners import icount
from tinydeploy.runners.harness import HarnessRunner, failure, pack_inputs, unpack_outputs

COUNT_RUNS = 1      # timed runs of the counted N-inference run: 1 + (1 warm-up) + 1 = 3 inferences


class LocalRunner(HarnessRunner):
    def __init__(self, prefix: list[str] | tuple[str, ...] = ()):
        super().__init__()
        self.prefix = list(prefix)
        self.emulated = bool(self.prefix)
        self.where = f"under {Path(self.prefix[0]).name}" if self.prefix else "natively"

    @property
    def counts_instructions(self) -> bool:
        """Instructions can be counted: the binary runs under user-mode QEMU."""
        return self.emulated

    def harness(self, exe, data: bytes, runs: int, qemu_args=()) -> tuple[bytes, str]:
        with tempfile.TemporaryDirectory(prefix="tinydeploy-") as tmp:
            fin, fout = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
            fin.write_bytes(data)
            cmd = [*self.prefix[:1], *qemu_args, *self.prefix[1:], str(Path(exe).resolve()), str(fin), str(fout),
                   str(runs)]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            except subprocess.TimeoutExpired:
                raise TinydeployError("the model binary ran for more than an hour; stopped it") from None
            if r.returncode != 0:
                raise failure("the model binary failed", r.returncode, r.stderr)
            return fout.read_bytes(), r.stdout

    def count(self, exe, feeds, out_specs, layers: bool = False) -> tuple[list, icount.PerInference]:
        """(outputs, instructions per inference) of `exe` on `feeds` under QEMU with the counting
        plugin: run once with 1 inference and once with several, the difference per inference
        (exact, or an error). `layers`: per layer too (a -DTD_PROFILE build)."""
        if not self.prefix:
            raise TinydeployError("instructions are counted under user-mode QEMU: run a Linux board's build "
                                  "with --emulate")
        icount.check_plugin_support(self.prefix[0])
        marks = icount.windows(exe, layers=layers)
        data = pack_inputs(feeds)
        with tempfile.TemporaryDirectory(prefix="tinydeploy-count-") as tmp:
            one, many = Path(tmp) / "one.txt", Path(tmp) / "many.txt"
            raw, _ = self.harness(exe, data, 0, icount.qemu_args(one, marks))
            self.harness(exe, data, COUNT_RUNS, icount.qemu_args(many, marks))
            counted = icount.per_inference(icount.read_report(one), icount.read_report(many))
        self.last = {"instructions": counted.instructions, "counts": counted}
        return unpack_outputs(raw, out_specs), counted
