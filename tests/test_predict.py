"""Weight prediction (``node.stage.predict``): the measured delay, and forwards on the weights
predicted for when their gradient lands, checked against the rule stated by hand."""

import copy

import pytest
import torch

from node.stage.predict import DELAY_WEIGHT, WeightPredictor
from node.stage.runner import StageRunner
from tests.test_runner import built, pipelined_runner


def test_the_delay_is_a_moving_average_that_starts_at_the_first_observation() -> None:
    p = WeightPredictor(enabled=False)
    assert p.delay == 0.0
    p.observe(3)
    assert p.delay == 3.0
    p.observe(1)
    assert p.delay == pytest.approx(3.0 + DELAY_WEIGHT * (1 - 3.0))  # 2.8 at weight 0.1
    assert p.weights([("w", torch.zeros(2))], epoch=0) is None  # measured, never predicted


def test_the_prediction_is_the_weights_plus_the_delay_times_the_last_move() -> None:
    p = WeightPredictor(enabled=True)
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    before = p.before_step([w])
    with torch.no_grad():
        w.add_(torch.tensor([0.5, -0.25]))  # the optimizer's step
    p.after_step([w], before, epoch=7)
    assert p.weights([("w", w)], epoch=7) is None  # no delay measured yet
    p.observe(2)
    ahead = p.weights([("w", w)], epoch=7)
    assert ahead is not None
    assert torch.equal(ahead["w"].detach(), torch.tensor([1.5 + 2 * 0.5, 1.75 - 2 * 0.25]))
    ahead["w"].sum().backward()  # attached to the live weight
    assert w.grad is not None and torch.equal(w.grad, torch.ones(2))
    assert p.weights([("w", w)], epoch=8) is None  # the weights changed since: no prediction


def test_fixed_steps_replace_the_measured_delay() -> None:
    p = WeightPredictor(enabled=True, fixed_steps=1.5)
    w = torch.zeros(1)
    before = p.before_step([w])
    w += 2.0
    p.after_step([w], before, epoch=0)
    ahead = p.weights([("w", w)], epoch=0)  # no delay measured: the fixed steps still apply
    assert ahead is not None and float(ahead["w"]) == 2.0 + 1.5 * 2.0


def predicting(on: bool) -> StageRunner:
    """A block runner stepping at every microbatch of 2 samples, fed 4 in flight."""
    return pipelined_runner("stash", **{"train.predict_weights": str(on).lower()})


def run_pipelined(r: StageRunner, n: int = 12, in_flight: int = 4) -> tuple[list[int], list]:
    """Feed ``r`` 1F1B with ``in_flight`` microbatches in flight; returns each backward's
    delay in inner steps and the weights' move at the last step, seen from outside."""
    torch.manual_seed(0)
    at_forward: dict[str, int] = {}
    delays: list[int] = []
    move: list = []
    for i in range(n):
        r.block_forward(str(i), torch.randn(2, 8, 128), train=True)
        at_forward[str(i)] = r.step
        if i >= in_flight - 1:
            oldest = str(i - in_flight + 1)
            delays.append(r.step - at_forward[oldest])
            before = [p.detach().clone() for p in r.module.parameters()]
            r.block_backward(oldest, torch.randn(2, 8, 128))
            move = [p.detach() - b for p, b in zip(r.module.parameters(), before, strict=True)]
    return delays, move


def expected_delay(delays: list[int]) -> float:
    d = float(delays[0])
    for x in delays[1:]:
        d = (1 - DELAY_WEIGHT) * d + DELAY_WEIGHT * x
    return d


def test_a_training_forward_runs_on_the_predicted_weights_and_its_backward_there() -> None:
    r = predicting(True)
    delays, move = run_pipelined(r)
    assert delays[:4] == [0, 1, 2, 3] and set(delays[3:]) == {3}  # 1F1B: 3 steps late
    assert r.predictor.delay == pytest.approx(expected_delay(delays))
    tau = r.predictor.delay
    ahead = copy.deepcopy(r.module)
    with torch.no_grad():
        for p, m in zip(ahead.parameters(), move, strict=True):
            p.add_(m * tau)
    x, g = torch.randn(2, 8, 128), torch.randn(2, 8, 128)
    out = r.block_forward("p", x, train=True)
    xr = x.clone().requires_grad_(True)
    want = ahead(xr)
    assert torch.allclose(out, want.detach(), atol=1e-5)
    assert not torch.allclose(out, r.module(x).detach(), atol=1e-4)  # the prediction moved it
    # an eval forward runs on the live weights
    assert torch.allclose(r.block_forward("e", x, train=False), r.module(x).detach(), atol=1e-5)
    # the backward is the predicted weights' own, whatever steps came between, and no
    # copy of the live weights was stashed for it: its graph holds the predicted ones
    for i in range(2):
        r.block_forward(f"q{i}", torch.randn(2, 8, 128), train=True)
        r.block_backward(f"q{i}", torch.randn(2, 8, 128))
    assert r.num_saved == 4 and r.stash.num_stashed == 0
    want.backward(g)
    assert xr.grad is not None
    assert torch.allclose(r.block_backward("p", g), xr.grad, atol=1e-5)


def test_a_change_of_the_weights_other_than_a_step_ends_the_prediction() -> None:
    r = predicting(True)
    run_pipelined(r)
    theta = torch.nn.utils.parameters_to_vector(r.module.parameters()).detach()
    r._set_theta(theta + 0.01)  # as an outer step does
    x = torch.randn(2, 8, 128)
    assert torch.allclose(r.block_forward("a", x, train=True), r.module(x).detach(), atol=1e-5)


def test_off_the_delay_is_measured_and_the_forward_uses_the_live_weights() -> None:
    r = predicting(False)
    delays, _ = run_pipelined(r)
    assert r.predictor.delay == pytest.approx(expected_delay(delays))
    x = torch.randn(2, 8, 128)
    assert torch.allclose(r.block_forward("a", x, train=True), r.module(x).detach(), atol=1e-5)


def test_the_head_stage_never_predicts() -> None:
    """Its embedding's gradient is recomputed at the backward and its loss side's has no
    delay: there is nothing to predict for."""
    assert not built({"train.predict_weights": "true"}, stage=0).predictor.enabled
