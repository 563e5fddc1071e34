"""`tinydeploy deploy` against a real sshd on 127.0.0.1 (started here, on a free port, with keys
made here) and the host board; plus the transport's errors: refused port, unknown key, a board
of another architecture, quoting, and removal of the remote folder after Ctrl-C."""
import getpass
import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tinydeploy.runners.qemu_system import free_port
from tinydeploy.errors import TinydeployError
from tinydeploy.runners.ssh import Remote, parse_target
from util import require


def tiny_model(path: Path) -> Path:
    """A small Conv + Relu + Gemm model (seeded weights) that compiles in well under a second."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 3, 3], rng.standard_normal(108).astype("float32"))
    fc = helper.make_tensor("fc", TensorProto.FLOAT, [256, 10], rng.standard_normal(2560).astype("float32"))
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["r"]),
                           helper.make_node("Flatten", ["r"], ["f"]),
                           helper.make_node("Gemm", ["f", "fc"], ["y"])], "tiny",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], [w, fc])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)
    return path


class Sshd:
    """A private sshd on 127.0.0.1 that lets the current user in with one client key."""

    def __init__(self, folder: Path):
        require("/usr/sbin/sshd")        # .ci/setup installs openssh-server: fail, never skip
        keygen = require("ssh-keygen")
        require("ssh")
        require("scp")
        self.dir = folder
        for name in ("host_key", "client_key", "other_key"):
            subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
        (folder / "authorized_keys").write_text((folder / "client_key.pub").read_text())
        self.port = free_port()
        (folder / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {folder / 'host_key'}\n"
            f"AuthorizedKeysFile {folder / 'authorized_keys'}\nPasswordAuthentication no\n"
            f"KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPidFile {folder / 'sshd.pid'}\n"
            "Subsystem sftp internal-sftp\n")       # scp speaks SFTP, as on Raspberry Pi OS and L4T
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)   # sshd's privilege separation folder (root only)
        self.log = open(folder / "sshd.log", "wb")
        self.proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(folder / "sshd_config")],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"sshd did not start: {(folder / 'sshd.log').read_text()[-1000:]}")
                time.sleep(0.1)
        self.target = f"{getpass.getuser()}@127.0.0.1"
        self.options = [f"UserKnownHostsFile={folder / 'known_hosts'}", "StrictHostKeyChecking=no"]

    def args(self, key: str = "client_key", port: int | None = None) -> list[str]:
        out = ["--ssh", f"{self.target}:{port or self.port}", "--identity", str(self.dir / key)]
        for o in self.options:
            out += ["--ssh-option", o]
        return out

    def remote(self) -> Remote:
        return Remote(self.target, self.port, str(self.dir / "client_key"), options=self.options)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    s = Sshd(tmp_path_factory.mktemp("sshd"))
    yield s
    s.stop()


def deploy(args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinydeploy", "deploy", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_deploy_to_host_over_ssh_matches_onnxruntime(sshd, tmp_path):
    model = tiny_model(tmp_path / "tiny.onnx")
    r = deploy(["--board", "host", *sshd.args(), str(model), "-o", str(tmp_path / "b"), "--runs", "7", "--json"],
               tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["outputs_match"] is True and res["max_rel_error"] <= 1e-4
    assert res["latency"]["runs"] == 7 and res["latency"]["median_ms"] > 0
    assert {"model", "board", "tolerance", "memory"} <= set(res) and res["board"] == "host"
    remote = res["remote"]
    assert remote["machine"] == "x86_64" or remote["machine"] == os.uname().machine
    assert remote["dir"].startswith("/") and remote["dir_removed"] is True
    assert not Path(remote["dir"]).exists()          # the board is this machine: its temp folder is gone
    assert not has_interpreter(tmp_path / "b" / "model_run")   # static: needs nothing of the board's C library


def has_interpreter(elf: Path) -> bool:
    """Whether a 64-bit little-endian ELF file names a dynamic loader (a PT_INTERP segment)."""
    data = elf.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1
    phoff, (phentsize, phnum) = int.from_bytes(data[0x20:0x28], "little"), struct.unpack_from("<HH", data, 0x36)
    return any(struct.unpack_from("<I", data, phoff + i * phentsize)[0] == 3 for i in range(phnum))


def test_remote_folder_is_removed_after_ctrl_c_and_commands_are_quoted(sshd):
    r = sshd.remote()
    with pytest.raises(KeyboardInterrupt):
        with r.tempdir() as d:
            assert Path(d).is_dir()
            raise KeyboardInterrupt
    assert not Path(d).exists()
    nasty = "a b; touch /tmp/tinydeploy-pwned $(id) `id` 'q' \"dq\" \\"
    p = r.run(["echo", nasty])
    assert p.returncode == 0 and p.stdout.decode() == nasty + "\n"
    assert not Path("/tmp/tinydeploy-pwned").exists()


@pytest.mark.parametrize("bad", ["-oProxyCommand=id", "user@host;id", "user@ho st", "us$er@host", "user@host:99999",
                                 "", "@host"])
def test_bad_targets_are_refused(bad):
    with pytest.raises(TinydeployError, match="user@host|port"):
        parse_target(bad)


def test_refused_port_is_a_clear_error(sshd, tmp_path):
    model = tiny_model(tmp_path / "tiny.onnx")
    r = deploy(["--board", "host", *sshd.args(port=free_port()), str(model), "-o", str(tmp_path / "b")], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if not ln.startswith("[tinydeploy]")]
    assert len(errors) == 1 and "refused" in errors[0] and "sshd" in errors[0], r.stderr


def test_unknown_key_is_a_clear_error(sshd, tmp_path):
    model = tiny_model(tmp_path / "tiny.onnx")
    r = deploy(["--board", "host", *sshd.args(key="other_key"), str(model), "-o", str(tmp_path / "b")], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "permission denied" in r.stderr and "--identity" in r.stderr, r.stderr


def test_board_of_another_architecture_is_refused_before_building(sshd, tmp_path):
    model = tiny_model(tmp_path / "tiny.onnx")
    r = deploy(["--board", "rpi4", *sshd.args(), str(model), "-o", str(tmp_path / "b")], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "aarch64" in r.stderr and os.uname().machine in r.stderr and "--board" in r.stderr, r.stderr
    assert not (tmp_path / "b").exists()


def test_missing_ssh_client_is_a_clear_error(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}          # no ssh, no scp
    r = subprocess.run([sys.executable, "-m", "tinydeploy", "deploy", "--board", "host", "--ssh", "pi@192.0.2.1",
                        str(tiny_model(tmp_path / "tiny.onnx"))], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "openssh-client" in r.stderr, r.stderr
