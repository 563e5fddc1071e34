"""`tinydeploy bench`: the generated code's latency next to onnxruntime's (both on 1 thread, or
both on N with --threads N), measured in the same run on the same inputs, and their ratio. A benchmark, not a test: the machine is
shared, so only the ratio between peers measured together means much."""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from tinydeploy import flow, reference, runners
from tinydeploy.runners.harness import runs_within, time_runs


def onnxruntime_median_ms(model: Path, feeds: dict, budget_s: float, threads: int = 1) -> tuple[float, int]:
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    t0 = time.perf_counter()
    sess.run(None, feeds)
    runs = runs_within(budget_s, time.perf_counter() - t0)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000.0, runs


def bench_mcu(models: list[str], board: str, as_json: bool, max_weights_bytes=None) -> list[dict]:
    """Microcontroller boards, under QEMU: exact instructions per inference (the figure to
    optimise on Cortex-M), MACs per instruction, arena, flash and RAM."""
    rows = []
    for m in models:
        r = flow.run(Path(m), board, quiet=as_json, emulate=True, max_weights_bytes=max_weights_bytes)
        macs = r["macs"]
        ins = r["latency"]["instructions"]
        rows.append({"model": Path(m).name, "board": board, "instructions": ins, "macs": macs,
                     "macs_per_instruction": macs / ins if ins else None, "outputs_match": r["outputs_match"],
                     **{k: r["memory"][k] for k in ("arena_bytes", "lower_bound_bytes", "flash_bytes", "ram_bytes",
                                                    "flash_limit_bytes", "ram_limit_bytes")}})
    if as_json:
        print(json.dumps(rows))
        return rows
    print(f"{'model':<28} {'instructions':>13} {'MACs/instr':>10} {'arena B':>9} {'flash B':>10} {'RAM B':>9}  match")
    for r in rows:
        print(f"{r['model']:<28} {r['instructions']:>13,} {r['macs_per_instruction']:>10.3f} {r['arena_bytes']:>9,} "
              f"{r['flash_bytes']:>10,} {r['ram_bytes']:>9,}  {'yes' if r['outputs_match'] else 'NO'}")
    print(f"instructions per inference are exact under QEMU -icount ({board}; limits: flash "
          f"{rows[0]['flash_limit_bytes']:,} B, RAM {rows[0]['ram_limit_bytes']:,} B)" if rows else "", file=sys.stderr)
    return rows


def bench(models: list[str], board: str = "host", seconds: float = 1.0, as_json: bool = False,
          threads: int = 1, max_weights_bytes=None) -> list[dict]:
    from tinydeploy.targets import boards
    board_obj = boards.get_board(board)
    flow.check_threads(board_obj, threads)
    if board_obj.is_mcu:
        return bench_mcu(models, board, as_json, max_weights_bytes)
    runner = runners.select_runner(board_obj)
    rows = []
    for m in models:
        path = Path(m)
        b = flow.build(path, board, reuse=True, quiet=as_json, threads=threads, max_weights_bytes=max_weights_bytes)
        specs = flow.io_specs(b.summary, "inputs")
        feeds = reference.random_inputs(specs, 0)
        out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
        x = [feeds[n] for n, _, _ in specs]
        ours, runs = time_runs(runner, b.exe, x, out_specs, seconds)
        ort_ms, ort_runs = onnxruntime_median_ms(path, feeds, seconds, threads)
        macs = b.summary["macs"]
        rows.append({"model": path.name, "board": board, "threads": threads, "median_ms": ours, "runs": runs,
                     "onnxruntime_median_ms": ort_ms, "onnxruntime_runs": ort_runs, "ratio": ours / ort_ms,
                     "gflops": 2 * macs / (ours * 1e6) if ours else None, "macs": macs,
                     "arena_bytes": b.summary["arena_bytes"], "lower_bound_bytes": b.summary["lower_bound_bytes"]})
    if as_json:
        print(json.dumps(rows))
        return rows
    each = f"{threads} thread{'s' if threads > 1 else ''} each"
    print(f"{'model':<28} {'tinydeploy ms':>13} {'onnxruntime ms':>14} {'ratio':>7} {'GFLOP/s':>8} {'arena B':>10}"
          f"  ({each})")
    for r in rows:
        print(f"{r['model']:<28} {r['median_ms']:>13.4f} {r['onnxruntime_median_ms']:>14.4f} {r['ratio']:>7.2f} "
              f"{r['gflops']:>8.2f} {r['arena_bytes']:>10,}")
    print(f"ratio = tinydeploy / onnxruntime ({each}, same inputs, same run); < 1 means faster",
          file=sys.stderr)
    if threads > 1:
        print("OpenMP threads spin, then sleep between layers; on a machine shared with busy processes try "
              "OMP_WAIT_POLICY=passive (no spinning: helps large models, costs small ones a wake-up per layer)",
              file=sys.stderr)
    return rows


