"""One self-contained HTML page per rig run: per board and model pass/fail, the output difference
from onnxruntime in LSB, latency (instructions under QEMU, microseconds on hardware), flash and
RAM against the board's limits, and the device log of every failure. No scripts, no external files.

collect_report() turns pytest's per-phase reports (as plugin.py records them, also from xdist
workers) into one entry per test; write_html() renders them."""
from __future__ import annotations

import datetime
import html
import json
from pathlib import Path

ORDER = {"failed": 0, "error": 1, "passed": 3, "skipped": 2}


def collect_report(records: list[dict]) -> list[dict]:
    """One dict per test: nodeid, board, model, transport, outcome (passed, failed, error, skipped),
    duration, figures (merged record(**kw) values), message, log."""
    tests: dict[str, dict] = {}
    for r in records:
        t = tests.setdefault(r["nodeid"], {"nodeid": r["nodeid"], "board": None, "model": None, "transport": None,
                                           "outcome": "passed", "duration": 0.0, "figures": {}, "message": "",
                                           "log": ""})
        t["duration"] += r.get("duration") or 0.0
        for k, v in r.get("props", []):
            if k == "hil_board":
                t["board"] = v
            elif k == "hil_model":
                t["model"] = v
            elif k == "hil_transport":
                t["transport"] = v
            elif k == "hil":
                t["figures"].update(json.loads(v) if isinstance(v, str) else v)
            elif k == "hil_device_log":
                t["log"] = v
        if r["outcome"] == "failed":
            t["outcome"] = "failed" if r["when"] == "call" else "error"
            t["message"] = (t["message"] + "\n" + r.get("message", "")).strip()
        elif r["outcome"] == "skipped" and t["outcome"] == "passed":
            t["outcome"] = "skipped"
            t["message"] = r.get("message", "")
    return list(tests.values())


def summarize(tests: list[dict]) -> dict[str, dict[str, dict]]:
    """board -> model -> {passed, failed, skipped, lsb, latency, latency_unit, flash/ram used}."""
    out: dict[str, dict[str, dict]] = {}
    for t in tests:
        if not t["board"]:
            continue
        m = out.setdefault(t["board"], {}).setdefault(t["model"] or "(protocol and faults)", {
            "passed": 0, "failed": 0, "skipped": 0, "lsb": None, "latency": None, "latency_unit": "",
            "flash_used_bytes": None, "ram_used_bytes": None, "stack_used_bytes": None})
        m["failed" if t["outcome"] in ("failed", "error") else t["outcome"]] += 1
        f = t["figures"]
        if f.get("max_lsb") is not None:
            m["lsb"] = max(m["lsb"] or 0, f["max_lsb"])
        # the budget test's figure (seed 0, the one budgets.yml holds) wins over other tests'
        if f.get("latency") is not None and (m["latency"] is None or "measured" in f):
            m["latency"], m["latency_unit"] = f["latency"], f.get("latency_unit", "")
        for k in ("flash_used_bytes", "ram_used_bytes", "stack_used_bytes"):
            if f.get(k) is not None:
                m[k] = f[k]
    return out


CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f2f2f2} td.n{text-align:right;font-variant-numeric:tabular-nums}
.passed{background:#e6f4ea}.failed,.error{background:#fce8e6}.skipped{background:#fef7e0}
pre{background:#f7f7f7;border:1px solid #ddd;padding:.5em;overflow-x:auto;white-space:pre-wrap;max-height:30em}
.bar{display:inline-block;height:.7em;background:#4a90d9;vertical-align:middle}
.over{background:#d93025}
"""


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _num(v, unit="") -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:,.1f}{unit}"
    return f"{int(v):,}{unit}"


def _mem(used, limit) -> str:
    if used is None:
        return "–"
    if not limit:
        return f"{used:,} B"
    pct = used / limit * 100
    cls = "bar over" if used > limit else "bar"
    return (f"{used:,} / {limit:,} B ({pct:.1f}%) "
            f"<span class='{cls}' style='width:{min(pct, 100) * 0.8:.0f}px'></span>")


def _latency(v, unit) -> str:
    if v is None:
        return "–"
    if unit == "us":
        return f"{v:,.0f} µs"
    return f"{int(v):,} {_e(unit)}"


def render_html(tests: list[dict], meta: dict) -> str:
    tests = sorted(tests, key=lambda t: (t["board"] or "", t["model"] or "", t["nodeid"]))
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    summary = summarize(tests)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    verdict = "FAILED" if counts["failed"] or counts["error"] else "passed"
    h = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>hil report: {verdict}</title>",
         f"<style>{CSS}</style></head><body>",
         f"<h1>Hardware-in-the-loop report: {verdict}</h1>",
         f"<p>{when} · {len(tests)} tests: {counts['passed']} passed, {counts['failed']} failed, "
         f"{counts['error']} errors, {counts['skipped']} skipped · {meta.get('duration_s', 0):.0f} s"
         f"<br>command: <code>pytest {_e(meta.get('command', ''))}</code></p>"]
    boards = meta.get("boards", {})
    for board in sorted(set(summary) | set(boards)):
        b = boards.get(board, {})
        h.append(f"<h2>{_e(board)}</h2><p>{_e(b.get('name', ''))} · transport {_e(b.get('transport', '?'))}"
                 + (f" · manifest boards/{_e(b['manifest'])}.json" if b.get("manifest") else "")
                 + (f" · flash {b['flash_bytes']:,} B, RAM {b['ram_bytes']:,} B" if b.get("flash_bytes") else "")
                 + "</p>")
        h.append("<table><tr><th>model</th><th>tests</th><th>max diff vs onnxruntime</th><th>latency per inference</th>"
                 "<th>flash used / limit</th><th>RAM used / limit</th><th>stack used</th></tr>")
        for model, m in sorted(summary.get(board, {}).items()):
            cls = "failed" if m["failed"] else ("passed" if m["passed"] else "skipped")
            h.append(f"<tr class='{cls}'><td>{_e(model)}</td>"
                     f"<td>{m['passed']} passed, {m['failed']} failed, {m['skipped']} skipped</td>"
                     f"<td class='n'>{'–' if m['lsb'] is None else _num(m['lsb'], ' LSB')}</td>"
                     f"<td class='n'>{_latency(m['latency'], m['latency_unit'])}</td>"
                     f"<td>{_mem(m['flash_used_bytes'], b.get('flash_bytes'))}</td>"
                     f"<td>{_mem(m['ram_used_bytes'], b.get('ram_bytes'))}</td>"
                     f"<td class='n'>{_num(m['stack_used_bytes'], ' B')}</td></tr>")
        h.append("</table>")
        for model, why in sorted((meta.get("not_fitting") or {}).get(board, {}).items()):
            h.append(f"<p>not tested, does not fit: <b>{_e(model)}</b>: {_e(why)}</p>")
    failures = [t for t in tests if t["outcome"] in ("failed", "error")]
    if failures:
        h.append("<h2>Failures</h2>")
        for t in failures:
            h.append(f"<h3 class='{t['outcome']}'>{_e(t['nodeid'])}</h3>"
                     f"<pre>{_e(t['message'][-4000:])}</pre>")
            h.append("<p>device log:</p><pre>" + _e(t["log"] or "(no device log: the test failed before "
                                                            "talking to a board)") + "</pre>")
    h.append("<h2>All tests</h2><table><tr><th>test</th><th>board</th><th>model</th><th>outcome</th>"
             "<th>seconds</th><th>note</th></tr>")
    for t in tests:
        note = t["message"].strip().splitlines()[-1] if t["message"].strip() and t["outcome"] == "skipped" else ""
        h.append(f"<tr class='{t['outcome']}'><td>{_e(t['nodeid'])}</td><td>{_e(t['board'] or '')}</td>"
                 f"<td>{_e(t['model'] or '')}</td><td>{t['outcome']}</td><td class='n'>{t['duration']:.1f}</td>"
                 f"<td>{_e(note[:200])}</td></tr>")
    h.append("</table></body></html>\n")
    return "\n".join(h)


def write_html(path: Path, tests: list[dict], meta: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_html(tests, meta), encoding="utf-8")
    tmp.replace(path)
    return path
