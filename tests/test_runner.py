"""The stage runner's maths: schedule, accumulation, weight stashing, state transfer."""

import copy
import math

import pytest
import torch

from node.config import TrainConfig, resolve_config
from node.stage.model import build_stage
from node.stage.runner import RATE_DECAY, StageRunner, lr_at


def test_lr_schedule() -> None:
    t = TrainConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(60, t) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(110, t) == pytest.approx(0.1)
    assert lr_at(10_000, t) == pytest.approx(0.1)


def built(overrides: dict[str, str], stage: int = 1) -> StageRunner:
    """A runner of ``stage`` with its model and optimizer built, on these settings."""
    r = StageRunner(resolve_config(None, {}, overrides), stage)
    r._build()
    return r


def runner(stage: int, **train: str) -> StageRunner:
    return built({"train.step_samples": "4", **{f"train.{k}": v for k, v in train.items()}}, stage)


def test_block_backward_matches_autograd_and_steps_after_step_samples() -> None:
    r = runner(1)
    ref = build_stage(r.config.model, 3, 1, seed=0)
    x = torch.randn(2, 8, 128)
    g = torch.randn(2, 8, 128)
    out = r.block_forward("a", x, train=True)
    xr = x.clone().requires_grad_(True)
    outr = ref(xr)
    assert torch.allclose(out, outr.detach(), atol=1e-5)
    gin = r.block_backward("a", g)
    outr.backward(g)
    assert torch.allclose(gin, xr.grad, atol=1e-5)  # type: ignore[arg-type]
    assert r.step == 0  # 2 of 4 samples
    r.block_forward("b", x, train=True)
    r.block_backward("b", g)
    assert r.step == 1 and r.samples == 4
    assert 0 < r.thermo.grad_norm <= 1.0


def test_job_time_is_known_from_the_first_forward() -> None:
    """The wire codec is chosen by the job time before a node's first backward: behind a
    thin uplink its first round trip may never complete (it stayed 0 for 19 s at 1 Mbit/s,
    and the node kept bf16 the while)."""
    r = runner(1)
    assert r.job_s == 0.0
    x = torch.randn(2, 8, 128)
    r.block_forward("a", x, train=True)
    forward_s = r.compute_s
    assert r.service_rate == 0.0  # no sample finished yet
    assert r.job_s == pytest.approx(forward_s)
    r.block_backward("a", torch.randn(2, 8, 128))
    backward_s = r.compute_s - forward_s
    decay = RATE_DECAY  # each job weighs this much less after the next one
    mean = (decay * forward_s + backward_s) / (decay + 1)
    assert r.job_s == pytest.approx(mean)
    assert r.service_rate == pytest.approx(2 / (decay * forward_s + backward_s))


def test_a_seeded_rate_gives_the_job_time_of_half_a_microbatch() -> None:
    r = runner(1)
    r.seed_rate(12.5)  # samples per second
    assert r.job_s == pytest.approx(r.config.data.batch_size / 12.5 / 2)
    assert r.service_rate == pytest.approx(12.5)
    r.seed_rate(0.0)
    assert r.job_s == 0.0 and r.service_rate == 0.0


