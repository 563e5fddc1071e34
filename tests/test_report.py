"""`tinydeploy report`: one self-contained HTML file, checked as data (the arena picture's buffers,
its peak equal to arena_bytes, escaping of untrusted names, no scripts, no network) and rendered
in a real headless browser (Debian's chromium): the screenshot shows the tables and the pictures,
and the arena picture's tallest bar reaches the plot's top, which stands for arena_bytes."""
from __future__ import annotations

import re
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinydeploy import flow, report
from test_validate import cli, conv_bn_relu_model
from util import make_model, mlperf_model, require, save

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--hide-scrollbars",
                  "--force-device-scale-factor=0.5"]      # half the pixels to decode; the layout is the same
WIDTH, HEIGHT = 1400, 1800                              # CSS pixels: the screenshot is 700 x 900


def read_png(path: Path) -> np.ndarray:
    """An 8-bit RGB(A) non-interlaced PNG (chromium's screenshots) as an [H, W, 3] array."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h, ch = 8, b"", 0, 0, 4
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
            ch = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + w * ch)
    out = np.zeros((h, w * ch), np.uint8)
    prev = np.zeros(w * ch, np.int32)
    for y in range(h):
        f, line = int(raw[y, 0]), raw[y, 1:].astype(np.int32)
        if f == 0:
            cur = line
        elif f == 2:
            cur = (line + prev) & 255
        elif f == 1:          # Sub: a running sum per channel
            cur = np.cumsum(line.reshape(w, ch), axis=0).reshape(-1) & 255
        else:                 # Average, Paeth: pixel by pixel
            cur, lp, pp = [0] * (w * ch), line.tolist(), prev.tolist()
            for x in range(w * ch):
                a = cur[x - ch] if x >= ch else 0
                b, c = pp[x], (pp[x - ch] if x >= ch else 0)
                if f == 3:
                    pred = (a + b) >> 1
                else:
                    q = a + b - c
                    pa, pb, pc = abs(q - a), abs(q - b), abs(q - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[x] = (lp[x] + pred) & 255
            cur = np.array(cur, np.int32)
        out[y], prev = cur, cur
    return out.reshape(h, w, ch)[:, :, :3]


def screenshot(html: Path, tmp_path: Path) -> np.ndarray:
    chromium = require("chromium")
    png = tmp_path / "shot.png"
    r = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--window-size={WIDTH},{HEIGHT}", f"--screenshot={png}",
                        html.resolve().as_uri()], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and png.is_file(), r.stderr[-2000:]
    return read_png(png)


def arena_svg(page: str) -> ET.Element:
    m = re.search(r'<svg id="arena".*?</svg>', page, re.S)
    assert m, "no arena picture"
    return ET.fromstring(m.group(0))


def check_report(page: str, img: np.ndarray, arena_bytes: int) -> None:
    # as data: the buffers' highest byte is arena_bytes, and the plot's top stands for it
    svg = arena_svg(page)
    ns = "{http://www.w3.org/2000/svg}"
    bars = [r for r in svg.iter(ns + "rect") if r.get("class") == "buf"]
    assert bars and int(svg.get("data-arena-bytes")) == arena_bytes
    assert max(int(r.get("data-offset")) + int(r.get("data-bytes")) for r in bars) == arena_bytes
    top, height = float(svg.get("data-plot-top")), float(svg.get("data-plot-height"))
    assert min(float(r.get("y")) for r in bars) == pytest.approx(top, abs=0.01)
    assert max(float(r.get("y")) + float(r.get("height")) for r in bars) <= top + height + 0.01
    assert "<script" not in page.lower() and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert page.count("<table") == 1 and "<th>arena offset</th>" in page and "<th>why</th>" in page
    # rendered: find the plot by its background colour, bars inside it, the tallest touching its top
    bg = np.array([int(report.PLOT_BG[i:i + 2], 16) for i in (1, 3, 5)], np.uint8)
    ys, xs = np.nonzero((img == bg).all(axis=2))
    assert ys.size > 2000, "the arena picture did not render"
    y0, y1, x0, x1 = ys.min(), ys.max(), xs.min(), xs.max()
    plot = img[y0:y1 + 1, x0:x1 + 1]
    white = (plot >= 250).all(axis=2)
    colour = ~(plot == bg).all(axis=2) & ~white
    assert colour.mean() > 0.05, "no bars in the arena picture"
    rows = np.nonzero(colour.sum(axis=1) > 2)[0]
    assert rows.min() <= 1, f"the tallest bar stops {rows.min()} px below the plot's top (arena_bytes)"
    # the tables rendered: their grey header cells and dark text below the pictures
    below = img[y1 + 20:, :]
    assert ((below == 0xF3).all(axis=2)).sum() > 500, "no table header below the picture"
    assert (below < 100).all(axis=2).sum() > 500, "no table text below the picture"


@pytest.mark.models
def test_kws_int8_on_nano33ble_renders(tmp_path):
    require("arm-none-eabi-gcc")
    out = tmp_path / "kws.html"
    code, stdout, err = cli("report", mlperf_model("kws_dscnn_int8.onnx"), "--board", "nano33ble", "-o", out,
                            "--outdir", tmp_path / "fw")
    assert code == 0, err
    page = out.read_text()
    b = flow.build(mlperf_model("kws_dscnn_int8.onnx"), "nano33ble", tmp_path / "fw", reuse=True, quiet=True,
                   builder="make")
    fw = b.summary["firmware"]
    assert f"{fw['flash_used_bytes']:,} of {fw['flash_bytes']:,} B" in page
    assert f"{fw['ram_used_bytes']:,} of {fw['ram_bytes']:,} B" in page
    assert "cortex-m4-dsp" in page and "td_qconv2d_s8_0" in page
    check_report(page, screenshot(out, tmp_path), b.summary["arena_bytes"])
    # again over it: it is ours; a file that is not a report is refused
    assert cli("report", mlperf_model("kws_dscnn_int8.onnx"), "--board", "nano33ble", "-o", out,
               "--outdir", tmp_path / "fw")[0] == 0
    (tmp_path / "notes.html").write_text("mine")
    code, _, err = cli("report", mlperf_model("kws_dscnn_int8.onnx"), "--board", "nano33ble", "-o",
                       tmp_path / "notes.html", "--outdir", tmp_path / "fw")
    assert code == 2 and "not a tinydeploy report" in err and (tmp_path / "notes.html").read_text() == "mine"


@pytest.mark.slow
def test_resnet50_on_host_renders(resnets, tmp_path):
    out = tmp_path / "r50.html"
    code, _, err = cli("report", resnets["resnet50"], "-o", out)
    assert code == 0, err
    page = out.read_text()
    arena = int(arena_svg(page).get("data-arena-bytes"))
    assert f"{arena:,} B" in page and "no limit" in page
    check_report(page, screenshot(out, tmp_path), arena)


def test_profile_hostile_names_and_same_bytes(tmp_path):
    """Names the model supplies reach the page only escaped; the same inputs give the same bytes;
    --profile adds the cost chart."""
    m = conv_bn_relu_model()
    for n in m.graph.node:
        n.name = '<script>alert("x")</script>&' + n.name
    path = save(m, tmp_path, "<b>model.onnx")
    out = tmp_path / "r.html"
    assert cli("report", path, "-o", out)[0] == 0
    page = out.read_text()
    assert "<script" not in page and "&lt;script&gt;" in page and "&lt;b&gt;model.onnx" in page
    assert page.startswith("<!DOCTYPE html>\n" + report.MARK) and 'id="cost"' not in page
    assert cli("report", path, "-o", out)[0] == 0 and out.read_text() == page
    code, _, err = cli("report", path, "-o", out, "--profile")
    assert code == 0, err
    assert 'id="cost"' in out.read_text() and "us (median)" in out.read_text()
