"""`tinydeploy deploy`: the `run` flow on a Linux board over ssh. Checks the connection and the
board's architecture first, cross-builds (flow.build), then lets flow.run execute the static
harness on the board through a RemoteExecutor (binary and input copied with scp into a
temporary folder, run with ssh, outputs copied back) and compare with onnxruntime here. The
board's temporary folder is removed afterwards, also after errors and Ctrl-C."""
from __future__ import annotations

import tempfile
from pathlib import Path

from tinydeploy import flow
from tinydeploy.targets import boards
from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.runners.ssh import Remote

def expected_machine(board) -> str:
    """`uname -m` a board's binaries need (its target says: aarch64 for the Cortex-A targets, this
    machine's for the host target)."""
    machine = board.make_target().machine
    if machine is None:
        raise TinydeployError(f"board {board.id} (target {board.target}) is not a Linux board to deploy to")
    return machine


def _uname(text: str) -> str:
    return {"arm64": "aarch64", "amd64": "x86_64", "AMD64": "x86_64"}.get(text, text)


def check_board(remote: Remote, board: dict) -> str:
    """Refuse a board whose architecture (or, for the host target, CPU features) the build would
    not run on; returns its `uname -m`."""
    r = remote.run(["sh", "-c", "uname -m; grep -m1 -E '^(flags|Features)' /proc/cpuinfo || true"], timeout=30)
    lines = r.stdout.decode(errors="replace").splitlines()
    if r.returncode != 0 or not lines:
        raise TinydeployError(f"could not ask {remote.target} for its architecture (`uname -m` failed); is it a "
                              "Linux machine?")
    machine = _uname(lines[0].strip())
    want = expected_machine(board)
    if machine != want:
        fits = [b.id for b in boards.load_all().values() if b.is_linux and b.make_target().machine == machine]
        hint = ", ".join(fits) or "none of the known boards"
        raise TinydeployError(f"{remote.target} is {printable(machine, 40)} but board {board.id} builds for {want}; "
                              f"pick the board that matches it (--board {hint})")
    if board.runs_here and len(lines) > 1:
        from tinydeploy.targets import FEATURES
        have = set(lines[1].split(":", 1)[-1].split())
        missing = sorted(f for f in board.make_target().needed_features() if FEATURES[f] not in have)
        if missing:
            raise TinydeployError(f"{remote.target} lacks the CPU features {', '.join(missing)} this machine's host "
                                  "build uses; build on a machine like the board (or on the board itself)")
    return machine


class RemoteExecutor:
    """flow.run's executor over ssh: copies the harness once, the inputs when they change, runs
    it in `remote_dir` and copies the outputs back."""

    def __init__(self, remote: Remote, remote_dir: str, timeout: float = 3600):
        self.remote, self.dir, self.timeout = remote, remote_dir, timeout
        self._exe: dict[Path, str] = {}
        self._inputs = None

    def __call__(self, exe: Path, feeds, out_specs, runs: int = 0):
        exe = Path(exe)
        with tempfile.TemporaryDirectory(prefix="tinydeploy-") as tmp:
            if exe not in self._exe:
                self._exe[exe] = self.remote.put(exe, self.dir)
            data = flow.pack_inputs(feeds)
            fin, fout = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
            if data != self._inputs:
                fin.write_bytes(data)
                self.remote.put(fin, self.dir)
                self._inputs = data
            r = self.remote.run([self._exe[exe], f"{self.dir}/in.bin", f"{self.dir}/out.bin", str(int(runs))],
                                timeout=self.timeout)
            if r.returncode != 0:
                last = [ln for ln in r.stderr.decode(errors="replace").splitlines() if ln.strip()]
                hint = (" (the folder may be mounted noexec: try --remote-dir in your home)"
                        if r.returncode in (126, 127) else "")
                raise TinydeployError(f"the model binary failed on {self.remote.target} (exit {r.returncode}): "
                                      f"{printable(last[-1] if last else '', 200)}{hint}")
            self.remote.get(f"{self.dir}/out.bin", fout)
            raw = fout.read_bytes()
        return flow.unpack_outputs(raw, out_specs), flow.median_ms(r.stdout.decode(errors="replace"))


def deploy(model, board_id: str, ssh: str, port: int | None = None, identity: str | None = None,
           remote_dir: str | None = None, runs: int | None = None, inputs=None, seed: int = 0, input_shapes=None,
           outdir=None, force: bool = False, command: str = "", quiet: bool = False,
           ssh_options: list[str] | tuple[str, ...] = (), threads: int = 1, max_weights_bytes=None) -> dict:
    """Cross-build, run on the board over ssh, compare with onnxruntime: flow.run's report plus
    "remote" (where it ran)."""
    board = boards.get_board(board_id)
    board_id = board.id
    if not board.is_linux:
        raise TinydeployError(f"deploy runs Linux boards over ssh; {board_id} is a microcontroller (flash it: "
                              f"`tinydeploy flash --board {board_id}`)")
    if runs is not None and not 1 <= runs <= 100000:
        raise TinydeployError("--runs must be 1..100000")
    log = (lambda m: None) if quiet else flow.progress
    remote = Remote(ssh, port, identity, options=ssh_options)
    log(f"checking {remote.target}")
    machine = check_board(remote, board)
    model = Path(model)
    extra = None
    if board.runs_here and "-static" not in board.make_target().cflags:
        extra = ["-static"]      # a static binary does not depend on the board's C library
        outdir = outdir or flow.default_outdir(model, "host-static")
    with remote.tempdir(remote_dir) as d:
        log(f"running in {d} on {remote.target}")
        res = flow.run(model, board_id, inputs, seed, input_shapes, outdir, force, command, quiet=quiet,
                       extra_cflags=extra, executor=RemoteExecutor(remote, d), runs=runs, threads=threads,
                       max_weights_bytes=max_weights_bytes)
    res["remote"] = {"target": remote.target, "machine": machine, "dir": d, "dir_removed": remote_dir is None}
    return res
