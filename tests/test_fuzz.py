"""The mutation fuzzer (tests/modelfuzz.py) in the suite: a bounded, seeded run over the MLPerf
Tiny models, and the corpus of what longer runs found, replayed. Every mutant must end as
`tinydeploy run` promises: exit 0 with matching outputs, exit 1 with the mismatch in numbers, or
exit 2 with one line; its C, when it builds, runs under ASan and UBSan. The run's counts are
printed at the end of the session (conftest.py)."""
from __future__ import annotations

import json

import pytest

import modelfuzz
from util import mlperf_model

N = 300          # mutants in the bounded run
SEED = 12


def _failures(rep) -> list[str]:
    return [f"[{i}] {verdict}: {model} {json.dumps(recipes)} -> {detail}"
            for i, model, recipes, verdict, detail in rep["results"] if verdict in modelfuzz.FAILURES]


@pytest.mark.slow
@pytest.mark.models
def test_bounded_fuzz_run(record_property):
    for name in modelfuzz.MODELS:
        mlperf_model(f"{name}.onnx")                # missing models fail, never skip
    rep = modelfuzz.fuzz(n=N, seed=SEED, jobs=2)
    line = modelfuzz.summary(rep, SEED)
    record_property("fuzz_summary", line)
    print(line)
    assert rep["n"] == N
    bad = _failures(rep)
    assert not bad, line + "\n" + "\n".join(bad[:20])
    assert rep["counts"]["exit0"] > 0 and rep["counts"]["exit2"] > 0, line


@pytest.mark.slow
@pytest.mark.models
def test_the_corpus_replays_cleanly(record_property):
    """What longer runs (python3 tests/modelfuzz.py --minutes 30) found: failures, fixed since, must
    now end cleanly; the other entries keep their verdict."""
    corpus = modelfuzz.load_corpus()
    assert corpus, "tests/fuzz_corpus.json is empty"
    rep = modelfuzz.replay(corpus, jobs=2)
    wrong = []
    for entry, (verdict, detail) in zip(corpus, rep):
        want = entry["expect"]
        ok = verdict not in modelfuzz.FAILURES if want == "clean" else verdict == want
        if not ok:
            wrong.append(f"{entry['model']} {json.dumps(entry['recipes'])}: expected {want}, got {verdict} ({detail})")
    record_property("fuzz_corpus", f"corpus: {len(corpus)} entries replayed, {len(wrong)} wrong")
    assert not wrong, "\n".join(wrong)
