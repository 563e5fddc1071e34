"""The harness binary on this machine: natively, or under user-mode QEMU (qemu-aarch64 -cpu X,
the board manifest's `qemu.user`) for a Linux board of another architecture."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from tinydeploy.errors import TinydeployError
from tinydeploy.runners.harness import HarnessRunner, failure

class LocalRunner(HarnessRunner):
    def __init__(self, prefix: list[str] | tuple[str, ...] = ()):
        super().__init__()
        self.prefix = list(prefix)
        self.emulated = bool(self.prefix)
        self.where = f"under {Path(self.prefix[0]).name}" if self.prefix else "natively"

    def harness(self, exe, data: bytes, runs: int) -> tuple[bytes, str]:
        with tempfile.TemporaryDirectory(prefix="tinydeploy-") as tmp:
            fin, fout = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
            fin.write_bytes(data)
            try:
                r = subprocess.run([*self.prefix, str(Path(exe).resolve()), str(fin), str(fout), str(runs)],
                                   capture_output=True, text=True, timeout=3600)
            except subprocess.TimeoutExpired:
                raise TinydeployError("the model binary ran for more than an hour; stopped it") from None
            if r.returncode != 0:
                raise failure("the model binary failed", r.returncode, r.stderr)
            return fout.read_bytes(), r.stdout
