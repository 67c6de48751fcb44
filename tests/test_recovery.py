"""CheckFree recovery policy: weighted rebuild, plans for every failure shape, routes, movers."""

import pytest
import torch

from protocol.messages import PeerRecord
from swarm.recovery import (
    RecoveryPlan,
    Source,
    checkfree_plus_route,
    choose_mover,
    plan_recovery,
    swap_partner,
    weighted_average,
)


def rec(pid: str, stage: int, grad_norm: float = 0.5, step: int = 10) -> PeerRecord:
    return PeerRecord(
        peer_id=pid, address=f"h:{pid}", stage=stage, ready=True, grad_norm=grad_norm, step=step
    )


def live_table(
    n: int, missing: set[int], norms: dict[int, float] | None = None
) -> dict[int, list[PeerRecord]]:
    norms = norms or {}
    return {s: [] if s in missing else [rec(f"p{s}", s, norms.get(s, 0.5))] for s in range(n + 1)}


def test_weighted_average_by_hand() -> None:
    # w_prev = 0.2 + 1e-4, w_next = 0.6 + 1e-4:  W = (w_next * 10 + w_prev * 2) / (w_next + w_prev)
    prev = {"w": torch.tensor([2.0, 0.0])}
    nxt = {"w": torch.tensor([10.0, 4.0])}
    wp, wn = 0.2 + 1e-4, 0.6 + 1e-4
    out = weighted_average([prev, nxt], [wp, wn])
    assert out["w"].tolist() == pytest.approx(
        [(wn * 10 + wp * 2) / (wn + wp), (wn * 4) / (wn + wp)]
    )
    both_clipped = weighted_average([prev, nxt], [1.0 + 1e-4, 1.0 + 1e-4])
    assert both_clipped["w"].tolist() == pytest.approx([6.0, 2.0])  # a plain average


def test_weighted_average_rejects_mismatched_stages() -> None:
    with pytest.raises(ValueError, match="names"):
        weighted_average([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], [1, 1])
    with pytest.raises(ValueError, match="shapes"):
        weighted_average([{"a": torch.zeros(1)}, {"a": torch.zeros(2)}], [1, 1])


def test_middle_stage_uses_both_neighbours_weighted_by_grad_norm() -> None:
    plan = plan_recovery(3, 5, live_table(5, {3}, {2: 0.25, 4: 1.0}), "checkfree")
    assert plan == RecoveryPlan(3, "checkfree", (Source(2, 0.25 + 1e-4), Source(4, 1.0 + 1e-4)))


def test_adjacent_failure_uses_nearest_live_block_stages() -> None:
    plan = plan_recovery(3, 6, live_table(6, {2, 3, 4}), "checkfree")
    assert [s.stage for s in plan.sources] == [1, 5] and plan.kind == "checkfree"


def test_surviving_replica_is_copied() -> None:
    assert plan_recovery(2, 4, live_table(4, set()), "checkfree").kind == "copy"


def test_boundary_stage_plain_checkfree_copies_its_one_neighbour() -> None:
    plan = plan_recovery(1, 4, live_table(4, {1}), "checkfree")
    assert plan == RecoveryPlan(1, "neighbour_copy", (Source(2, 1.0),))


@pytest.mark.parametrize(
    ("n", "lost", "partner"),
    [(4, 1, 2), (4, 4, 3), (4, 2, 1), (4, 3, 4), (6, 2, 1), (6, 5, 6), (6, 1, 2), (6, 6, 5)],
)
def test_checkfree_plus_copies_the_swap_partner(n: int, lost: int, partner: int) -> None:
    """Stages 1 and 2, and N-1 and N, each learn the other's job: a lost one of the four is
    a copy of its partner (not an average of its neighbours, for 2 and N-1)."""
    plan = plan_recovery(lost, n, live_table(n, {lost}), "checkfree+")
    assert plan == RecoveryPlan(lost, "swap_copy", (Source(partner, 1.0),))


def test_checkfree_plus_without_the_partner_falls_back_to_the_neighbours() -> None:
    plan = plan_recovery(2, 6, live_table(6, {2, 1}), "checkfree+")  # partner 1 gone too
    assert plan == RecoveryPlan(2, "neighbour_copy", (Source(3, 1.0),))


def test_checkfree_plus_middle_stage_still_averages() -> None:
    assert plan_recovery(3, 5, live_table(5, {3}), "checkfree+").kind == "checkfree"


def test_random_and_nothing_left() -> None:
    assert plan_recovery(2, 4, live_table(4, {2}), "random").kind == "random"
    assert plan_recovery(2, 3, live_table(3, {1, 2, 3}), "checkfree").kind == "seed"
    assert plan_recovery(0, 3, live_table(3, {0}), "checkfree").kind == "seed"
    with pytest.raises(ValueError, match="recovery method"):
        plan_recovery(2, 3, live_table(3, {2}), "magic")