def bench_layers(models: list[str], board: str = "host", seconds: float = 1.0, as_json: bool = False,
                 emulate: bool = False, threads: int = 1, max_weights_bytes=None) -> list[dict]:
    """`bench --layers`: each layer's algorithm, MACs, median time, GFLOP/s and share of the time,
    from a build with -DTD_PROFILE (the harness times every layer of every timed run), so the
    next bottleneck is visible. SBC boards run under qemu-aarch64 with --emulate: those times are
    labelled emulated (they show where an emulator spends time, not the board)."""
    from tinydeploy.targets import boards
    from tinydeploy.errors import TinydeployError
    b_info = boards.get_board(board)
    if b_info.is_mcu:
        raise TinydeployError(f"bench --layers times layers of Linux boards; for {board} use `tinydeploy bench "
                              f"--board {board}` (instruction counts per inference)")
    runner = runners.select_runner(b_info, emulate)
    results = []
    for m in models:
        path = Path(m)
        outdir = flow.default_outdir(path, board + ("-emulated" if runner.emulated else "") + "-profile")
        b = flow.build(path, board, outdir, reuse=True, quiet=as_json, extra_cflags=["-DTD_PROFILE"], threads=threads,
                       max_weights_bytes=max_weights_bytes)
        specs = flow.io_specs(b.summary, "inputs")
        feeds = reference.random_inputs(specs, 0)
        x = [feeds[n] for n, _, _ in specs]
        out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
        _, ms = runner.run(b.exe, x, out_specs, runs=3)
        runs = runs_within(seconds, ms / 1000.0)
        total_us, per_layer = runner.profile(b.exe, x, runs)
        layer_sum = sum(per_layer.values()) or 1.0
        rows = []
        for step, op, name, algo, macs in b.summary["layer_table"]:
            us = per_layer.get(step, 0.0)
            rows.append({"step": step, "op": op, "name": name, "algorithm": algo, "macs": macs, "us": us,
                         "gflops": 2 * macs / (us * 1e3) if us > 0 and macs else None,
                         "share_percent": 100.0 * us / layer_sum})
        macs = b.summary["macs"]
        results.append({"model": path.name, "board": board, "emulated": runner.emulated, "runs": runs,
                        "total_us": total_us, "layers_us_sum": layer_sum, "macs": macs,
                        "gflops": 2 * macs / (total_us * 1e3) if total_us > 0 else None, "layers": rows})
    if as_json:
        print(json.dumps(results))
        return results
    for r in results:
        print(f"{r['model']} on {r['board']}{' (EMULATED: qemu-aarch64 times, not the board)' if r['emulated'] else ''}"
              f": median of {r['runs']} runs, per layer")
        print(f"{'step':>4}  {'op':<14} {'name':<24} {'algorithm':<52} {'MACs':>13} {'us':>10} {'GFLOP/s':>8} {'share':>6}")
        for x in r["layers"]:
            gf = f"{x['gflops']:.2f}" if x["gflops"] is not None else "-"
            name = x["name"] if len(x["name"]) <= 24 else "..." + x["name"][-21:]   # the distinctive end
            print(f"{x['step']:>4}  {x['op'][:14]:<14} {name:<24} {x['algorithm'][:52]:<52} {x['macs']:>13,} "
                  f"{x['us']:>10.1f} {gf:>8} {x['share_percent']:>5.1f}%")
        gf = f"{r['gflops']:.2f}" if r["gflops"] is not None else "-"
        print(f"{'':>4}  {'total':<14} {'(whole inference)':<24} {'':<52} {r['macs']:>13,} {r['total_us']:>10.1f} "
              f"{gf:>8} {100.0:>5.1f}%")
    print("us = median per layer with timing hooks (-DTD_PROFILE); share = of the layers' sum; GFLOP/s = 2 x MACs / time",
          file=sys.stderr)
    return results


