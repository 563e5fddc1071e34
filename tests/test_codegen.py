"""Properties of the generated project: deterministic, self-describing, sharing kernels."""
import hashlib
import re

from tinydeploy import __version__, flow
from util import mlperf_model


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.suffix in (".c", ".h") or p.name == "Makefile"}


def test_output_is_byte_identical_for_identical_input(tmp_path):
    m = mlperf_model("kws_dscnn_fp32.onnx")
    a = flow.build(m, "host", tmp_path / "a", command="tinydeploy build x", quiet=True)
    b = flow.build(m, "host", tmp_path / "b", command="tinydeploy build x", quiet=True)
    assert _digest(a.outdir) == _digest(b.outdir)


def test_files_explain_themselves(tmp_path):
    m = mlperf_model("ic_resnet8_fp32.onnx")
    r = flow.build(m, "host", tmp_path / "p", command="tinydeploy build --board host ic.onnx", quiet=True)
    sha = hashlib.sha256(m.read_bytes()).hexdigest()
    for name in ("model.h", "model.c", "td_kernels.c", "td_weights.c"):
        text = (r.outdir / name).read_text()
        head = text[:600]
        assert f"tinydeploy {__version__}" in head and sha in head
        assert "tinydeploy build --board host ic.onnx" in head
    body = (r.outdir / "model.c").read_text()
    calls = re.findall(r"^    td_\w+\(", body, re.M)
    comments = re.findall(r"^    /\* \d+: ", body, re.M)
    assert len(comments) >= len(calls) > 0          # a comment per layer
    assert "malloc" not in "".join(p.read_text() for p in r.outdir.glob("*.c"))
    # weights are const arrays, the arena one static buffer
    assert re.search(r"^const float td_w\d+_\w+\[\d+\] = \{", (r.outdir / "td_weights.c").read_text(), re.M)
    assert body.count("static union") == 1


def test_identical_layers_share_one_kernel(tmp_path):
    r = flow.build(mlperf_model("kws_dscnn_fp32.onnx"), "host", tmp_path / "p", quiet=True)
    kernels = (r.outdir / "td_kernels.c").read_text()
    defined = re.findall(r"^void (td_\w+)\(", kernels, re.M)
    calls = re.findall(r"^    (td_\w+)\(", (r.outdir / "model.c").read_text(), re.M)
    assert len(set(defined)) == len(defined)
    assert len(defined) < len(calls), "KWS repeats its depthwise-separable block: layers must share code"
