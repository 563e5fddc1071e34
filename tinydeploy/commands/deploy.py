"""`tinydeploy deploy`: the `run` flow on a Linux board over ssh. Checks the connection and the
board's architecture first (runners.ssh.check_board), cross-builds (flow.build), then lets
flow.run execute the static harness on the board through the board's SshRunner (binary and
input copied with scp into a temporary folder, run with ssh, outputs copied back) and compare
with onnxruntime here. The board's temporary folder is removed afterwards, also after errors and
Ctrl-C."""
from __future__ import annotations

from pathlib import Path

from tinydeploy import flow, runners
from tinydeploy.targets import boards
from tinydeploy.errors import TinydeployError
from tinydeploy.runners.ssh import Remote, check_board


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
    flow.check_runs(runs)
    log = (lambda m: None) if quiet else flow.progress
    remote = Remote(ssh, port, identity, options=ssh_options)
    log(f"checking {remote.target}")
    machine = check_board(remote, board)
    model = Path(model)
    extra = None
    if board.runs_here and "-static" not in board.make_target().cflags:
        extra = ["-static"]      # a static binary does not depend on the board's C library
        outdir = outdir or flow.default_outdir(model, "host-static")
    with runners.select_runner(board, remote=remote, remote_dir=remote_dir) as runner:
        d = runner.dir
        log(f"running in {d} on {remote.target}")
        res = flow.run(model, board_id, inputs, seed, input_shapes, outdir, force, command, quiet=quiet,
                       extra_cflags=extra, runner=runner, runs=runs, threads=threads,
                       max_weights_bytes=max_weights_bytes)
    res["remote"] = {"target": remote.target, "machine": machine, "dir": d, "dir_removed": remote_dir is None}
    return res


def add_parser(sub) -> None:
    from tinydeploy.commands.common import inputs, json_option, model_options, threads
    p = sub.add_parser("deploy", help="cross-build, run on a Linux board over ssh, compare with onnxruntime")
    model_options(p)
    p.add_argument("--ssh", required=True, metavar="USER@HOST[:PORT]", help="the board (system ssh/scp, no prompts)")
    p.add_argument("--port", type=int, help="ssh port (default 22, or the one in --ssh)")
    p.add_argument("--identity", metavar="KEY", help="private key to log in with (ssh -i)")
    p.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra ssh -o option, e.g. UserKnownHostsFile=FILE (repeatable)")
    p.add_argument("--remote-dir", help="folder on the board to run in, kept afterwards (default: a fresh "
                   "mktemp -d, removed afterwards)")
    p.add_argument("--runs", type=int, help="inferences to time (default: as many as fit in about 1 s)")
    threads(p)
    inputs(p)
    json_option(p)


def main(args, ctx) -> int:
    from tinydeploy.commands.common import print_json, print_run
    res = deploy(args.model, args.board, args.ssh, args.port, args.identity, args.remote_dir, args.runs,
                 args.inputs, args.seed, ctx.shapes, args.outdir, args.force, ctx.command, quiet=args.json,
                 ssh_options=args.ssh_option, threads=args.threads, max_weights_bytes=ctx.max_weights_bytes)
    print_json(res) if args.json else print_run(res)
    return 0 if res["outputs_match"] else 1
