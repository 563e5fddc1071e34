"""`tinydeploy report`: one self-contained HTML file about a compiled model (X-CUBE-AI's analyze,
with pictures): the per-layer table (operator, shapes, MACs, weight bytes, the kernel chosen and
why, where its outputs and scratch live in the arena), a picture of the arena over the schedule,
flash and RAM against the board's limits, per-layer cost when measured, and `validate`'s results
when given (its error columns). No network and no scripts: inline CSS and SVG, tooltips as SVG
<title>s. Everything the model supplies (names, operators) is escaped; the file depends only on
its inputs (no timestamps), and a file that is not a tinydeploy report is never overwritten
without force.

The input is data: `facts` (flow.report_facts: the build summary's schedule and memory, the
board's limits), `validation` (flow.validate's result) and `profile` (unit, {step: cost})."""
from __future__ import annotations

import html
import os
import re
import tempfile
from pathlib import Path

from tinydeploy import __version__
from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError

MARK = "<!-- tinydeploy report -->"
ARENA_W, ARENA_H = 960, 320          # the arena picture's plot area, in CSS pixels
ARENA_PAD = (72, 16, 34, 30)         # left, top, bottom, right margins around it
PALETTE = {"input": "#4c78a8", "output": "#e45756", "tensor": "#72b7b2", "scratch": "#b279a2"}
PLOT_BG = "#fbfaf3"                   # the arena plot's background (tests find the picture by it)


def esc(s, limit: int = 300) -> str:
    """Untrusted text for HTML: printable (no control characters), shortened, escaped."""
    return html.escape(printable(str(s), limit), quote=True)


def _n(v) -> str:
    return f"{v:,}" if isinstance(v, int) else ("-" if v is None else esc(v))


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def kernel_why(step: dict) -> str:
    """Why a layer got its kernel, from the schedule's description and ISA."""
    k = step.get("kernel")
    if not k:
        return "no code: a view of its input's bytes" if step["outputs"] else ""
    desc, isa = k["desc"], k.get("isa") or "ref"
    m = re.match(r"\[([^\]]*)\]", desc)
    algo = m.group(1) if m else ""
    if " tuned" in f" {algo} ".replace("]", " "):
        return "measured fastest for this layer shape (`tinydeploy tune`, the tuning database)"
    if algo.startswith("ref direct"):
        return "the portable direct kernel: no faster algorithm applies, or none pays off at this size"
    if algo.startswith("cortex-m"):
        return f"the {algo.split()[0]} variant: {algo.split(' ', 1)[1] if ' ' in algo else 'for this core'}"
    if algo:
        return "least estimated cost of the algorithms that apply (the cost model, schedule/cost.py)"
    if isa != "ref":
        return f"the {isa} variant of {k['family']}"
    return "the portable kernel"


def _buffers_kind(buf: dict, schedule: dict) -> str:
    names = set(buf["tensors"])
    if any(n.startswith("#scratch") for n in names):
        return "scratch"
    if names & set(schedule["inputs"]):
        return "input"
    if names & set(schedule["outputs"]):
        return "output"
    return "tensor"


def peak(schedule: dict) -> tuple[int, int, int]:
    """(step where the most bytes are live, those bytes, the highest byte in use then)."""
    steps = max(len(schedule["steps"]), 1)
    best = (0, -1, 0)
    for k in range(steps):
        live = [b for b in schedule["buffers"] if b["first"] <= k <= b["last"]]
        total = sum(b["bytes"] for b in live)
        if total > best[1]:
            best = (k, total, max((b["offset"] + b["bytes"] for b in live), default=0))
    return best[0], max(best[1], 0), best[2]


