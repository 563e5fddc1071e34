"""A Linux board over the system's ssh and scp: run a command, copy files both ways, and a
temporary folder on the board that is removed afterwards.

    r = Remote("pi@raspberrypi.local", port=22, identity="~/.ssh/id_ed25519")
    with r.tempdir() as d:                       # `mktemp -d` on the board, `rm -rf` on the way out
        exe = r.put(Path("model_run"), d)        # -> "<d>/model_run"
        p = r.run([exe, "--help"])               # subprocess.CompletedProcess, stdout/stderr bytes
        r.get(f"{d}/out.bin", Path("out.bin"))

ssh is never interactive here (BatchMode: no password or passphrase prompts; new host keys are
accepted once and a changed one is refused), and every remote command is built from an argv list
quoted with shlex.quote, so no model- or user-supplied string reaches the remote shell unquoted.
Connection problems (refused, unknown host, authentication, time-outs) raise one-line
TinydeployErrors that say what to do next. SshRunner runs a harness binary on the board through
it (`tinydeploy deploy`, `tinydeploy tune --ssh`), after check_board has asked the board whether
the build runs there.
"""
from __future__ import annotations

import contextlib
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.runners.harness import HarnessRunner, failure

CONNECT_TIMEOUT_S = 10
# user@host: a POSIX-ish user name and a host name, IPv4 address or bracketed IPv6 address; no
# leading '-', so neither can be taken for an ssh option.
_TARGET = re.compile(r"^(?:(?P<user>[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})@)?"
                     r"(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\])"
                     r"(?::(?P<port>[0-9]{1,5}))?$")
# Remote paths tinydeploy makes or accepts: plain characters only, so scp (in either protocol
# mode) and the remote shell see them exactly as written.
_REMOTE_PATH = re.compile(r"^/?[A-Za-z0-9_.+-][A-Za-z0-9_./+-]{0,511}$")
_SSH_OPTION = re.compile(r"^[A-Za-z]+=[^\s]{1,512}$")


def parse_target(target: str, port: int | None = None) -> tuple[str, str, int | None]:
    """(user@host or host, host, port) from `user@host[:port]`; an explicit `port` wins."""
    m = _TARGET.match(target or "")
    if m is None:
        raise TinydeployError(f"--ssh {printable(str(target))!r} is not user@host[:port] (for example "
                              "pi@192.168.1.20 or ubuntu@orin.local:2222)")
    p = int(m.group("port")) if m.group("port") else None
    if port is not None:
        p = int(port)
    if p is not None and not 0 < p < 65536:
        raise TinydeployError(f"ssh port {p} is out of range (1..65535)")
    dest = (m.group("user") + "@" if m.group("user") else "") + m.group("host")
    return dest, m.group("host"), p


def check_remote_path(path: str) -> str:
    if not _REMOTE_PATH.match(path) or ".." in path.split("/"):
        raise TinydeployError(f"remote path {printable(path)!r} is not a plain absolute or relative path "
                              "(letters, digits, _ . + - /; no '..')")
    return path


