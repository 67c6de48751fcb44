"""``bench/convergence_gap.py``: gaps to data parallel, and the committed results read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import convergence, convergence_gap, site_corpus
from bench.convergence_gap import STUDY, VARIANTS, assemble, gaps
from node.data.documents import load_documents


def load_study() -> dict[str, Any]:
    study: dict[str, Any] = json.loads(STUDY.read_text())
    return study


def test_the_gap_is_taken_at_equal_tokens_only() -> None:
    curve = {"tokens": [0, 100, 200, 300], "eval_loss": [5.0, 2.2, 1.5, 1.1]}
    reference = {"tokens": [0, 100, 200], "eval_loss": [5.0, 2.0, 1.2]}
    # 2.2 / 2.0 - 1 = 0.1; 1.5 / 1.2 - 1 = 0.25; no reference at 300; none at 0 tokens
    assert gaps(curve, reference) == [None, 0.1, 0.25, None]


def test_the_committed_runs_assemble_against_their_own_reference() -> None:
    result = assemble()
    variants = result["variants"]
    assert {"study_noloco", "study_none"} <= set(variants)
    for name, v in variants.items():
        assert v["against"] == (VARIANTS[name].reference if name in VARIANTS else "study")
        assert len(v["gap_to_dp"]) == len(v["tokens"]) == len(v["eval_loss"])
        assert v["final_gap_to_dp"] == pytest.approx(v["gap_to_dp"][-1])
    # the study's independent replicas end clearly above data parallel (its own verdict)
    assert variants["study_none"]["final_gap_to_dp"] > 0.03
    # a seed-1 variant is measured against data parallel's seed 1, not seed 0
    seed1 = variants["pair_average_h5_s1"]
    dp1 = next(c for c in load_study()["methods"]["allreduce"]["curves"] if c["seed"] == 1)
    assert seed1["final_gap_to_dp"] == pytest.approx(
        seed1["final_eval_loss"] / dp1["eval_loss"][-1] - 1, abs=1e-4
    )
    # seed 2, which the study does not hold, against its own data parallel run of seed 2
    seed2, dp2 = variants["pair_average_h5_s2"], variants["dp_s2"]
    assert dp2["final_gap_to_dp"] == 0.0 and dp2["eval_loss"][-1] != dp1["eval_loss"][-1]
    assert seed2["final_gap_to_dp"] == pytest.approx(
        seed2["final_eval_loss"] / dp2["final_eval_loss"] - 1, abs=1e-4
    )


def test_a_gpu_variant_runs_every_replica_on_cuda_and_is_measured_on_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []

    def fake_study(argv: list[str]) -> None:  # records the run instead of training
        seen.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        (out / "convergence.json").write_text("{}")

    monkeypatch.setattr(convergence, "main", fake_study)
    monkeypatch.setattr(convergence_gap, "RUNS", tmp_path)
    monkeypatch.setattr(convergence_gap, "SITE_CORPUS", tmp_path)  # exists: nothing built
    convergence_gap.run("gpu_site_noloco_5m_s1", threads=2)
    convergence_gap.run("site_noloco", threads=2)
    gpu, cpu = seen
    assert "node.device=cuda" in gpu and not any("node.device" in a for a in cpu)
    assert gpu[gpu.index("--seeds") + 1] == "1" and gpu[gpu.index("--methods") + 1] == "noloco"
    assert VARIANTS["gpu_site_noloco_5m_s1"].reference == "gpu_site_dp_5m_s1"
    assert VARIANTS["gpu_site_dp_5m"].device == "cuda" and VARIANTS["site_dp"].device == "cpu"
    assert (tmp_path / "gpu_site_noloco_5m_s1.json").exists()


def test_the_site_corpus_holds_each_long_docstring_once(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)
    long = "A docstring long enough to count as prose for the corpus, " * 2
    (pkg / "mod.py").write_text(
        f'"""{long}"""\n\ndef f():\n    """{long}"""\n\ndef g():\n    """short"""\n'
    )
    (pkg / "tests" / "test_mod.py").write_text(f'"""{long}"""\n')  # test dirs are skipped
    out = tmp_path / "corpus.jsonl"
    site_corpus.main([str(out), "--root", str(tmp_path)])
    docs = load_documents(str(out))
    assert sorted(d.text for d in docs) == [long] * 2
