"""The kernel tuner and its database (tinydeploy/schedule/tuner.py, tinydeploy/schedule/tuning), per-layer timing
(`bench --layers`, the TD_PROFILE hooks) and `build`'s per-layer algorithm lines."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper

from tinydeploy import cli, flow, reference, targets
from tinydeploy import schedule
from tinydeploy.schedule import cost
from tinydeploy.schedule import tuner as tune
from tinydeploy.schedule import tuning
from tinydeploy.errors import TinydeployError
from tinydeploy.pipeline import compile_model
from tinydeploy.runners import select_runner
from tinydeploy.runners.harness import time_runs
from tinydeploy.runners.local import LocalRunner
from tinydeploy.runners.ssh import SshRunner
from util import make_model, save


def two_layer_model():
    """3x3 conv + relu, then a 1x1 conv: two distinct fp32 layer shapes."""
    rng = np.random.default_rng(7)

    def t(name, shape):
        return helper.make_tensor(name, TensorProto.FLOAT, shape, (rng.standard_normal(shape) * 0.2).astype(np.float32).ravel())
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["y"], kernel_shape=[1, 1])]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 12])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 12, 12])],
                      [t("w1", [16, 8, 3, 3]), t("b1", [16]), t("w2", [16, 16, 1, 1])])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save(two_layer_model(), tmp_path_factory.mktemp("tune"))


def host_key() -> str:
    t = targets.get_target("host")
    return tuning.target_key(t, schedule._isa("conv2d_gemm", t))


def test_tune_resumes_and_select_uses_the_entries(model, tmp_path, monkeypatch):
    monkeypatch.delenv("TINYDEPLOY_TUNING", raising=False)
    monkeypatch.setattr(tune, "TILES_PER_ALGO", 1)          # fewer candidates: a fast test
    monkeypatch.setattr(tune, "BLOCKING_SCALES", ((2, 1, 1),))
    db_path = tmp_path / "db.json"
    lines = []
    db = tune.tune([str(model)], "host", str(db_path), jobs=2, seconds=0.05, log=lines.append)
    sigs = sorted(tuning.layer_signature(k) for k in tune.layer_kernels(model))
    assert sigs == ["conv f32 n1 c16 h12 w12 m16 k1x1 s1x1 p0x0 d1x1 g1 o12x12 linear",
                    "conv f32 n1 c8 h12 w12 m16 k3x3 s1x1 p1x1 d1x1 g1 o12x12 relu"]
    on_disk = json.loads(db_path.read_text())
    assert on_disk["target"] == host_key() and sorted(on_disk["layers"]) == sigs == sorted(db["layers"])
    for e in on_disk["layers"].values():
        assert tuning.valid_entry(e) and e["us"] > 0 and e["cost_model"]["us"] > 0 and e["candidates"] >= 2
        assert e["us"] <= e["cost_model"]["us"]
    assert sum(ln.startswith(("[1/2]", "[2/2]")) and "candidates, best" in ln for ln in lines) == 2

    # resume: a second run measures nothing and leaves the file alone
    before = db_path.read_text()
    lines.clear()
    tune.tune([str(model)], "host", str(db_path), jobs=2, seconds=0.05, log=lines.append)
    assert db_path.read_text() == before and any("already in" in ln for ln in lines)
    assert not any("candidates" in ln for ln in lines)

    # select takes the database's choice (here one the cost model would not make) and says so
    isa = schedule._isa("conv2d_gemm", targets.get_target("host"))
    tile = list(cost._tiles(isa)[-1][:2])
    on_disk["layers"][sigs[1]] = {"algo": "conv2d_gemm", "tile": tile, "blocking": [24, 16, 64]}
    db_path.write_text(json.dumps(on_disk))
    monkeypatch.setenv("TINYDEPLOY_TUNING", str(db_path))
    b = flow.build(model, "host", tmp_path / "b", quiet=True)
    conv3 = b.compiled.kernels[0]
    assert "tuned]" in conv3.desc and conv3.params["algo"] == "conv2d_gemm", conv3.desc
    assert [conv3.params["MR"], conv3.params["NR"]] == tile and conv3.params["KC"] == 24
    assert "tuned]" in b.compiled.kernels[1].desc
    specs = flow.io_specs(b.summary, "inputs")
    x = reference.random_inputs(specs, 3)
    got, _ = LocalRunner().run(b.exe, [x["x"]], [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")])
    res = reference.compare(got, reference.run_onnxruntime(model.read_bytes(), x), flow.FP32_RTOL)
    assert res["outputs_match"], res

    # the environment still overrides the database
    monkeypatch.setenv("TINYDEPLOY_ALGO", "ref")
    c = compile_model(model, targets.get_target("host"))
    assert not any("tuned" in k.desc for k in c.kernels if k)
    monkeypatch.delenv("TINYDEPLOY_ALGO")
    monkeypatch.setenv("TINYDEPLOY_TUNING", "off")
    c = compile_model(model, targets.get_target("host"))
    assert not any("tuned" in k.desc for k in c.kernels if k)


def test_tune_emulated_ranks_by_instructions(model, tmp_path, monkeypatch):
    """--emulate: a Linux board's candidates counted under qemu-aarch64, the fewest instructions kept
    (the cost model's choice on a tie), and the database says it was ranked so."""
    from util import require
    require("aarch64-linux-gnu-gcc")
    require("qemu-aarch64")
    monkeypatch.delenv("TINYDEPLOY_TUNING", raising=False)
    monkeypatch.setattr(tune, "TILES_PER_ALGO", 1)
    monkeypatch.setattr(tune, "BLOCKING_SCALES", ())
    db_path = tmp_path / "db.json"
    lines = []
    db = tune.tune([str(model)], "rpi4", str(db_path), jobs=2, log=lines.append, emulate=True)
    on_disk = json.loads(db_path.read_text())
    assert on_disk == db and on_disk["target"] == "aarch64-cortex-a72-neon" and on_disk["board"] == "rpi4"
    assert "no board" in on_disk["measured"] and "instructions" in on_disk["measured"]
    assert len(on_disk["layers"]) == 2
    for e in on_disk["layers"].values():
        assert tuning.valid_entry(e) and "us" not in e and e["candidates"] >= 2
        assert 0 < e["instructions"] <= e["cost_model"]["instructions"]
        assert e["speedup"] == round(e["cost_model"]["instructions"] / e["instructions"], 3)
    assert sum("instructions, " in ln and "candidates, best" in ln for ln in lines) == 2
    with pytest.raises(TinydeployError, match="this machine"):
        tune.tune([str(model)], "host", str(db_path), emulate=True)
    with pytest.raises(TinydeployError, match="not both"):
        tune.tune([str(model)], "rpi4", str(db_path), emulate=True, ssh="pi@example")


@pytest.mark.parametrize("content", ["{not json", '{"target": "host-avx512"}', "[1, 2]",
                                     '{"target": "some-other-cpu", "layers": {}}'])
def test_corrupt_database_is_ignored_with_a_note(model, tmp_path, monkeypatch, content):
    db_path = tmp_path / "db.json"
    db_path.write_text(content)
    monkeypatch.setenv("TINYDEPLOY_TUNING", str(db_path))
    c = compile_model(model, targets.get_target("host"))
    assert not any("tuned" in k.desc for k in c.kernels if k)
    notes = [n for n in c.notes if "tuning database" in n]
    assert len(notes) == 1 and "ignored" in notes[0] and "\n" not in notes[0]
    # the tuner refuses to extend it (and says how to go on) unless told to replace it
    with pytest.raises(TinydeployError, match="--no-resume|another --db"):
        tune.open_db(db_path, host_key(), resume=True)


def test_malformed_entries_are_dropped(model, tmp_path, monkeypatch):
    sig = tuning.layer_signature(tune.layer_kernels(model)[0])
    db_path = tmp_path / "db.json"
    db_path.write_text(json.dumps({"target": host_key(), "layers": {sig: {"algo": "conv2d_gemm", "tile": "8x32"}}}))
    monkeypatch.setenv("TINYDEPLOY_TUNING", str(db_path))
    c = compile_model(model, targets.get_target("host"))
    assert not any("tuned" in k.desc for k in c.kernels if k) and any("1 malformed" in n for n in c.notes)


def test_bad_input(model, tmp_path, capsys, monkeypatch):
    def run(*argv):
        code = cli.main(list(argv))
        return code, capsys.readouterr().err
    code, err = run("tune", "--board", "no-such-board", str(model))
    assert code == 2 and "no-such-board" in err
    code, err = run("tune", str(tmp_path / "missing.onnx"), "--db", str(tmp_path / "db.json"))
    assert code == 2 and "does not exist" in err
    code, err = run("tune", str(model), "--db", str(tmp_path / "no" / "such" / "dir" / "db.json"))
    assert code == 2 and "not writable" in err
    code, err = run("tune", str(model), "--db", str(tmp_path))
    assert code == 2 and "is a folder" in err
    code, err = run("tune", str(model), "--db", "/dev/null")
    assert code == 2 and "not a regular file" in err
    code, err = run("tune", "--board", "mps2-an386", str(model))
    assert code == 2 and "nothing to tune" in err
    code, err = run("tune", "--board", "rpi4", str(model))
    assert code == 2 and "--ssh" in err and "--emulate" in err
    monkeypatch.setenv("TINYDEPLOY_ALGO", "ref")
    code, err = run("tune", str(model), "--db", str(tmp_path / "db.json"))
    assert code == 2 and "unset" in err
    assert not (tmp_path / "db.json").exists()


def test_bench_layers_json_and_build_lines(model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TINYDEPLOY_TUNING", "off")
    monkeypatch.chdir(tmp_path)             # bench builds into ./build
    assert cli.main(["bench", "--layers", "--json", "--seconds", "0.05", str(model)]) == 0
    out = capsys.readouterr()
    (res,) = json.loads(out.out)
    steps = [r["step"] for r in res["layers"]]
    assert steps == [0, 1] and res["total_us"] > 0 and res["emulated"] is False
    assert abs(sum(r["share_percent"] for r in res["layers"]) - 100.0) < 0.01
    for r in res["layers"]:
        assert r["us"] > 0 and r["macs"] > 0 and r["gflops"] > 0 and r["op"].startswith("Conv")
        assert r["algorithm"].split()[0] in ("conv2d_gemm", "conv2d_igemm", "conv2d_gemmt", "ref") or \
            r["algorithm"].startswith("conv2d_winograd")
    c = compile_model(model, targets.get_target("host"))
    assert [r["algorithm"] for r in res["layers"]] == [k.desc[1:k.desc.index("]")] for k in c.kernels if k]
    # the profile build is separate; the hooks are empty macros without TD_PROFILE
    prof = tmp_path / "build" / "model-host-profile" / "model.c"
    text = prof.read_text()
    assert "TD_LAYER_BEGIN(0);" in text and "TD_LAYER_END(1);" in text
    assert "#define TD_LAYER_BEGIN(i) ((void)0)" in text

    # build: one line per fast-algorithm layer on stderr, nothing of it on stdout
    assert cli.main(["build", str(model), "-o", str(tmp_path / "b")]) == 0
    out = capsys.readouterr()
    want = schedule.describe(c.kernels, fast_only=True)
    assert len(want) == 2
    for line in want:
        assert f"[tinydeploy] {line}" in out.err and line not in out.out


class FakeRemote:
    """tinydeploy.runners.ssh.Remote's interface, on this machine (no ssh server in the tests)."""

    def __init__(self, target, port=None, identity=None):
        import tempfile
        self.target = target
        self.root = tempfile.mkdtemp(prefix="fake-board-")

    def tempdir(self, path=None):
        import contextlib
        import shutil

        @contextlib.contextmanager
        def cm():
            yield self.root
            shutil.rmtree(self.root)
        return cm()

    def put(self, local, remote_dir):
        import shutil
        return shutil.copy2(local, remote_dir)

    def get(self, remote_path, local):
        import shutil
        shutil.copyfile(remote_path, local)
        return local

    def run(self, argv, stdin=b"", timeout=60):
        import subprocess
        return subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout)


def test_ssh_runner_copies_runs_and_checks(model, tmp_path):
    import pathlib

    b = flow.build(model, "host", tmp_path / "b", quiet=True)
    b2 = flow.build(model, "host", tmp_path / "b2", quiet=True)
    x = reference.random_inputs(flow.io_specs(b.summary, "inputs"), 0)["x"]
    out_specs = [(s, d) for _, s, d in flow.io_specs(b.summary, "outputs")]
    runner = select_runner("host", remote=FakeRemote("pi@board"))
    assert isinstance(runner, SshRunner) and runner.where == "on pi@board"
    board_dir = pathlib.Path(runner.open())
    got, ms = runner.run(b.exe, [x], out_specs, 3)
    want, _ = LocalRunner().run(b.exe, [x], out_specs)
    assert ms > 0 and got[0].tobytes() == want[0].tobytes()
    assert time_runs(runner, b.exe, [x], out_specs, 0.01, probe=3)[0] > 0
    assert runner.run(b2.exe, [x], out_specs)[0][0].tobytes() == want[0].tobytes()
    # each binary copied once; the second model_run under a name of its own
    assert sorted(p.name for p in board_dir.glob("*model_run")) == ["c1_model_run", "model_run"]
    runner.close()
    assert not board_dir.exists()


def test_candidates(model, monkeypatch):
    t = targets.get_target("host")
    isa = schedule._isa("conv2d_gemm", t)
    monkeypatch.setenv("TINYDEPLOY_TUNING", "off")
    chosen = [k.params["algo"] for k in compile_model(model, t).kernels if k]    # the cost model's
    conv3, conv1 = tune.layer_kernels(model)
    for k, algo in zip((conv3, conv1), chosen):
        cands = tune.candidates(k, t, isa)
        keys = [json.dumps(c, sort_keys=True) for c in cands]
        assert len(set(keys)) == len(keys) >= 2
        assert cands[0] == {"algo": algo, "tile": None, "blocking": None}
    assert any(c["blocking"] for c in tune.candidates(conv1, t, isa))      # kc/mc/nc variants of the GEMM
    # a matrix-vector product: only the cost model's choice (timed alone it would mislead)
    mv = type(conv1)("dense", "f32", {"M": 1, "K": 256, "N": 64, "has_bias": False, "bias_2d": False, "act": "v"}, [])
    assert tune.candidates(mv, t, isa) == [{"algo": schedule.dense_choice(mv.params, isa, "auto"), "tile": None,
                                            "blocking": None}]


def test_build_key_follows_the_selection_overrides(monkeypatch):
    """A build made under one of the selection's overrides (TINYDEPLOY_ALGO, _TILE, _DW_FORM,
    _TRANS, _GEMM_PLANES) has another key than one made without it, so `bench` and `run` never
    reuse a forced build for an unforced one (or the reverse)."""
    for v in ("TINYDEPLOY_ALGO", "TINYDEPLOY_TILE", "TINYDEPLOY_DW_FORM", "TINYDEPLOY_TRANS", "TINYDEPLOY_GEMM_PLANES"):
        monkeypatch.delenv(v, raising=False)
    base = tuning.state("x")
    keys = set()
    for v in ("TINYDEPLOY_ALGO", "TINYDEPLOY_TILE", "TINYDEPLOY_DW_FORM", "TINYDEPLOY_TRANS", "TINYDEPLOY_GEMM_PLANES"):
        monkeypatch.setenv(v, "1")
        keys.add(tuning.state("x"))
        monkeypatch.delenv(v)
    assert base not in keys and len(keys) == 5 and tuning.state("x") == base
