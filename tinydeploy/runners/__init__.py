"""Running a built model anywhere, below the commands (flow, commands/, the tuner, the hil rig):

    base.py         the Runner interface: run(built, feeds, out_specs, runs) -> (outputs, median ms)
    harness.py      the harness's I/O: inputs packed, outputs unpacked, timing lines, run counts
    local.py        LocalRunner: the harness binary here, natively or under user-mode QEMU (there
                    also counted: LocalRunner.count)
    icount.py       exact instruction counts under user-mode QEMU: the TCG plugin
                    (qemu_count_plugin.c, built into the cache), windows from symbols, per inference
    ssh.py          Remote (ssh/scp to a Linux board), SshRunner, the board's architecture check
    mcu.py          firmware through the serial protocol: QemuSystemRunner, SerialRunner
    qemu_system.py  Emulator: qemu-system-arm with the firmware's UART on a loopback port
    protocol.py     Device: the host side of the firmware's serial protocol
    energy.py       EnergyRunner: a Linux runner with a Jetson's power rails sampled
    capture.py      a capture build's layer tensors and per-layer costs (every runner's capture())
    litert.py       peer: LiteRT (XNNPACK) on a model's .tflite twin, timed here
    ort_aarch64.py  peer: onnxruntime's linux-aarch64 library counted under the same QEMU and plugin
                    (ort_peer_harness.c, compiled against onnxruntime's C API headers at bench time)

select_runner picks the runner for a board. Nothing here imports tinydeploy.flow or commands/."""
from __future__ import annotations

from tinydeploy.errors import TinydeployError


def select_runner(board, emulate: bool = False, remote=None, port: str | None = None, timeout: float | None = None,
                  remote_dir: str | None = None):
    """The runner of `board`'s builds: with `port` (microcontrollers) the flashed board on that
    serial port; with `remote` (a runners.ssh.Remote; Linux boards) the board over ssh, in
    `remote_dir` (default: a temporary folder there, removed on close); else here:
    microcontroller firmware under QEMU (a QEMU machine, or any board with `emulate`), a Linux
    board's binary natively when this machine is that kind of machine and `emulate` is not asked
    for, else under its user-mode QEMU with `emulate`. `timeout`: seconds for one run (ssh) or for
    each answer (serial). Errors say which option is missing."""
    from tinydeploy.targets import boards
    board = boards.get_board(board)
    if board.is_mcu:
        return _mcu_runner(board, emulate, remote, port, timeout)
    if port:
        raise TinydeployError(f"--port is for microcontroller boards; measure {board.id} on the board itself "
                              f"(or here with --emulate), or from here with `tinydeploy deploy --ssh user@host`")
    if remote is not None:
        from tinydeploy.runners.ssh import SshRunner
        return SshRunner(remote, remote_dir, timeout=timeout or 3600)
    from tinydeploy.runners.local import LocalRunner
    return LocalRunner(_user_qemu(board, emulate))


def _mcu_runner(board, emulate: bool, remote, port: str | None, timeout: float | None):
    if remote is not None:
        raise TinydeployError(f"{board.id} is a microcontroller: it is not reached over ssh (flash it: "
                              f"`tinydeploy flash --board {board.id}`)")
    if port:
        from tinydeploy.runners.mcu import SerialRunner
        return SerialRunner(port, int(board.serial_baud), timeout or 60.0)
    if not (emulate or board.is_qemu_machine):
        raise TinydeployError(f"{board.id} is a real board: add --emulate to run its firmware under QEMU here, "
                              f"or flash it (`tinydeploy build --board {board.id}`, then PlatformIO upload) and "
                              f"run the rig: pytest hil --board {board.id} --port PORT")
    board.emulator()                 # a clear error when no QEMU machine stands in for it
    from tinydeploy.runners.mcu import QemuSystemRunner
    return QemuSystemRunner(**({"timeout": timeout} if timeout else {}))


def _user_qemu(board, emulate: bool) -> list[str]:
    """The command prefix that runs a Linux board's binary here: [] natively."""
    from tinydeploy.targets import this_machine
    if board.runs_here:
        return []
    here = this_machine()
    if not emulate and board.make_target().machine == here:
        return []                    # this machine is that kind of board
    cmd = board.qemu_user
    if cmd is None:
        raise TinydeployError(f"board {board.id} is not this machine and its manifest names no user-mode QEMU; "
                              "run it on the board (`tinydeploy deploy`)")
    if not emulate:
        raise TinydeployError(f"this machine is {here}, not a {board.id}: add --emulate to run the build under "
                              f"{cmd[0]} here, run it on the board itself, or use `tinydeploy deploy --board "
                              f"{board.id} --ssh user@host`")
    import shutil
    if shutil.which(cmd[0]) is None:
        raise TinydeployError(f"{cmd[0]} not found; install it (Debian: apt-get install qemu-user)")
    return cmd