class Remote:
    """One Linux machine reached over ssh. `options` are extra `-o Key=Value` ssh options (for
    example UserKnownHostsFile=... in tests)."""

    def __init__(self, target: str, port: int | None = None, identity: str | None = None, *,
                 options: list[str] | tuple[str, ...] = (), connect_timeout: int = CONNECT_TIMEOUT_S):
        self.dest, self.host, self.port = parse_target(target, port)
        self.target = self.dest + (f":{self.port}" if self.port else "")
        self.identity = None
        if identity is not None:
            key = Path(identity).expanduser()
            if not key.is_file():
                raise TinydeployError(f"--identity {printable(str(identity))!r} is not a file; give the private "
                                      "key that logs in to the board")
            self.identity = str(key)
        for o in options:
            if not _SSH_OPTION.match(o):
                raise TinydeployError(f"ssh option {printable(o)!r} is not Key=Value")
        base = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(connect_timeout)}",
                "-o", "StrictHostKeyChecking=accept-new", "-o", "ServerAliveInterval=15",
                "-o", "ServerAliveCountMax=4", "-o", "LogLevel=ERROR"]
        for o in options:            # ssh takes the first value of an option: the caller's win
            base = ["-o", o, *base]
        if self.identity:
            base += ["-i", self.identity, "-o", "IdentitiesOnly=yes"]
        self._opts = base
        self._ssh, self._scp = _tool("ssh"), _tool("scp")

    # ---- commands -------------------------------------------------------------------------
    def run(self, argv: list[str], stdin: bytes = b"", timeout: float = 60) -> subprocess.CompletedProcess:
        """Run argv on the board (each word quoted for the remote shell). Returns the completed
        process (stdout and stderr as bytes; check returncode yourself); raises TinydeployError when
        ssh itself cannot connect or log in, or the command outlives `timeout` seconds."""
        command = " ".join(shlex.quote(str(a)) for a in argv)
        port = ["-p", str(self.port)] if self.port else []
        return self._call([self._ssh, *self._opts, *port, "-T", "--", self._ssh_dest(), command],
                          stdin, timeout, f"running {printable(argv[0] if argv else '', 60)}", ssh=True)

    def put(self, local: Path, remote_dir: str) -> str:
        """Copy a local file into remote_dir (mode bits kept); returns its remote path."""
        local = Path(local)
        check_remote_path(remote_dir)
        remote = f"{remote_dir.rstrip('/')}/{check_remote_path(local.name)}"
        self._call([self._scp, *self._scp_opts(), "--", str(local), f"{self._scp_dest()}:{remote}"],
                   b"", 600, f"copying {printable(local.name)} to the board")
        return remote

    def get(self, remote_path: str, local: Path) -> Path:
        """Copy a remote file to the local path `local`."""
        check_remote_path(remote_path)
        self._call([self._scp, *self._scp_opts(), "--", f"{self._scp_dest()}:{remote_path}", str(local)],
                   b"", 600, f"copying {printable(remote_path)} from the board")
        return Path(local)

    @contextlib.contextmanager
    def tempdir(self, path: str | None = None):
        """A folder on the board for the block: a fresh `mktemp -d`, removed afterwards (also
        after errors and Ctrl-C). An explicit `path` is created if needed and kept."""
        if path is not None:
            check_remote_path(path)
            r = self.run(["mkdir", "-p", "--", path])
            if r.returncode != 0:
                raise TinydeployError(f"cannot create {printable(path)} on {self.target}: {_last_line(r.stderr)}")
            yield path
            return
        r = self.run(["mktemp", "-d", "-t", "tinydeploy.XXXXXXXX"])
        made = r.stdout.decode(errors="replace").strip()
        if r.returncode != 0 or not made:
            raise TinydeployError(f"mktemp -d failed on {self.target}: {_last_line(r.stderr)}; is /tmp writable?")
        check_remote_path(made)
        try:
            yield made
        finally:
            try:
                self.run(["rm", "-rf", "--", made], timeout=30)
            except (TinydeployError, KeyboardInterrupt):
                import sys
                print(f"[tinydeploy] could not remove {made} on {self.target}; remove it by hand", file=sys.stderr)

    # ---- internals ------------------------------------------------------------------------
    def _ssh_dest(self) -> str:
        return self.dest.replace("[", "").replace("]", "")

    def _scp_dest(self) -> str:
        return self.dest

    def _scp_opts(self) -> list[str]:
        return ["-q", "-p", *self._opts, *(["-P", str(self.port)] if self.port else [])]

    def _call(self, cmd: list[str], stdin: bytes, timeout: float, what: str, ssh: bool = False):
        try:
            r = subprocess.run(cmd, input=stdin, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TinydeployError(f"{what} on {self.target} took more than {timeout:g} s; stopped it "
                                  "(is the board overloaded or the network down?)") from None
        # ssh exits 255 for its own errors; scp exits 1 for everything, so look at what it says
        if (ssh and r.returncode == 255) or (not ssh and r.returncode != 0):
            raise TinydeployError(self._explain(r.stderr.decode(errors="replace"), what))
        return r

    def _explain(self, stderr: str, what: str) -> str:
        text = stderr.lower()
        where = f"{self.host}:{self.port or 22}"
        if "connection refused" in text:
            return (f"ssh to {where} was refused: is sshd running on the board, and is the port right "
                    "(--ssh user@host:PORT or --port)?")
        if "could not resolve hostname" in text or "name or service not known" in text:
            return f"cannot resolve {self.host}: check the host name, or give the board's IP address"
        if "timed out" in text or "no route to host" in text or "network is unreachable" in text:
            return f"ssh to {where} timed out: is the board powered, on the network, and reachable from here?"
        if "host key verification failed" in text or "remote host identification has changed" in text:
            return (f"the host key of {self.host} is not the one known here (a reinstalled board?); if that "
                    f"is expected, run `ssh-keygen -R {self.host}` and try again")
        if "permission denied" in text or "too many authentication failures" in text:
            return (f"ssh login to {self.dest} failed (permission denied): pass --identity KEY, or install your "
                    f"public key on the board with `ssh-copy-id {self.dest}`")
        if what.startswith("copying") and "connection closed" in text:
            return (f"{what} failed: the board's sshd closed the connection (scp needs its sftp subsystem: "
                    "`Subsystem sftp ...` in the board's sshd_config)")
        return f"{what} on {self.target} failed: {_last_line(stderr.encode())}"


class SshRunner(HarnessRunner):
    """The harness binary on a Linux board over ssh, in a folder there: a fresh temporary one
    that close() removes, or `remote_dir` (created if needed, kept). Each binary is copied once
    (under a new name when another of its name is already there), the inputs when they change;
    the outputs are copied back."""

    def __init__(self, remote: Remote, remote_dir: str | None = None, timeout: float = 3600):
        super().__init__()
        self.remote, self.remote_dir, self.timeout = remote, remote_dir, timeout
        self.where = f"on {remote.target}"
        self.dir: str | None = None
        self._stack = contextlib.ExitStack()
        self._sent: dict[str, str] = {}       # local binary -> its path on the board
        self._inputs: bytes | None = None
        self._local: Path | None = None

    def open(self) -> str:
        """The folder on the board (made on first use)."""
        if self.dir is None:
            self._local = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="tinydeploy-ssh-")))
            self.dir = self._stack.enter_context(self.remote.tempdir(self.remote_dir))
        return self.dir

    def __enter__(self) -> "SshRunner":
        self.open()
        return self

    def harness(self, exe, data: bytes, runs: int) -> tuple[bytes, str]:
        d = self.open()
        exe = Path(exe)
        key = str(exe.resolve())
        if key not in self._sent:
            src = exe
            if any(Path(r).name == exe.name for r in self._sent.values()):
                src = self._local / f"c{len(self._sent)}_{exe.name}"
                shutil.copy2(exe, src)
            self._sent[key] = self.remote.put(src, d)
        if data != self._inputs:
            fin = self._local / "in.bin"
            fin.write_bytes(data)
            self.remote.put(fin, d)
            self._inputs = data
        r = self.remote.run([self._sent[key], f"{d}/in.bin", f"{d}/out.bin", str(runs)], timeout=self.timeout)
        if r.returncode != 0:
            hint = " (the folder may be mounted noexec: try --remote-dir in your home)" if r.returncode in (126, 127) else ""
            raise failure(f"the model binary failed on {self.remote.target}", r.returncode,
                          r.stderr.decode(errors="replace"), hint)
        raw = Path(self.remote.get(f"{d}/out.bin", self._local / "out.bin")).read_bytes()
        return raw, r.stdout.decode(errors="replace")

    def close(self) -> None:
        self._stack.close()
        self.dir = None
        self._sent.clear()
        self._inputs = None


