"""`tinydeploy bench`: the generated code's latency next to its peers' on the same inputs, in the
same run, and their ratios: onnxruntime (both on 1 thread, or both on N with --threads N) and, when
the model has a .tflite twin, LiteRT with XNNPACK (runners/litert.py). With --emulate, a Linux
board's build under user-mode QEMU: exact instructions per inference (runners/icount.py) next to
onnxruntime's own library for that board counted the same way (runners/ort_aarch64.py). A
benchmark, not a test: the machine is shared, so only the ratio between peers measured together
means much."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from tinydeploy import flow, reference, runners
from tinydeploy.commands.common import print_json
from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.runners.harness import runs_within, time_runs

PEERS = ("auto", "require", "none")


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


def bench_mcu(models: list[str], board: str, as_json: bool, max_weights_bytes=None,
              optimize: str = "balanced") -> list[dict]:
    """Microcontroller boards, under QEMU: exact instructions per inference (the figure to
    optimise on Cortex-M), MACs per instruction, arena, flash and RAM."""
    rows = []
    for m in models:
        r = flow.run(Path(m), board, quiet=as_json, emulate=True, max_weights_bytes=max_weights_bytes,
                     optimize=optimize)
        macs = r["macs"]
        ins = r["latency"]["instructions"]
        rows.append({"model": Path(m).name, "board": board, "optimize": optimize, "instructions": ins, "macs": macs,
                     "macs_per_instruction": macs / ins if ins else None, "outputs_match": r["outputs_match"],
                     **{k: r["memory"][k] for k in ("arena_bytes", "lower_bound_bytes", "flash_bytes", "ram_bytes",
                                                    "flash_limit_bytes", "ram_limit_bytes")}})
    if as_json:
        print_json(rows)
        return rows
    print(f"{'model':<28} {'instructions':>13} {'MACs/instr':>10} {'arena B':>9} {'flash B':>10} {'RAM B':>9}  match")
    for r in rows:
        print(f"{r['model']:<28} {r['instructions']:>13,} {r['macs_per_instruction']:>10.3f} {r['arena_bytes']:>9,} "
              f"{r['flash_bytes']:>10,} {r['ram_bytes']:>9,}  {'yes' if r['outputs_match'] else 'NO'}")
    print(f"instructions per inference are exact under QEMU -icount ({board}, --optimize {optimize}; limits: flash "
          f"{rows[0]['flash_limit_bytes']:,} B, RAM {rows[0]['ram_limit_bytes']:,} B)" if rows else "", file=sys.stderr)
    return rows


def peer_left_out(peers: str, err: TinydeployError, said: set) -> None:
    """A peer that cannot run: with --peers require the bench stops (the error), else one line
    on stderr (once per reason) and the bench goes on without it."""
    if peers == "require":
        raise err
    if str(err) not in said:
        said.add(str(err))
        print(f"[tinydeploy] peer left out: {err}", file=sys.stderr, flush=True)


def litert_median_ms(path: Path, tflite, feeds: dict, seconds: float, threads: int, peers: str, said: set):
    """(median ms, runs, twin) of LiteRT on the model's .tflite twin, or None (no twin, or LiteRT
    cannot run it: left out as `peers` says; a twin given with --tflite must run)."""
    from tinydeploy.runners import litert
    if peers == "none" and tflite is None:
        return None
    twin = litert.find_twin(path, tflite)
    if twin is None:
        return None
    try:
        return (*litert.median_ms(twin, feeds, seconds, threads), twin)
    except TinydeployError as e:
        peer_left_out("require" if tflite is not None else peers, e, said)
        return None


def bench(models: list[str], board: str = "host", seconds: float = 1.0, as_json: bool = False,
          threads: int = 1, max_weights_bytes=None, optimize: str = "balanced", emulate: bool = False,
          peers: str = "auto", tflite=None) -> list[dict]:
    from tinydeploy.targets import boards
    board_obj = boards.get_board(board)
    flow.check_threads(board_obj, threads)
    if board_obj.is_mcu:
        return bench_mcu(models, board, as_json, max_weights_bytes, optimize)
    if emulate:
        return bench_emulated(models, board_obj, as_json, threads, peers, max_weights_bytes)
    if tflite is not None and len(models) > 1 and not Path(tflite).is_dir():
        raise TinydeployError("--tflite names one .tflite file, for one model; for several, give the folder that "
                              "holds their twins (<model name>.tflite)")
    if tflite is not None:              # a twin given must run: its pieces are checked before any build
        from tinydeploy.runners import litert
        for m in models:
            litert.find_twin(Path(m), tflite)
        litert.interpreter_class()
    runner = runners.select_runner(board_obj)
    rows, said = [], set()
    for m in models:
        path = Path(m)
        b = flow.build(path, board, reuse=True, quiet=as_json, threads=threads, max_weights_bytes=max_weights_bytes)
        specs = flow.io_specs(b.summary, "inputs")
        feeds = reference.random_inputs(specs, 0)
        out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
        x = [feeds[n] for n, _, _ in specs]
        ours, runs = time_runs(runner, b.exe, x, out_specs, seconds)
        ort_ms, ort_runs = onnxruntime_median_ms(path, feeds, seconds, threads)
        lite = litert_median_ms(path, tflite, feeds, seconds, threads, peers, said)
        macs = b.summary["macs"]
        row = {"model": path.name, "board": board, "threads": threads, "median_ms": ours, "runs": runs,
               "onnxruntime_median_ms": ort_ms, "onnxruntime_runs": ort_runs, "ratio": ours / ort_ms,
               "gflops": 2 * macs / (ours * 1e6) if ours else None, "macs": macs,
               "arena_bytes": b.summary["arena_bytes"], "lower_bound_bytes": b.summary["lower_bound_bytes"]}
        if lite is not None:
            row.update(litert_median_ms=lite[0], litert_runs=lite[1], litert_model=str(lite[2]),
                       ratio_litert=ours / lite[0])
        rows.append(row)
    if as_json:
        print_json(rows)
        return rows
    each = f"{threads} thread{'s' if threads > 1 else ''} each"
    lite = any("litert_median_ms" in r for r in rows)
    print(f"{'model':<28} {'tinydeploy ms':>13} {'onnxruntime ms':>14} {'ratio':>7}"
          + (f" {'LiteRT ms':>10} {'ratio':>7}" if lite else "") + f" {'GFLOP/s':>8} {'arena B':>10}  ({each})")
    for r in rows:
        lr = ""
        if lite:
            lr = (f" {r['litert_median_ms']:>10.4f} {r['ratio_litert']:>7.2f}" if "litert_median_ms" in r
                  else f" {'-':>10} {'-':>7}")
        print(f"{printable(r['model'])[:28]:<28} {r['median_ms']:>13.4f} {r['onnxruntime_median_ms']:>14.4f} "
              f"{r['ratio']:>7.2f}{lr} {r['gflops']:>8.2f} {r['arena_bytes']:>10,}")
    print("ratio = tinydeploy / onnxruntime" + (" and tinydeploy / LiteRT (XNNPACK, on the .tflite twin)" if lite else "")
          + f" ({each}, same inputs, same run); < 1 means faster", file=sys.stderr)
    if threads > 1:
        print("OpenMP threads spin, then sleep between layers; on a machine shared with busy processes try "
              "OMP_WAIT_POLICY=passive (no spinning: helps large models, costs small ones a wake-up per layer)",
              file=sys.stderr)
    return rows


def counting_runner(board, threads: int):
    """The runner that counts a Linux board's build under user-mode QEMU; clear errors for a
    board that runs here and for threads."""
    runner = runners.select_runner(board, emulate=True)
    if not getattr(runner, "counts_instructions", False):
        raise TinydeployError(f"--emulate counts the instructions of a Linux board's build under user-mode QEMU "
                              f"(rpi4, jetson-orin, jetson-xavier); {board.id} runs natively here: leave --emulate out")
    if threads > 1:
        from tinydeploy.runners.icount import ONE_THREAD
        raise TinydeployError(ONE_THREAD)
    return runner


def onnx_input_order(path: Path) -> list[str]:
    """The model's inputs in ONNX order (onnxruntime's), initializers left out."""
    import onnx
    m = onnx.load(str(path), load_external_data=False)
    inits = {t.name for t in m.graph.initializer}
    return [i.name for i in m.graph.input if i.name not in inits]


def bench_emulated(models: list[str], board, as_json: bool, threads: int = 1, peers: str = "auto",
                   max_weights_bytes=None) -> list[dict]:
    """A Linux board's build under user-mode QEMU: exact instructions per inference (`run`'s
    count), next to onnxruntime's own library for the board counted the same way on the same
    inputs (runners/ort_aarch64.py), and their ratio."""
    from tinydeploy.runners.ort_aarch64 import OrtPeer
    counting_runner(board, threads)
    said, peer = set(), None
    if peers != "none":
        try:
            peer = OrtPeer(board)
        except TinydeployError as e:
            peer_left_out(peers, e, said)
    rows = []
    for m in models:
        path = Path(m)
        r = flow.run(path, board, quiet=as_json, emulate=True, max_weights_bytes=max_weights_bytes)
        b = flow.build(path, board, reuse=True, quiet=True, max_weights_bytes=max_weights_bytes)
        lat, macs = r["latency"], r["macs"]
        ins = lat["instructions"]
        row = {"model": path.name, "board": board.id, "emulated": True, "qemu": " ".join(board.qemu_user),
               "instructions": ins, "simd_fp_instructions": lat["simd_fp_instructions"],
               "fma_lanes": lat["fma_lanes"], "macs": macs, "macs_per_instruction": macs / ins if ins else None,
               "outputs_match": r["outputs_match"], "arena_bytes": r["memory"]["arena_bytes"]}
        if peer is not None:
            feeds = reference.random_inputs(flow.io_specs(b.summary, "inputs"), 0)     # run's inputs
            order = onnx_input_order(path)
            try:
                c = peer.count(path, [feeds[n] for n in (order if set(order) == set(feeds) else feeds)])
            except TinydeployError as e:
                peer_left_out(peers, e, said)
            else:
                row.update(onnxruntime_instructions=c.instructions, onnxruntime_simd_fp_instructions=c.simd_fp_instructions,
                           onnxruntime_fma_lanes=c.fma_lanes, onnxruntime_spread=list(c.spread),
                           onnxruntime_version=peer.version, ratio=ins / c.instructions)
        rows.append(row)
    if as_json:
        print_json(rows)
        return rows
    print(f"{'model':<28} {'tinydeploy':>14} {'onnxruntime':>14} {'ratio':>6} {'MACs/instr':>10} {'SIMD/FP':>7} "
          f"{'FMA/MAC':>7}  match")
    for r in rows:
        ort = f"{r['onnxruntime_instructions']:>14,} {r['ratio']:>6.2f}" if "ratio" in r else f"{'-':>14} {'-':>6}"
        print(f"{printable(r['model'])[:28]:<28} {r['instructions']:>14,} {ort} {r['macs_per_instruction']:>10.3f} "
              f"{100.0 * r['simd_fp_instructions'] / r['instructions']:>6.1f}% "
              f"{r['fma_lanes'] / r['macs'] if r['macs'] else 0.0:>7.2f}  {'yes' if r['outputs_match'] else 'NO'}")
    ort = next((r for r in rows if "ratio" in r), None)
    print(f"instructions per inference under {' '.join(board.qemu_user)}, counted by tinydeploy's QEMU plugin: "
          "tinydeploy's exact, onnxruntime's "
          + (f"{ort['onnxruntime_version']} (its linux-aarch64 library, 1 thread) the mean of 2 inferences after the "
             "first" if ort else "(left out)")
          + "; ratio = tinydeploy / onnxruntime, < 1 means fewer instructions; SIMD/FP = share of Advanced SIMD and "
          "FP instructions; FMA/MAC = fused multiply-add lanes per MAC", file=sys.stderr)
    return rows


def _print_counted_layers(title: str, layers: list[dict], unit: str, extra: tuple | None = None) -> None:
    """One line per layer of an exact count (`unit`: the rows' key, e.g. instructions): step, op,
    name, algorithm, MACs, the count, MACs per count, an `extra` column (header, value of a row)
    and the layer's share."""
    head, value = extra if extra else ("", None)
    print(title)
    print(f"{'step':>4}  {'op':<14} {'name':<24} {'algorithm':<44} {'MACs':>12} {unit:>13} {'MACs/instr':>10}"
          + (f" {head:>7}" if value else "") + f" {'share':>6}")
    for x in layers:
        name = x["name"] if len(x["name"]) <= 24 else "..." + x["name"][-21:]
        mpi = f"{x['macs'] / x[unit]:.3f}" if x["macs"] and x[unit] else "-"
        cost = f"{x[unit]:,.0f}" if x[unit] is not None else "-"
        print(f"{x['step']:>4}  {x['op'][:14]:<14} {name:<24} {x['algorithm'][:44]:<44} {x['macs']:>12,} {cost:>13} "
              f"{mpi:>10}" + (f" {value(x):>7}" if value else "") + f" {x['share_percent']:>5.1f}%")


def bench_layers_counted(models: list[str], board, as_json: bool, threads: int = 1, max_weights_bytes=None) -> list[dict]:
    """`bench --layers --emulate` of a Linux board: exact instructions per layer under user-mode
    QEMU (a -DTD_PROFILE build; the plugin counts between the hooks and leaves them out)."""
    runner = counting_runner(board, threads)
    results = []
    for m in models:
        path = Path(m)
        outdir = flow.default_outdir(path, board.id + "-emulated-profile")
        b = flow.build(path, board, outdir, reuse=True, quiet=as_json, extra_cflags=["-DTD_PROFILE"],
                       max_weights_bytes=max_weights_bytes)
        specs = flow.io_specs(b.summary, "inputs")
        feeds = reference.random_inputs(specs, 0)
        out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
        _, counted = runner.count(b.exe, [feeds[n] for n, _, _ in specs], out_specs, layers=True)
        table = b.summary["layer_table"]
        if len(counted.layers) != len(table):
            raise TinydeployError(f"{len(counted.layers)} layers counted, {len(table)} layers in the build "
                                  f"(was {printable(str(b.outdir))} built with -DTD_PROFILE?)")
        total = sum(c[0] for c in counted.layers) or 1
        rows = [{"step": step, "op": op, "name": name, "algorithm": algo, "macs": macs, "instructions": c[0],
                 "simd_fp_instructions": c[1], "fma_lanes": c[2], "macs_per_instruction": macs / c[0] if c[0] else None,
                 "share_percent": 100.0 * c[0] / total}
                for (step, op, name, algo, macs), c in zip(table, counted.layers)]
        results.append({"model": path.name, "board": board.id, "emulated": True, "counted": True,
                        "instructions": counted.instructions, "layers_instructions_sum": total,
                        "macs": b.summary["macs"], "layers": rows})
    if as_json:
        print_json(results)
        return results
    for r in results:
        _print_counted_layers(f"{r['model']} on {r['board']} (under {' '.join(board.qemu_user)}): instructions per "
                              "inference, per layer", r["layers"], "instructions",
                              ("FMA/MAC", lambda x: f"{x['fma_lanes'] / x['macs']:.2f}" if x["macs"] else "-"))
        mpi = r["macs"] / r["instructions"] if r["instructions"] else 0.0
        print(f"{'':>4}  {'total':<14} {'(whole inference)':<24} {'':<44} {r['macs']:>12,} {r['instructions']:>13,} "
              f"{mpi:>10.3f}")
    print("instructions per layer: exact, counted between the -DTD_PROFILE hooks (hooks left out); share = of the "
          "layers' sum; the total also holds the calls between layers", file=sys.stderr)
    return results


def bench_layers(models: list[str], board: str = "host", seconds: float = 1.0, as_json: bool = False,
                 emulate: bool = False, threads: int = 1, max_weights_bytes=None) -> list[dict]:
    """`bench --layers`: each layer's algorithm, MACs, median time, GFLOP/s and share of the time,
    from a build with -DTD_PROFILE (the harness times every layer of every timed run), so the
    next bottleneck is visible. Microcontroller boards: exact instructions per layer under QEMU;
    Linux boards with --emulate: exact instructions per layer under qemu-aarch64 (the plugin)."""
    from tinydeploy.targets import boards
    b_info = boards.get_board(board)
    if b_info.is_mcu:
        return bench_layers_mcu(models, board, as_json, max_weights_bytes)
    if emulate:
        return bench_layers_counted(models, b_info, as_json, threads, max_weights_bytes)
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
        print_json(results)
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


def bench_layers_mcu(models: list[str], board: str, as_json: bool, max_weights_bytes=None) -> list[dict]:
    """`bench --layers` on a microcontroller board: exact instructions per layer under QEMU, from
    the capture build's work counter around each layer (flow.layer_costs; DWT cycles on a real
    board come from `validate --port PORT --profile`), with MACs per instruction and share."""
    results = []
    for m in models:
        path = Path(m)
        prof = flow.layer_costs(path, board, emulate=True, quiet=as_json, max_weights_bytes=max_weights_bytes)
        costs, total = prof["costs"], sum(prof["costs"].values()) or 1.0
        rows = [{"step": step, "op": op, "name": name, "algorithm": algo, "macs": macs, prof["unit"]: costs.get(step),
                 "macs_per_instruction": macs / costs[step] if costs.get(step) and prof["unit"] == "instructions"
                 else None, "share_percent": 100.0 * (costs.get(step) or 0) / total}
                for step, op, name, algo, macs in prof["summary"]["layer_table"]]
        results.append({"model": path.name, "board": board, "emulated": True, "unit": prof["unit"],
                        "total": sum(prof["costs"].values()), "macs": prof["summary"]["macs"], "layers": rows})
    if as_json:
        print_json(results)
        return results
    for r in results:
        _print_counted_layers(f"{r['model']} on {r['board']} under QEMU: {r['unit']} per layer (exact, -icount)",
                              r["layers"], r["unit"])
        print(f"{'':>4}  {'total':<14} {'(layers)':<24} {'':<44} {r['macs']:>12,} {r['total']:>13,.0f}")
    print("counted around each layer's call alone by the capture build (-DTD_CAPTURE -DTD_PROFILE): the sum of the "
          "layers leaves out td_run's own few instructions", file=sys.stderr)
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
        print_json(rows)
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
    from tinydeploy.commands.common import labgrid_place, max_weights, optimize, threads
    p = sub.add_parser("bench", help="median latency of the generated code next to onnxruntime's")
    p.add_argument("models", nargs="+")
    p.add_argument("--board", help="board id (default host; with --lg-place the place's board)")
    p.add_argument("--seconds", type=float, default=1.0, help="time budget per measurement (default 1 s)")
    p.add_argument("--json", action="store_true")
    threads(p)
    p.add_argument("--layers", action="store_true", help="per layer: algorithm, MACs, median us, GFLOP/s, share "
                   "of the time (a build with -DTD_PROFILE); microcontroller boards: exact instructions per layer "
                   "under QEMU")
    p.add_argument("--emulate", action="store_true", help="a Linux board's build (rpi4, jetson-*) under user-mode "
                   "QEMU: exact instructions per inference (per layer with --layers), next to onnxruntime's")
    p.add_argument("--peers", choices=PEERS, default="auto", help="auto (default): peers that cannot run are left "
                   "out with one line saying why; require: they stop the bench; none: tinydeploy (and, on the "
                   "host, onnxruntime) only")
    p.add_argument("--tflite", metavar="PATH", help="the .tflite twin of the model for LiteRT (or a folder of "
                   "<model name>.tflite twins); default: M.tflite or tflite/M.tflite beside the model")
    labgrid_place(p, "microcontrollers: flash (emulated boards) and time on")
    max_weights(p)
    optimize(p)


def main(args, ctx) -> int:
    if args.tflite is not None and (args.layers or args.emulate or args.lg_place):
        raise TinydeployError("--tflite is for `bench` timing here (LiteRT runs in this process), not with --layers, "
                              "--emulate or --lg-place")
    if args.lg_place:
        if args.layers or args.threads != 1 or args.emulate:
            raise TinydeployError("--lg-place times a microcontroller place; --layers, --threads and --emulate are "
                                  "for Linux boards")
        bench_place(args.models, args.board, args.lg_place, args.lg_coordinator, args.lg_wait, args.json,
                    ctx.max_weights_bytes)
    elif args.layers:
        bench_layers(args.models, args.board or "host", args.seconds, args.json, args.emulate, args.threads,
                     ctx.max_weights_bytes)
    else:
        bench(args.models, args.board or "host", args.seconds, args.json, args.threads, ctx.max_weights_bytes,
              args.optimize, emulate=args.emulate, peers=args.peers, tflite=args.tflite)
    return 0