def test_checkfree_plus_route_permutation() -> None:
    assert checkfree_plus_route(0, 4) == [1, 2, 3, 4]
    assert checkfree_plus_route(1, 4) == [2, 1, 4, 3]
    assert checkfree_plus_route(7, 6) == [2, 1, 3, 4, 6, 5]
    for seq in range(6):
        assert sorted(checkfree_plus_route(seq, 5)) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        checkfree_plus_route(1, 3)
    assert swap_partner(1, 4) == 2 and swap_partner(3, 4) == 4 and swap_partner(3, 6) is None


def test_one_mover_from_the_stage_with_most_replicas() -> None:
    live = {
        0: [rec("h", 0)],
        1: [rec("a", 1), rec("b", 1), rec("c", 1)],
        2: [],
        3: [rec("d", 3), rec("e", 3)],
    }
    movers = [r.peer_id for rs in live.values() for r in rs if choose_mover(2, r, live)]
    assert movers == ["a"]


def test_nobody_moves_while_a_replica_is_on_its_way() -> None:
    # "a" is leaving stage 1 for stage 2 (draining, its record there and not ready): stage 3
    # now has the most ready replicas, so without it in transit "d" would refill stage 2 too
    live = {0: [rec("h", 0)], 1: [rec("b", 1)], 2: [], 3: [rec("d", 3), rec("e", 3)]}
    assert [r.peer_id for rs in live.values() for r in rs if choose_mover(2, r, live)] == ["d"]
    assert not any(choose_mover(2, r, live, in_transit=1) for rs in live.values() for r in rs)


def test_never_empties_its_own_stage_and_ties_pick_one_stage() -> None:
    live = {0: [rec("h", 0)], 1: [rec("a", 1)], 2: [], 3: [rec("d", 3)]}
    assert not any(choose_mover(2, r, live) for rs in live.values() for r in rs)
    tie = {0: [rec("h", 0)], 1: [rec("b", 1), rec("a", 1)], 2: [], 3: [rec("c", 3), rec("d", 3)]}
    assert [r.peer_id for rs in tie.values() for r in rs if choose_mover(2, r, tie)] == ["a"]


def test_head_nodes_are_never_donors() -> None:
    live = {0: [rec("a", 0), rec("b", 0), rec("c", 0)], 1: [rec("d", 1), rec("e", 1)], 2: []}
    assert [r.peer_id for rs in live.values() for r in rs if choose_mover(2, r, live)] == ["d"]


def test_checkpoint_round_trip_and_wrong_file(tmp_path: "Path") -> None:  # noqa: F821
    from node.stage.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint

    tensors = {"param.w": torch.arange(6.0).reshape(2, 3), "adam_m.w": torch.ones(2, 3)}
    assert load_checkpoint(tmp_path, 2) is None
    save_checkpoint(tmp_path, 2, tensors, step=40, samples=1280)
    loaded, step, samples = load_checkpoint(tmp_path, 2)  # type: ignore[misc]
    assert (step, samples) == (40, 1280) and torch.equal(loaded["param.w"], tensors["param.w"])
    checkpoint_path(tmp_path, 2).rename(checkpoint_path(tmp_path, 3))
    with pytest.raises(ValueError, match="not a checkpoint of stage 3"):
        load_checkpoint(tmp_path, 3)


def test_head_stage_plans() -> None:
    live = live_table(4, {0})
    assert plan_recovery(0, 4, live, "checkfree+").kind == "seed"  # nobody holds a backup
    live[1] = [PeerRecord(peer_id="x", address="h:x", stage=1, ready=True, head_backup_step=40)]
    assert plan_recovery(0, 4, live, "checkfree+") == RecoveryPlan(
        0, "head_copy", (Source(1, 1.0),)
    )
    assert plan_recovery(0, 4, live, "checkfree").kind == "seed"
    assert plan_recovery(2, 4, live_table(4, {2}), "checkpoint").kind == "checkpoint"


def test_only_the_allowed_donor_stages_give_a_replica() -> None:
    # stage 4 is empty; stage 1 has the most replicas but does not hold stage 4 (a ring of 6
    # with radius 1): of the stages that do (3 and 5), 5 has more, and its lowest id goes
    live = {
        0: [rec("h", 0)],
        1: [rec("a", 1), rec("b", 1), rec("c", 1), rec("d", 1)],
        2: [rec("e", 2)],
        3: [rec("f", 3), rec("g", 3)],
        4: [],
        5: [rec("k", 5), rec("j", 5), rec("i", 5)],
    }
    everyone = [r for rs in live.values() for r in rs]
    assert [r.peer_id for r in everyone if choose_mover(4, r, live)] == ["a"]
    donors = {3, 5}
    assert [r.peer_id for r in everyone if choose_mover(4, r, live, donors)] == ["i"]
