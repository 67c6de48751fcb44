"""The convergence study's fast path (``bench/convergence_sim.py``), a short run of it."""

from pathlib import Path

import pytest

from bench.convergence import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.inprocess
def test_quick_study_runs_every_method_and_records_what_the_issue_asks(tmp_path: Path) -> None:
    result = main(["--quick", "--out", str(tmp_path)])
    assert result["replicas_per_stage"] == 4
    methods = result["methods"]
    assert set(methods) == {"noloco", "diloco", "allreduce", "none"}
    for r in methods.values():
        assert 0 < r["final_eval_loss_mean"] < r["curves"][0]["eval_loss"][0]  # it learns
        assert r["inner_steps"] > 0
    spread = {m: r["final_spread_mean"] for m, r in methods.items()}
    assert spread["allreduce"] < 1e-6  # data parallel keeps the replicas identical
    assert spread["none"] > spread["noloco"] > 0  # gossip pulls replicas together
    assert methods["noloco"]["outer_rounds"] > 0 and methods["none"]["outer_rounds"] == 0
    assert (tmp_path / "convergence-quick.json").is_file()
    assert (tmp_path / "convergence-quick.png").is_file()


def test_quick_live_check_runs_real_processes_beside_the_simulation(tmp_path: Path) -> None:
    """The check of the fast path against ``node join`` processes (2 heads, 2 block stages x
    2 replicas, NoLoCo), at the quick budget: the live curve has the simulation's milestones
    and every figure the comparison needs."""
    check = main(["--quick", "--check-only", "--out", str(tmp_path)])["live_check"]
    live, sim = check["live"], check["simulated"]
    assert len(live["eval_loss"]) == len(sim["eval_loss"]) >= 3
    # compared at equal tokens: the live swarm trains on while it evaluates, and the
    # simulation is evaluated where the live swarm was (within one global step of 2 x 512)
    for a, b in zip(live["tokens"], sim["tokens"], strict=True):
        assert a <= b < a + 1024
    # the simulation with the live pipeline's staleness (the default 6 in flight) is there
    stale = check["simulated_in_flight"]
    assert check["max_in_flight"] > 1 and stale["tokens"] == sim["tokens"]
    # the live swarm learns too (past the warm-up, at the peak learning rate, it is less
    # stable than the synchronous simulation: bench/README.md, the live check)
    assert min(live["eval_loss"][1:]) < live["eval_loss"][0] - 0.5
    assert all(s >= 0 for s in live["spread"]) and live["inner_steps"] > 0
    # each block replica's inner steps and its rounds by outcome, read from the live nodes
    rounds = check["live_rounds"]
    assert len(rounds) == 4 and all(r["inner_steps"] > 0 for r in rounds)
    assert all(sum(n for k, n in r.items() if k != "inner_steps") >= 1 for r in rounds)
    assert 0 <= check["live_vs_sim_final_gap"] < 1 and check["live_vs_sim_max_gap"] >= 0
