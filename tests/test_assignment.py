"""choose_stage: empty stages first, then fewest replicas, ties at random."""

import random
from collections import Counter

import pytest

from swarm.assignment import choose_stage


def test_empty_stage_first() -> None:
    assert choose_stage({0: 2, 1: 1, 2: 0, 3: 5}, random.Random(0)) == 2


def test_fewest_replicas() -> None:
    assert choose_stage({0: 3, 1: 2, 2: 1, 3: 2}, random.Random(0)) == 2


def test_ties_spread_joiners() -> None:
    rng = random.Random(1)
    counts = Counter(choose_stage({0: 0, 1: 0, 2: 0, 3: 0}, rng) for _ in range(4000))
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 800


def test_no_stages_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose_stage({}, random.Random(0))