def _grads_with(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple:
    """Input gradient and parameter gradients of ``module`` (a copy) for ``x`` and ``g``."""
    m = copy.deepcopy(module)
    xr = x.clone().requires_grad_(True)
    m(xr).backward(g)
    return xr.grad, [p.grad.clone() for p in m.parameters()]


def test_backward_after_a_step_uses_the_forwards_own_weights() -> None:
    r = runner(1, step_samples="2")
    x, g = torch.randn(1, 8, 128), torch.randn(1, 8, 128)  # one sample: it will not step
    want_in, want_params = _grads_with(r.module, x, g)  # the weights "old" saw
    r.block_forward("old", x, train=True)
    r.block_forward("new", torch.randn(2, 8, 128), train=True)
    r.block_backward("new", torch.randn(2, 8, 128))  # steps: "old"'s weights are stashed
    assert r.step == 1 and r.stash.num_stashed == 1
    now_in, _ = _grads_with(r.module, x, g)
    assert not torch.allclose(now_in, want_in, atol=1e-4)  # the step did change the weights
    gin = r.block_backward("old", g)  # must not raise the in-place modification error
    assert torch.allclose(gin, want_in, atol=1e-5)
    for p, want in zip(r.module.parameters(), want_params, strict=True):
        assert torch.allclose(p.grad, want, atol=1e-5)
    assert r.stash.num_stashed == 0  # no graph refers to the old weights any more


def test_stash_survives_an_outer_step_and_is_freed_by_expiry() -> None:
    r = runner(1, step_samples="2")
    x, g = torch.randn(2, 8, 128), torch.randn(2, 8, 128)
    want_in, _ = _grads_with(r.module, x, g)
    r.block_forward("a", x, train=True)
    theta = torch.nn.utils.parameters_to_vector(r.module.parameters()).detach()
    r._weights_change()  # an outer step replaces the weights' storage with one flat vector
    torch.nn.utils.vector_to_parameters(theta + 0.1, r.module.parameters())
    r.block_forward("b", x, train=True)  # built on the new, shared storage
    r._weights_change()
    with torch.no_grad():
        for p in r.module.parameters():
            p.mul_(0.5)  # and an in-place change to that
    assert r.stash.num_stashed == 2
    assert torch.allclose(r.block_backward("a", g), want_in, atol=1e-5)
    assert r.stash.num_stashed == 1
    saved_at = r._saved["b"].created_s
    assert r.expire_saved(saved_at + r.train.activation_ttl_s + 1) == 1
    assert r.stash.num_stashed == 0


def test_no_stash_when_no_graph_is_waiting() -> None:
    r = runner(1, step_samples="2")
    x, g = torch.randn(2, 8, 128), torch.randn(2, 8, 128)
    r.block_forward("a", x, train=True)
    r.block_backward("a", g)
    assert r.step == 1 and r.stash.num_stashed == 0


def test_eval_forward_saves_nothing_and_ttl_expires() -> None:
    r = runner(2, activation_ttl_s="5")
    r.block_forward("e", torch.randn(1, 4, 128), train=False)
    assert not r.has_saved("e")
    r.block_forward("t", torch.randn(1, 4, 128), train=True)
    assert r.has_saved("t")
    saved_at = r._saved["t"].created_s
    assert r.expire_saved(saved_at + 4) == 0
    assert r.expire_saved(saved_at + 6) == 1 and not r.has_saved("t")


def test_head_loss_and_backward() -> None:
    r = runner(0)
    ids = torch.randint(0, 256, (2, 16))
    h = r.head_embed(ids)
    loss, grad = r.head_loss(h, ids, train=True)
    assert abs(loss - math.log(256)) < 0.5 and grad is not None and grad.shape == h.shape
    r.head_backward(ids, torch.randn_like(h))
    assert r.module.tok_embedding.weight.grad is not None
    eval_loss, none = r.head_loss(h, ids, train=False)
    assert none is None and eval_loss == pytest.approx(loss, abs=1e-5)


def test_head_step_averages_each_side_over_the_microbatches_it_holds() -> None:
    """With microbatches in flight, another microbatch's loss reaches the head before the
    first one's gradient is back: the output side (final norm, LM head) then holds two
    microbatches' gradients and the embedding one. The step must apply each side's mean, the
    gradient one microbatch alone gives, not the output side's sum (which made the LM head's
    step size depend on how many losses arrived in between)."""
    applied: dict[str, list[dict[str, torch.Tensor]]] = {"alone": [], "interleaved": []}
    runners = {}
    for name in applied:
        r = runner(0, step_samples="2", clip_norm="1e9")
        named = dict(r.module.named_parameters())

        def record(opt: object, r=r, name=name, named=named) -> None:
            applied[name].append(
                {k: p.grad.clone() for k, p in named.items() if p.grad is not None}
            )

        r.optimizer.register_step_pre_hook(record)
        runners[name] = r
    ids = torch.randint(0, 256, (2, 16))
    for name, losses in (("alone", 1), ("interleaved", 2)):
        r = runners[name]
        h = r.head_embed(ids)
        for _ in range(losses):  # the same microbatch, so every mean equals its gradient
            _, grad = r.head_loss(h, ids, train=True)
        assert grad is not None
        r.head_backward(ids, grad)
        assert r.step == 1
    alone, interleaved = applied["alone"][0], applied["interleaved"][0]
    assert alone.keys() == interleaved.keys() >= {"lm_head.weight", "tok_embedding.weight"}
    for k in alone:
        assert torch.allclose(interleaved[k], alone[k], rtol=1e-5, atol=1e-7), k


def test_snapshot_load_round_trip_and_bad_state() -> None:
    a, b = runner(1, step_samples="2"), runner(1)
    x, g = torch.randn(2, 8, 128), torch.randn(2, 8, 128)
    a.block_forward("m", x, train=True)
    a.block_backward("m", g)
    tensors, step, samples = a.snapshot()
    assert step == 1 and any(k.startswith("adam_m.") for k in tensors)
    b.load(tensors, step, samples)
    assert b.step == 1
    for (ka, va), (kb, vb) in zip(
        a.module.state_dict().items(), b.module.state_dict().items(), strict=True
    ):
        assert ka == kb and torch.equal(va, vb)
    assert torch.equal(b.block_forward("z", x, train=False), a.block_forward("z", x, train=False))
    bad = dict(tensors)
    key = next(k for k in bad if k.startswith("param."))
    bad[key] = torch.full_like(bad[key], float("nan"))
    with pytest.raises(ValueError, match="not finite"):
        b.load(bad, 1, 2)
    with pytest.raises(ValueError, match="wrong parameter names"):
        b.load({"param.x": torch.ones(1)}, 1, 2)


# ---- NoLoCo between two replicas, stepped by hand -----------------------------------------


def noloco_by_the_rule(
    me: dict[str, torch.Tensor], partner: dict[str, torch.Tensor], a: float, b: float, c: float
) -> dict[str, torch.Tensor]:
    """An independent statement of NoLoCo's outer step (arXiv 2506.10911, section 3, as the
    reference code applies it), in float64 from each member's theta, phi and m before it."""
    d_me, d_partner = me["theta"] - me["phi"], partner["theta"] - partner["phi"]
    g_bar = (d_me + d_partner) / 2
    phi_bar = (me["phi"] + partner["phi"]) / 2
    m = a * me["m"] + b * g_bar + c * (phi_bar - me["phi"])
    return {"phi": me["phi"] + m, "m": m, "theta": me["phi"] + m}


def outer_state(r: StageRunner) -> dict[str, torch.Tensor]:
    theta = torch.cat([p.detach().flatten() for p in r.module.parameters()])
    return {"theta": theta.double(), "phi": r.phi.double(), "m": r.outer.m.double()}


def test_both_members_of_a_noloco_pair_follow_the_rule() -> None:
    """The answering replica applies its own outer step while its reply is still on the wire
    (the daemon writes a reply after its handler returned): what it offered must not change
    under the asker. With the offer sharing ``phi``'s memory the asker ended 9e-3 away."""
    a, b = runner(1), runner(1)
    gen = torch.Generator().manual_seed(3)
    for rnd in range(2):  # the second round starts with a non-zero outer momentum
        for r in (a, b):  # inner steps: the replicas' fast weights move apart
            with torch.no_grad():
                for p in r.module.parameters():
                    p.add_(0.02 * torch.randn(p.shape, generator=gen))
        before_a, before_b = outer_state(a), outer_state(b)
        offer_a, offer_b = a.outer_contribution("fp32"), b.outer_contribution("fp32")
        b.apply_noloco(b.decode_offer(offer_a))  # b answered a's request and steps at once
        a.apply_noloco(a.decode_offer(offer_b))  # ...before a decodes b's reply
        for r, want in (
            (a, noloco_by_the_rule(before_a, before_b, 0.5, 0.7, 0.7)),
            (b, noloco_by_the_rule(before_b, before_a, 0.5, 0.7, 0.7)),
        ):
            got = outer_state(r)
            for key in ("theta", "phi", "m"):
                err = float((got[key] - want[key]).abs().max())
                assert err < 1e-6, f"round {rnd}: {key} is {err:.2e} from the rule"


def test_a_noloco_pair_shares_its_place_in_the_learning_rate_schedule() -> None:
    """A replica 4x slower than its partner has taken a quarter of its inner steps; keyed on
    its own count it would still be warming up while its partner is at the peak rate. At a
    paired outer step both take the mean place (``swarm.outer.pair_position``): 10 and 30 ->
    20, so both step next at ``lr_at(20)``; the place travels with a copied state."""
    x, g = torch.randn(2, 8, 128), torch.randn(2, 8, 128)
    warm = {"warmup_steps": "40", "lr": "1.0"}
    slow, fast = runner(1, **warm), runner(1, **warm)
    slow.schedule_step, fast.schedule_step = 10.0, 30.0
    offer_slow, offer_fast = slow.outer_contribution("fp32"), fast.outer_contribution("fp32")
    assert offer_slow[1]["position"] == 10.0
    slow.apply_noloco(slow.decode_offer(offer_fast))
    fast.apply_noloco(fast.decode_offer(offer_slow))
    assert slow.schedule_step == fast.schedule_step == 20.0
    assert slow.step == fast.step == 0  # the steps each took are their own
    for r in (slow, fast):  # the next inner step runs at the shared place's rate
        r.block_forward("m", x, train=True)  # two microbatches of 2 samples: one step of 4
        r.block_backward("m", g)
        r.block_forward("n", x, train=True)
        r.block_backward("n", g)
        assert r.step == 1 and r.schedule_step == 21.0
        assert r.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(20, r.train))
    # a solo step keeps the replica's own place
    fast.schedule_step = 50.0
    fast.apply_noloco(None)
    assert fast.schedule_step == 50.0
    # a copy takes its donor's place, not its step count
    tensors, step, samples = fast.snapshot()
    copier = runner(1, **warm)
    copier.load(tensors, step, samples)
    assert (copier.step, copier.schedule_step) == (1, 50.0)
    # a place no honest peer sends is not taken: the copier falls back to the step
    for bad in (math.nan, -1.0, math.inf):
        tensors["sched.position"] = torch.tensor([bad], dtype=torch.float64)
        copier.load(tensors, step, samples)
        assert copier.schedule_step == 1.0


