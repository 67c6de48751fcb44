"""``bench/convergence_gap.py``: gaps to data parallel, and the committed results read back."""

from __future__ import annotations

import pytest

from bench.convergence_gap import VARIANTS, assemble, gaps


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
