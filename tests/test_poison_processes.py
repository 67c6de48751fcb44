"""A poisoner among real ``node join`` processes: refused, banned, and harmless.

A head, ``STAGE1`` replicas of block stage 1 and one of block stage 2 train NoLoCo on
127.0.0.1 for a fixed budget of inner steps. In the poisoned run the last stage-1 replica
gossips its slow weights and pseudo-gradient scaled by 1000 (``sync.debug_poison``, a
fault-injection knob; NaN offers are covered on real nodes in-process by
``tests/test_poison.py``). Its partner must refuse the offer, ban it and take solo outer
steps, and the head's eval loss must end no higher than a clean run's, within the noise.

Making runs comparable: the same state directories (so the same peer ids, hence the same
data shard and sampling seed), and a learning rate that decays to zero at the budget
(``train.total_steps``, ``min_lr_ratio = 0``) so the weights stop moving before the eval,
whatever the exact moment it runs. What remains is routing, staleness and pairing, which
follow the machine's timing; on the shared 2-core machine this was written on, clean runs
of this exact set-up differ by up to 4 % (see ``TOLERANCE``), more than the 1 % issue 7
asks for, so the test allows what clean runs themselves show. The 1 % bound itself is held
in ``tests/test_poison_loss.py``, where the same runner and screen run in lockstep and two
runs differ by the poison alone. Without the screen
(``sync.screen_multiple = 0``) the same poisoner's weights are averaged in: within two
rounds a stage-1 replica's weights are not finite, the next stage refuses its activations
(``non_finite``), it stalls and the run never reaches its budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from node.client import fetch_status, request_eval
from node.demo import LocalSwarm, wait_ready
from tests.helpers import FAST_SWARM, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BUDGET = 24
"""Inner steps of every replica; the learning rate is zero from there on."""
STAGE1 = 2
"""Replicas of stage 1 (the last one is the poisoner in a poisoned run)."""
TOLERANCE = 0.06
"""Relative difference of eval loss allowed between a poisoned and a clean run. Measured
on the loaded 2-core machine this was written on, eval losses of clean runs of this
set-up: 4.300, 4.336, 4.362, 4.438, 4.443, 4.469 (std 1.5 %, range 3.8 %, so two clean
runs differ by about 2.2 % std); poisoned runs: 4.367, 4.379, 4.465 (scale:1000), 4.419
(nan), all within the clean runs' range. 1 % would fail between clean runs; 6 % is about
2.7 standard deviations of that difference. A later full run read a clean 4.546, above
that range, so the bound is kept on the side that would show harm only. (At the default learning rate, 2e-3, clean
runs spread even more: std 3.4 %, range 9.2 %.)"""
SETTINGS = {
    **FAST_SWARM,
    "train.eval_batches": "16",
    "train.lr": "5e-4",
    "train.warmup_steps": "4",
    "train.total_steps": str(BUDGET),
    "train.min_lr_ratio": "0",
    "train.step_samples": "16",
    "membership.ttl_s": "6",
    "swarm.num_block_stages": "2",
    "sync.outer_steps": "4",
    "sync.schedule": "steps",  # a round every 4 steps: a budget of 24 holds several
    "sync.round_deadline_s": "5",
    "sync.request_timeout_s": "3",
    "sync.hold_s": "2",
    "balance.benchmark_s": "0",
}


def run_swarm(root: Path, states: Path, poison: str = "") -> dict[str, Any]:
    """Train to the budget; the head's eval loss and the stage-1 replicas' status.

    Stage 1 has ``STAGE1`` replicas; with ``poison`` the last one is the poisoner.
    """
    log_dir = root / (poison.replace(":", "") or "clean")
    log_dir.mkdir()
    s = LocalSwarm(log_dir, SETTINGS)
    layout = [("head", 0), *((f"s1-{i}", 1) for i in range(STAGE1)), ("s2", 2)]
    try:
        nodes = {}
        for name, stage in layout:
            extra = ["--state-dir", str(states / name)]
            if name == f"s1-{STAGE1 - 1}" and poison:
                extra += ["--set", f"sync.debug_poison={poison}"]
            nodes[name] = s.start_node(stage, extra=extra)
        for address in nodes.values():
            wait_ready(address, 120, s)
        # the stage-1 replicas share the microbatches: they reach the budget last
        wait_for(
            lambda: all(fetch_status(a)["step"] >= BUDGET + 4 for a in nodes.values()),
            400,
            f"{BUDGET + 4} steps on every replica",
        )
        status = {name: fetch_status(address) for name, address in nodes.items()}
        return {"eval_loss": request_eval(nodes["head"]), **status}
    finally:
        s.stop(grace_s=5)


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("states")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, states: Path) -> dict[str, Any]:
    return run_swarm(tmp_path_factory.mktemp("clean"), states)


def test_a_poisoner_is_refused_banned_and_the_loss_unchanged(
    tmp_path: Path, states: Path, clean: dict[str, Any]
) -> None:
    partner, poisoner = (f"s1-{i}" for i in (0, STAGE1 - 1))
    assert clean[partner]["sync"]["rounds"].get("paired", 0) >= 2  # the clean run pairs
    assert not any(k.startswith("weights_refused") for k in clean[partner]["counters"])
    run = run_swarm(tmp_path, states, "scale:1000")
    c = run[partner]["counters"]
    print(
        f"eval loss clean {clean['eval_loss']:.4f}, poisoned {run['eval_loss']:.4f} "
        f"({run['eval_loss'] / clean['eval_loss'] - 1:+.2%}); partner: rounds "
        f"{run[partner]['sync']['rounds']}, counters {c}"
    )
    assert c.get("weights_refused:gossip:too_far", 0) >= 1
    assert c.get("peers_banned", 0) == 1
    assert "weights_refused:gossip:too_far" not in run[poisoner]["counters"]  # clean offers pass
    if STAGE1 == 2:  # its only partner was the poisoner: nothing was ever averaged in
        assert run[partner]["sync"]["rounds"].get("paired", 0) == 0
    # harmless: the poison must not raise the loss beyond what timing alone does. One-sided,
    # since a poisoned run ending lower is timing noise, not harm (a full run on a fresh
    # clone read clean 4.546, poisoned 4.260: -6.3 %)
    assert run["eval_loss"] / clean["eval_loss"] - 1 <= TOLERANCE