def test_a_replica_short_of_the_usual_steps_decays_its_inner_momentum() -> None:
    """At an outer step on the clock, a replica that took 2 inner steps where the stage's
    usual is 5 scales Adam's first moment by beta1 ** 3, 0.9 ** 3 here
    (``swarm.outer.momentum_decay``), and leaves the second moment alone
    (``sync.decay_momentum`` on); at the usual pace, off the clock (no usual count) or with
    the setting off (the default), nothing changes."""
    x, g = torch.randn(2, 8, 128), torch.randn(2, 8, 128)

    def stepped(**sync: str) -> StageRunner:
        settings = {"train.step_samples": "4", "train.betas": "0.9,0.999"}
        r = built({**settings, **{f"sync.{k}": v for k, v in sync.items()}})
        for k in range(2):  # two inner steps of two microbatches
            for mb in (f"a{k}", f"b{k}"):
                r.block_forward(mb, x, train=True)
                r.block_backward(mb, g)
        assert r.round_steps == 2
        return r

    def moments(r: StageRunner) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in r.optimizer.state.values()]

    on = {"decay_momentum": "true"}
    for sync, ref_steps, factor in (
        (on, 5.0, 0.9**3),
        (on, 2.0, 1.0),
        (on, 0.0, 1.0),
        ({}, 5.0, 1.0),  # off by default
    ):
        r = stepped(**sync)
        before = moments(r)
        r.apply_noloco(None, ref_steps)  # a solo outer step
        after = moments(r)
        assert len(after) == len(before) > 0
        for (m0, v0), (m1, v1) in zip(before, after, strict=True):
            assert torch.allclose(m1, m0 * factor, rtol=1e-6, atol=0), (sync, ref_steps)
            assert torch.equal(v1, v0)