def arena_svg(schedule: dict) -> str:
    """Each buffer a bar from the step that writes it to the last that reads it, at its offset;
    the arena's top (arena_bytes) is the plot's top; the step with the most bytes live is marked."""
    steps = max(len(schedule["steps"]), 1)
    arena = max(schedule["arena_bytes"], 1)
    left, top, bottom, right = ARENA_PAD
    W, H = ARENA_W + left + right, ARENA_H + top + bottom
    sx, sy = ARENA_W / steps, ARENA_H / arena

    def y(off: float) -> float:
        return top + ARENA_H - off * sy

    pk, live, _ = peak(schedule)
    out = [f'<svg id="arena" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           f'data-arena-bytes="{schedule["arena_bytes"]}" data-plot-top="{top}" data-plot-height="{ARENA_H}" '
           f'data-plot-left="{left}" data-plot-width="{ARENA_W}" data-peak-step="{pk}" role="img">',
           f'<title>arena: {schedule["arena_bytes"]:,} bytes over {steps} steps</title>',
           f'<rect x="{left}" y="{top}" width="{ARENA_W}" height="{ARENA_H}" fill="{PLOT_BG}"/>']
    for b in sorted(schedule["buffers"], key=lambda b: (b["offset"], b["first"])):
        kind = _buffers_kind(b, schedule)
        x0, x1 = left + b["first"] * sx, left + (b["last"] + 1) * sx
        y0, y1 = min(y(b["offset"] + b["bytes"]), y(b["offset"]) - 0.5), y(b["offset"])   # at least half a pixel
        names = ", ".join(printable(t, 80) for t in b["tensors"][:4]) + (" ..." if len(b["tensors"]) > 4 else "")
        out.append(f'<rect class="buf" x="{x0:.2f}" y="{y0:.2f}" width="{max(x1 - x0, 0.5):.2f}" '
                   f'height="{y1 - y0:.2f}" fill="{PALETTE[kind]}" stroke="#ffffff" stroke-width="0.5" '
                   f'data-offset="{b["offset"]}" data-bytes="{b["bytes"]}" data-first="{b["first"]}" '
                   f'data-last="{b["last"]}"><title>{html.escape(names)}: {b["bytes"]:,} B at offset {b["offset"]:,}, '
                   f'steps {b["first"]}..{b["last"]} ({kind})</title></rect>')
    px = left + (pk + 0.5) * sx
    out.append(f'<line x1="{px:.2f}" y1="{top}" x2="{px:.2f}" y2="{top + ARENA_H}" stroke="#222" '
               f'stroke-dasharray="4 3" stroke-width="1"/>')
    out.append(f'<text x="{min(px + 4, left + ARENA_W - 4):.2f}" y="{top + 12}" font-size="11" fill="#222" '
               f'text-anchor="{"start" if px < left + ARENA_W * 0.7 else "end"}">peak: step {pk}, {live:,} B live</text>')
    # axes: offsets (0 and arena_bytes) and steps
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ARENA_H}" stroke="#444"/>')
    out.append(f'<line x1="{left}" y1="{top + ARENA_H}" x2="{left + ARENA_W}" y2="{top + ARENA_H}" stroke="#444"/>')
    out.append(f'<text x="{left - 6}" y="{top + 4}" font-size="11" text-anchor="end">{arena:,} B</text>')
    out.append(f'<text x="{left - 6}" y="{top + ARENA_H}" font-size="11" text-anchor="end">0</text>')
    for k in sorted({0, steps - 1, *range(0, steps, max(1, steps // 10))}):
        tx = left + (k + 0.5) * sx
        out.append(f'<text x="{tx:.2f}" y="{top + ARENA_H + 14}" font-size="10" text-anchor="middle">{k}</text>')
    out.append(f'<text x="{left + ARENA_W / 2}" y="{H - 4}" font-size="11" text-anchor="middle">schedule step</text>')
    out.append("</svg>")
    return "\n".join(out)


def bars_svg(rows: list[tuple[str, int, int | None]], svg_id: str) -> str:
    """Horizontal bars: (label, used, limit); a bar without a limit is drawn against the largest."""
    width, lw, bh, gap = 760, 150, 22, 12
    scale = max([r[2] or r[1] for r in rows] + [1])
    out = [f'<svg id="{svg_id}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{len(rows) * (bh + gap) + gap}" role="img">']
    for k, (label, used, limit) in enumerate(rows):
        y0 = gap + k * (bh + gap)
        full = width - lw - 200
        total = limit or scale
        u = full * used / total if total else 0
        out.append(f'<text x="{lw - 8}" y="{y0 + 15}" font-size="12" text-anchor="end">{html.escape(label)}</text>')
        out.append(f'<rect x="{lw}" y="{y0}" width="{full}" height="{bh}" fill="#eeeeee"/>')
        color = "#e45756" if limit and used > limit else "#4c78a8"
        out.append(f'<rect x="{lw}" y="{y0}" width="{min(u, full):.2f}" height="{bh}" fill="{color}"/>')
        what = f"{used:,} of {limit:,} B ({100 * used / limit:.1f}%)" if limit else f"{used:,} B (no limit)"
        out.append(f'<text x="{lw + full + 8}" y="{y0 + 15}" font-size="12">{what}</text>')
    out.append("</svg>")
    return "\n".join(out)


def cost_svg(schedule: dict, costs: dict, unit: str) -> str:
    """Per-layer cost as horizontal bars, one per layer with code, in schedule order."""
    steps = [s for s in schedule["steps"] if s["code"]]
    width, lw, bh = 960, 260, 14
    top = max([costs.get(s["step"]) or 0 for s in steps] + [1])
    out = [f'<svg id="cost" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{len(steps) * (bh + 3) + 8}" '
           f'role="img">']
    for k, s in enumerate(steps):
        v = costs.get(s["step"]) or 0
        y0 = 4 + k * (bh + 3)
        w = (width - lw - 140) * v / top
        out.append(f'<text x="{lw - 6}" y="{y0 + 11}" font-size="10" text-anchor="end">{s["step"]}: '
                   f'{esc(s["onnx_op"], 40)}</text>')
        out.append(f'<rect x="{lw}" y="{y0}" width="{w:.2f}" height="{bh}" fill="#f58518"><title>{v:,.0f} '
                   f'{html.escape(unit)}</title></rect>')
        out.append(f'<text x="{lw + w + 6:.2f}" y="{y0 + 11}" font-size="10">{v:,.0f}</text>')
    out.append("</svg>")
    return "\n".join(out)


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 22px; margin: 0 0 4px 0; } h2 { font-size: 17px; margin: 28px 0 8px 0; }
.meta { color: #555; font-size: 13px; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; margin: 14px 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 120px; }
.card b { display: block; font-size: 18px; } .card span { color: #666; font-size: 12px; }
table { border-collapse: collapse; font-size: 12px; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; position: sticky; top: 0; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.bad td { background: #fde8e8; } tr.first td { background: #f9c6c6; font-weight: 600; }
.legend span { display: inline-block; margin-right: 14px; font-size: 12px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -2px; }
.why { color: #444; } .ok { color: #2a7d2a; } .fail { color: #b00020; }
code { font-size: 11px; word-break: break-all; }
"""


def _shape(s) -> str:
    return "x".join(map(str, s))


def render(facts: dict, validation: dict | None = None, profile: dict | None = None) -> str:
    """The report's HTML. profile = {"unit", "what", "costs": {step: cost}} (also taken from the
    validation's per-layer costs when it has them)."""
    sched = facts["schedule"]
    rows_v = {}
    if validation:
        for r in validation["layers"]:
            rows_v.setdefault(r["step"], r)
        if profile is None and validation.get("profile"):
            profile = dict(validation["profile"], costs={r["step"]: r.get("cost") for r in validation["layers"]
                                                         if r.get("cost") is not None})
    first = (validation or {}).get("first_divergent_layer")
    shapes = dict(sched.get("input_shapes", {}))
    for st in sched["steps"]:
        for o in st["outputs"]:
            shapes[o["name"]] = o["shape"]
    fw = facts.get("firmware")
    pk, live, _ = peak(sched)
    h = [f"<!DOCTYPE html>\n{MARK}\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
         f"<title>{esc(facts['model'])} on {esc(facts['board'])}: tinydeploy report</title>",
         f"<style>{CSS}</style></head><body>",
         f"<h1>{esc(facts['model'])} on {esc(facts['board_name'])}</h1>",
         f"<div class=\"meta\">tinydeploy {esc(__version__)} &middot; board <code>{esc(facts['board'])}</code> &middot; "
         f"model SHA-256 <code>{esc(facts.get('sha256') or '-')}</code>"
         + (" &middot; validation build (with the capture hooks)" if facts.get("capture_build") else "") + "</div>",
         "<div class=\"cards\">",
         f"<div class=\"card\"><b>{facts['layers']}</b><span>layers with code ({len(sched['steps'])} steps)</span></div>",
         f"<div class=\"card\"><b>{facts['macs']:,}</b><span>MACs per inference</span></div>",
         f"<div class=\"card\"><b>{facts['weights_bytes']:,} B</b><span>weights</span></div>",
         f"<div class=\"card\"><b>{sched['arena_bytes']:,} B</b><span>arena (lower bound "
         f"{sched['lower_bound_bytes']:,} B)</span></div>"]
    if validation:
        ok = validation["outputs_match"]
        h.append(f"<div class=\"card\"><b class=\"{'ok' if ok else 'fail'}\">{'match' if ok else 'DIFFER'}</b>"
                 f"<span>outputs against the {'oracle' if validation['reference'] == 'oracle' else 'onnxruntime'} "
                 f"({esc(validation['where'])})</span></div>")
    if profile and profile.get("costs"):
        h.append(f"<div class=\"card\"><b>{sum(profile['costs'].values()):,.0f}</b><span>{esc(profile['what'])} "
                 "per inference (sum of the layers)</span></div>")
    h.append("</div>")

    h.append("<h2>Memory against the board</h2>")
    bars = []
    if fw:
        bars += [("flash", fw["flash_used_bytes"], fw["flash_bytes"]), ("RAM", fw["ram_used_bytes"], fw["ram_bytes"])]
    else:
        limit = facts.get("ram_limit_bytes")
        bars += [("weights", facts["weights_bytes"], facts.get("flash_limit_bytes")),
                 ("arena", sched["arena_bytes"], limit)]
    h.append(bars_svg(bars, "memory"))
    if fw:
        h.append(f"<div class=\"meta\">RAM = arena {sched['arena_bytes']:,} B + input buffer "
                 f"{fw.get('input_buffer_bytes', 0):,} B + stack reserve {fw.get('stack_reserved_bytes', 0):,} B + the "
                 "harness; flash = code, weights and initialised data, from the linked firmware</div>")
    else:
        h.append("<div class=\"meta\">a Linux board: no fixed flash or RAM limit in its manifest</div>")

    h.append("<h2>The arena over the schedule</h2>")
    h.append("<div class=\"legend\">" + "".join(f"<span><i style=\"background:{c}\"></i>{k}</span>"
                                                for k, c in PALETTE.items()) + "</div>")
    h.append(arena_svg(sched))
    h.append(f"<div class=\"meta\">each bar: a buffer from the step that writes it to the last that reads it, at its "
             f"offset; the plot's top is the arena's size, {sched['arena_bytes']:,} B; dashed: step {pk}, where the "
             f"most bytes are live ({live:,} B, the lower bound)</div>")

    if profile and profile.get("costs"):
        h.append(f"<h2>Cost per layer: {esc(profile['what'])}</h2>")
        h.append(cost_svg(sched, profile["costs"], profile["unit"] or ""))

    if validation:
        h.append("<h2>Validation</h2>")
        out = validation["outputs"]
        h.append(f"<p>{esc(validation['model'])} {esc(validation['where'])}, {validation['samples']} sample(s); "
                 f"outputs <b class=\"{'ok' if validation['outputs_match'] else 'fail'}\">"
                 f"{'match' if validation['outputs_match'] else 'DIFFER'}</b> (max abs error "
                 f"{_f(out.get('max_abs_error'), '.3g')}{' LSB' if out.get('tolerance_unit') == 'LSB' else ''}, "
                 f"tolerance {_f(out.get('tolerance'), 'g')}). ")
        if first:
            h.append(f"First layer beyond the tolerance: <b>step {first['step']}</b> ({esc(first['op'])}, "
                     f"<code>{esc(first['name'] or first['tensor'], 200)}</code>). "
                     f"<span class=\"why\">{esc(first.get('why') or '', 600)}</span>")
        else:
            h.append("Every layer is within the tolerance (8-bit: 1 LSB; float: relative 1e-4, norm-wise).")
        h.append("</p>")
        ds = validation.get("dataset")
        if ds:
            acc = ds.get("accuracy")
            h.append(f"<p>Data set: {ds['samples']} samples; first output L2r {_f(ds['l2r'], '.3g')}, MAE "
                     f"{_f(ds['mae'], '.3g')}, RMSE {_f(ds['rmse'], '.3g')}, cosine {_f(ds['cosine'], '.6f')}; top-1 "
                     f"agreement {100 * ds['top1_agreement']:.1f}%"
                     + (f"; accuracy {100 * acc['target']:.1f}% (reference {100 * acc['reference']:.1f}%)" if acc
                        else "") + "</p>")

    h.append("<h2>Layers</h2>")
    head = ["step", "operator", "node", "inputs", "outputs", "MACs", "weights B", "kernel", "why", "arena offset",
            "bytes", "scratch B"]
    if validation:
        head += ["max |err|", "LSB", "identical", "cosine", "rel L2", "SNR dB", "cause"]
    if profile and profile.get("costs"):
        head.append(esc(profile["unit"] or "cost"))
    h.append("<table id=\"layers\"><thead><tr>" + "".join(f"<th>{c}</th>" for c in head) + "</tr></thead><tbody>")
    for st in sched["steps"]:
        k = st.get("kernel")
        v = rows_v.get(st["step"])
        cls = ""
        if v is not None and first and v["step"] == first["step"]:
            cls = " class=\"first\""
        elif v is not None and v.get("within_tolerance") is False:
            cls = " class=\"bad\""
        ins = "<br>".join(_shape(shapes.get(i) or []) for i in st["inputs"])
        outs = "<br>".join(_shape(o["shape"]) + " " + esc(o["dtype"]) for o in st["outputs"])
        offs = "<br>".join(_n(o.get("offset")) for o in st["outputs"])
        sizes = "<br>".join(_n(o["bytes"]) for o in st["outputs"])
        kern = (f"<code>{esc(k['function'] or k['family'])}</code> ({esc(k.get('isa') or 'ref')})<br>"
                f"<span class=\"why\">{esc(k['desc'], 200)}</span>") if k else "view (no code)"
        scratch = f"{k['scratch_bytes']:,} @ {_n(k.get('scratch_offset'))}" if k and k["scratch_bytes"] else "-"
        cells = [str(st["step"]), esc(st["onnx_op"], 60), f"<code>{esc(st['name'], 120)}</code>", ins, outs,
                 _n(st["macs"]), _n(st["weights_bytes"]), kern, esc(kernel_why(st), 200), offs, sizes, scratch]
        num = {0, 5, 6, 9, 10}
        if validation:
            if v is not None and "max_abs_error" in v:
                snr = "inf" if v.get("snr_db") is None and v.get("max_abs_error") == 0 else _f(v.get("snr_db"), ".1f")
                cells += [_f(v.get("max_abs_error"), ".3g"), _f(v.get("max_lsb"), "d"),
                          _f(None if v.get("identical_fraction") is None else 100 * v["identical_fraction"], ".2f") + "%",
                          _f(v.get("cosine"), ".6f"), _f(v.get("rel_l2"), ".2e"), snr,
                          esc(v.get("cause") or "", 40) + (f"<br><span class=\"why\">{esc(v['why'], 300)}</span>"
                                                           if v.get("why") and v.get("within_tolerance") is False else "")]
            else:
                cells += ["-"] * 7
            num |= {12, 13, 14, 15, 16, 17}
        if profile and profile.get("costs"):
            c = profile["costs"].get(st["step"])
            cells.append(_f(c, ",.0f"))
            num.add(len(cells) - 1)
        h.append(f"<tr{cls}>" + "".join(f"<td class=\"n\">{c}</td>" if i in num else f"<td>{c}</td>"
                                          for i, c in enumerate(cells)) + "</tr>")
    h.append("</tbody></table>")
    if facts.get("notes"):
        h.append("<h2>Notes</h2><ul>" + "".join(f"<li>{esc(n, 400)}</li>" for n in facts["notes"]) + "</ul>")
    h.append("</body></html>\n")
    return "\n".join(h)


def check_path(path: Path, force: bool = False) -> Path:
    """Refuses a report path that would lose something the user owns: a file that is not a
    tinydeploy report (without force), a folder, a symbolic link, a missing folder."""
    path = Path(path)
    if path.is_symlink():
        raise TinydeployError(f"{printable(str(path))!r} is a symbolic link; choose another report path")
    if path.exists():
        if path.is_dir():
            raise TinydeployError(f"{printable(str(path))!r} is a folder; give the report's file name")
        with open(path, "rb") as f:
            ours = MARK.encode() in f.read(200)
        if not ours and not force:
            raise TinydeployError(f"{printable(str(path))!r} exists and is not a tinydeploy report; choose another "
                                  "path or pass --force")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise TinydeployError(f"folder {printable(str(folder))!r} does not exist")
    return path


def write(path: Path, facts: dict, validation: dict | None = None, profile: dict | None = None,
          force: bool = False) -> Path:
    """Writes the report to `path` (check_path: a file there is replaced only when it is a
    tinydeploy report, or with force); a symbolic link is never followed (the text goes to a
    temporary name in the same folder, renamed over the path)."""
    path = check_path(path, force)
    text = render(facts, validation, profile)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
