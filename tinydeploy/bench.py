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


def bench(models: list[str], board: str = "host", seconds: float = 1.0, as_json: bool = False) -> list[dict]:
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
