"""`tinydeploy bench`: the generated code's latency next to onnxruntime's (1 thread), measured
in the same run on the same inputs, and their ratio. A benchmark, not a test: the machine is
shared, so only the ratio between peers measured together means much."""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from tinydeploy import flow, reference


def onnxruntime_median_ms(model: Path, feeds: dict, budget_s: float) -> tuple[float, int]:
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    t0 = time.perf_counter()
    sess.run(None, feeds)
    once = max(time.perf_counter() - t0, 1e-5)
    runs = int(min(1000, max(3, budget_s / once)))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000.0, runs


def bench_mcu(models: list[str], board: str, as_json: bool) -> list[dict]:
    """Microcontroller boards, under QEMU: exact instructions per inference (the figure to
    optimise on Cortex-M), MACs per instruction, arena, flash and RAM."""
    rows = []
    for m in models:
        r = flow.run(Path(m), board, quiet=as_json, emulate=True)
        macs = _macs_of(Path(m), board)
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


def _macs_of(model: Path, board: str) -> int:
    from tinydeploy import boards
    from tinydeploy.pipeline import compile_model
    from tinydeploy.targets import get_target
    return compile_model(model, get_target(boards.get_board(board)["target"]), board=board).macs


def bench(models: list[str], board: str = "host", seconds: float = 1.0, as_json: bool = False) -> list[dict]:
    from tinydeploy import boards
    if boards.get_board(board)["kind"] == "mcu":
        return bench_mcu(models, board, as_json)
    rows = []
    for m in models:
        path = Path(m)
        b = flow.build(path, board, reuse=True, quiet=as_json)
        specs = flow.io_specs(b.summary, "inputs")
        feeds = reference.random_inputs(specs, 0)
        out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
        x = [feeds[n] for n, _, _ in specs]
        ours, runs = flow.measure_runs(b.exe, x, out_specs, seconds)
        ort_ms, ort_runs = onnxruntime_median_ms(path, feeds, seconds)
        macs = b.summary["macs"]
        rows.append({"model": path.name, "board": board, "median_ms": ours, "runs": runs,
                     "onnxruntime_median_ms": ort_ms, "onnxruntime_runs": ort_runs, "ratio": ours / ort_ms,
                     "gflops": 2 * macs / (ours * 1e6) if ours else None, "macs": macs,
                     "arena_bytes": b.summary["arena_bytes"], "lower_bound_bytes": b.summary["lower_bound_bytes"]})
    if as_json:
        print(json.dumps(rows))
        return rows
    print(f"{'model':<28} {'tinydeploy ms':>13} {'onnxruntime ms':>14} {'ratio':>7} {'GFLOP/s':>8} {'arena B':>10}")
    for r in rows:
        print(f"{r['model']:<28} {r['median_ms']:>13.4f} {r['onnxruntime_median_ms']:>14.4f} {r['ratio']:>7.2f} "
              f"{r['gflops']:>8.2f} {r['arena_bytes']:>10,}")
    print("ratio = tinydeploy / onnxruntime (1 thread each, same inputs, same run); < 1 means faster",
          file=sys.stderr)
    return rows