def test_on_the_clock_places_advance_by_the_stages_usual_steps_not_each_replicas() -> None:
    """A round in which two fast replicas took 3 inner steps and two slow ones 1, where the
    stage's usual is 2, and the pairs were fast with fast and slow with slow. Keyed on their
    own steps (``sync.place_by_usual_steps`` off, the default) the pairs end at places 3
    and 1, three times the warm-up's rate apart; advanced by the usual steps every replica
    ends at 0 + 2 = 2. A solo step advances by it too; without a usual count (the steps
    schedule) a place is the replica's own steps."""
    x, g = torch.randn(2, 8, 128), torch.randn(2, 8, 128)

    def stepped(steps: int, **sync: str) -> StageRunner:
        settings = {"train.step_samples": "4", "train.betas": "0.9,0.999"}
        r = built({**settings, **{f"sync.{k}": v for k, v in sync.items()}})
        for k in range(steps):  # inner steps of two microbatches of 2 samples
            for mb in (f"a{k}", f"b{k}"):
                r.block_forward(mb, x, train=True)
                r.block_backward(mb, g)
        assert r.schedule_step == steps
        return r

    def paired_round(**sync: str) -> list[float]:
        fast = [stepped(3, **sync), stepped(3, **sync)]
        slow = [stepped(1, **sync), stepped(1, **sync)]
        for a, b in (fast, slow):
            offer_a, offer_b = a.outer_contribution("fp32", 2.0), b.outer_contribution("fp32", 2.0)
            a.apply_noloco(a.decode_offer(offer_b), 2.0)
            b.apply_noloco(b.decode_offer(offer_a), 2.0)
        return [r.schedule_step for r in (*fast, *slow)]

    usual = {"place_by_usual_steps": "true"}
    assert paired_round(**usual) == [2.0, 2.0, 2.0, 2.0]
    assert paired_round() == [3.0, 3.0, 1.0, 1.0]
    solo = stepped(3, **usual)
    solo.apply_noloco(None, 2.0)
    solo.finish_sync(True)
    assert solo.schedule_step == 2.0
    for _ in range(3):  # the next round: 3 more steps, then the usual 2 from its last place
        for mb in ("c", "d"):
            solo.block_forward(mb, x, train=True)
            solo.block_backward(mb, g)
    assert solo.schedule_step == 5.0
    solo.apply_noloco(None, 2.0)
    assert solo.schedule_step == 4.0
    unclocked = stepped(3, **usual)
    unclocked.apply_noloco(None, 0.0)
    assert unclocked.schedule_step == 3.0


