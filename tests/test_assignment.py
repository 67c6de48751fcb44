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


def test_choose_shard_keeps_heads_disjoint_and_stable() -> None:
    from swarm.assignment import choose_shard

    assert choose_shard(4, [], preferred=2) == 2
    assert choose_shard(4, [2], preferred=2) == 0  # taken: the lowest free one
    assert choose_shard(4, [0, 2], preferred=2) == 1
    assert choose_shard(4, [1, 3], preferred=2) == 2  # others' shards do not move it
    assert choose_shard(2, [0, 1], preferred=1) == 1  # more heads than shards: share
    with pytest.raises(ValueError):
        choose_shard(4, [], preferred=4)