def bench_place(models: list[str], board: str | None, place_name: str, address: str | None = None,
                wait_s: float = 300.0, as_json: bool = False, max_weights_bytes=None) -> list[dict]:
    """`bench --lg-place NAME`: a microcontroller board of a labgrid farm. The place is acquired
    (waiting up to wait_s while someone else holds it), each model's firmware flashed through the
    place's programming port (emulated boards; real boards must already run it, as for `measure`)
    and run through the place's serial port: latency from the board's own clock, outputs against
    the oracle, memory from the build. The place is released at the end, also on errors."""
    from tinydeploy.commands.common import place_board
    from tinydeploy.errors import TinydeployError
    from tinydeploy.runners import farm
    from tinydeploy.targets import boards
    rows = []
    with farm.hold(place_name, None, address, wait_s, say=None if as_json else flow.progress) as place:
        board = place_board(place, board)
        if not boards.get_board(board).is_mcu:
            raise TinydeployError(f"labgrid place {place.name!r} holds {board}, a Linux board: bench times Linux boards "
                                  f"where it runs (run it there), `tinydeploy tune --lg-place {place.name}` tunes it "
                                  "over the place's ssh")
        for m in models:
            b = flow.build(Path(m), board, reuse=True, quiet=as_json, max_weights_bytes=max_weights_bytes)
            if place.flash_url:
                place.flash(Path(b.firmware.elf).read_bytes())
            r = flow.measure(Path(m), board, place.serial_url, quiet=as_json, reuse=True,
                             max_weights_bytes=max_weights_bytes)
            lat = r["latency"]
            rows.append({"model": Path(m).name, "board": board, "place": place.name, "lab_host": place.exporter,
                         "instructions": lat.get("instructions"), "median_ms": lat.get("median_ms"),
                         "outputs_match": r["outputs_match"], "macs": b.summary["macs"],
                         **{k: r["memory"][k] for k in ("arena_bytes", "flash_bytes", "ram_bytes", "stack_used_bytes")}})
    if as_json:
        print(json.dumps(rows))
        return rows
    print(f"{'model':<28} {'median ms':>10} {'arena B':>9} {'flash B':>10} {'RAM B':>9}  match")
    for r in rows:
        ms = f"{r['median_ms']:.3f}" if r["median_ms"] is not None else "-"
        print(f"{r['model']:<28} {ms:>10} {r['arena_bytes']:>9,} {r['flash_bytes']:>10,} {r['ram_bytes']:>9,}  "
              f"{'yes' if r['outputs_match'] else 'NO'}")
    if rows:
        print(f"on labgrid place {rows[0]['place']} (lab host {rows[0]['lab_host']}, board {rows[0]['board']}); "
              "ms from the board's own clock", file=sys.stderr)
    return rows


def add_parser(sub) -> None:
    from tinydeploy.commands.common import labgrid_place, max_weights, threads
    p = sub.add_parser("bench", help="median latency of the generated code next to onnxruntime's")
    p.add_argument("models", nargs="+")
    p.add_argument("--board", help="board id (default host; with --lg-place the place's board)")
    p.add_argument("--seconds", type=float, default=1.0, help="time budget per measurement (default 1 s)")
    p.add_argument("--json", action="store_true")
    threads(p)
    p.add_argument("--layers", action="store_true", help="per layer: algorithm, MACs, median us, GFLOP/s, share "
                   "of the time (a build with -DTD_PROFILE)")
    p.add_argument("--emulate", action="store_true", help="with --layers: run an SBC board's build under "
                   "qemu-aarch64 (times labelled emulated)")
    labgrid_place(p, "microcontrollers: flash (emulated boards) and time on")
    max_weights(p)


def main(args, ctx) -> int:
    if args.lg_place:
        from tinydeploy.errors import TinydeployError
        if args.layers or args.threads != 1 or args.emulate:
            raise TinydeployError("--lg-place times a microcontroller place; --layers, --threads and --emulate are "
                                  "for Linux boards")
        bench_place(args.models, args.board, args.lg_place, args.lg_coordinator, args.lg_wait, args.json,
                    ctx.max_weights_bytes)
    elif args.layers:
        bench_layers(args.models, args.board or "host", args.seconds, args.json, args.emulate, args.threads,
                     ctx.max_weights_bytes)
    else:
        bench(args.models, args.board or "host", args.seconds, args.json, args.threads, ctx.max_weights_bytes)
    return 0