def expected_machine(board) -> str:
    """`uname -m` a board's binaries need (its target says: aarch64 for the Cortex-A targets, this
    machine's for the host target)."""
    machine = board.make_target().machine
    if machine is None:
        raise TinydeployError(f"board {board.id} (target {board.target}) is not a Linux board to deploy to")
    return machine


def check_board(remote: Remote, board) -> str:
    """Refuse a board whose architecture (or, for the host target, CPU features) the build would
    not run on; returns its `uname -m`."""
    from tinydeploy.targets import FEATURES, boards, machine_name
    r = remote.run(["sh", "-c", "uname -m; grep -m1 -E '^(flags|Features)' /proc/cpuinfo || true"], timeout=30)
    lines = r.stdout.decode(errors="replace").splitlines()
    if r.returncode != 0 or not lines:
        raise TinydeployError(f"could not ask {remote.target} for its architecture (`uname -m` failed); is it a "
                              "Linux machine?")
    machine = machine_name(lines[0].strip())
    want = expected_machine(board)
    if machine != want:
        fits = [b.id for b in boards.load_all().values() if b.is_linux and b.make_target().machine == machine]
        hint = ", ".join(fits) or "none of the known boards"
        raise TinydeployError(f"{remote.target} is {printable(machine, 40)} but board {board.id} builds for {want}; "
                              f"pick the board that matches it (--board {hint})")
    if board.runs_here and len(lines) > 1:
        have = set(lines[1].split(":", 1)[-1].split())
        missing = sorted(f for f in board.make_target().needed_features() if FEATURES[f] not in have)
        if missing:
            raise TinydeployError(f"{remote.target} lacks the CPU features {', '.join(missing)} this machine's host "
                                  "build uses; build on a machine like the board (or on the board itself)")
    return machine


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise TinydeployError(f"{name} not found: deploying to a board needs the OpenSSH client "
                              "(Debian: apt-get install openssh-client)")
    return path


def _last_line(data: bytes) -> str:
    lines = [ln for ln in data.decode(errors="replace").splitlines() if ln.strip()]
    return printable(lines[-1], 200) if lines else "no message"