def test_share_schedule_off_or_a_partner_that_says_no_place_keeps_its_own() -> None:
    mine = built({"sync.share_schedule": "false"})
    other = runner(1)
    mine.schedule_step, other.schedule_step = 4.0, 12.0
    assert mine.outer_contribution("fp32")[1]["position"] == -1.0  # not said
    mine.apply_noloco(mine.decode_offer(other.outer_contribution("fp32")))
    other.apply_noloco(other.decode_offer(mine.outer_contribution("fp32")))
    assert (mine.schedule_step, other.schedule_step) == (4.0, 12.0)


def test_a_partner_that_lies_about_its_place_moves_ours_by_a_bounded_step() -> None:
    from node.stage.runner import PLACE_ROUNDS

    victim, liar = runner(1), runner(1)
    victim.schedule_step, liar.schedule_step = 100.0, 1e12
    victim.apply_noloco(victim.decode_offer(liar.outer_contribution("fp32")))
    limit = PLACE_ROUNDS * victim.sync.outer_steps  # 8 rounds of H = 50
    assert victim.schedule_step == 100.0 + limit / 2
    assert victim.places_clamped == 1  # counted (murmur_sync_places_clamped)
    honest = runner(1)
    honest.schedule_step = victim.schedule_step + limit  # at the bound: not clamped
    victim.apply_noloco(victim.decode_offer(honest.outer_contribution("fp32")))
    assert victim.places_clamped == 1


def test_a_mean_place_beyond_the_float_range_is_not_taken() -> None:
    """A DiLoCo ring's place is a sum: one member that sends 1.7e308 can push it to inf."""
    r = runner(1)
    r.schedule_step = 40.0
    for mean in (math.inf, -math.inf, math.nan):
        r.take_place(mean)
    assert r.schedule_step == 40.0 and r.places_clamped == 3


@pytest.mark.parametrize("position", [math.nan, math.inf, -2.0, 1e13, "7", True])
def test_an_offer_with_a_place_no_honest_peer_sends_is_refused(position: object) -> None:
    a, b = runner(1), runner(1)
    tensors, meta = b.outer_contribution("fp32")
    meta["position"] = position
    with pytest.raises(ValueError, match="position"):
        a.decode_offer((tensors, meta))


def pipelined_runner(staleness: str, **overrides: str) -> StageRunner:
    """A block runner fed as a head with 4 microbatches of 2 samples in flight feeds it."""
    settings = {
        "train.step_samples": "2",
        "data.batch_size": "2",
        "train.max_in_flight": "4",
        "train.staleness": staleness,
        **overrides,
    }
    return built(settings)


@pytest.mark.parametrize(("staleness", "most"), [("stash", 3), ("2bw", 1)])
def test_2bw_takes_at_most_one_inner_step_between_a_forward_and_its_backward(
    staleness: str, most: int
) -> None:
    r = pipelined_runner(staleness)
    in_flight, x, g = 4, torch.randn(2, 8, 128), torch.randn(2, 8, 128)
    assert r.step_units == (4 if staleness == "2bw" else 1)  # 4 x 2 samples over 2 per unit
    opt_steps_at_forward: dict[str, int] = {}
    between = []
    for i in range(24):
        r.block_forward(str(i), x, train=True)
        opt_steps_at_forward[str(i)] = r.step // r.step_units
        if i >= in_flight - 1:  # the oldest in flight comes back: 1F1B with 4 in flight
            oldest = str(i - in_flight + 1)
            between.append(r.step // r.step_units - opt_steps_at_forward[oldest])
            r.block_backward(oldest, g)
    assert max(between) == most
    # the step counts units of step_samples samples: 21 backwards of 2 samples, and 2bw
    # steps every 8 samples (5 steps of 4 units); the schedule is read at those units
    assert r.samples == 42 and r.step == (20 if staleness == "2bw" else 21)
    assert r.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(r.step - r.step_units, r.train))


def test_2bw_outer_round_comes_due_when_a_coarse_step_crosses_its_boundary() -> None:
    r = pipelined_runner(
        "2bw", **{"sync.method": "noloco", "sync.schedule": "steps", "sync.outer_steps": "6"}
    )
    x, g = torch.randn(2, 8, 128), torch.randn(2, 8, 128)
    now = [100.0]
    r.monotonic = lambda: now[0]
    for i in range(8):  # 16 samples: two inner steps, at units 4 and 8 (a round: every 6)
        r.block_forward(str(i), x, train=True)
        if i == 7:  # the second step comes 8 s after the first: 2 s per unit of 2 samples
            now[0] += 8.0
        r.block_backward(str(i), g)
        assert r.sync_due == ("outer" if i == 7 else None)
    assert r.step == 8 and r.hold
    assert r.step_s == 2.0  # the clock schedule's period: H units, not H coarse steps
    r.finish_sync(True)
    assert r.outer_rounds == 1 and r.round_steps == 0


@pytest.mark.parametrize("flush", [True, False])
async def test_the_compute_thread_flushes_subnormal_floats_to_zero_when_set(flush: bool) -> None:
    settings = {"node.flush_denormal": str(flush).lower()}
    r = StageRunner(resolve_config(None, {}, settings), 1)
    await r.start()  # builds the stage on its compute thread, which sets the flag
    try:
        product = await r.compute(lambda: float(torch.tensor([1e-39]) * 1.0))
    finally:
        r.close()
    # 1e-39 is subnormal in fp32: flushed, the product is 0; kept, about 1e-39
    assert product == 0.0 if flush else product == pytest.approx(1e-39, rel=1e-3)
