"""Issue 7's 1 % bound, measured where nothing but the poison differs between two runs.

Between real processes (``tests/test_poison_processes.py``) routing, staleness and pairing
follow the machine's timing, and clean runs alone differ by about 1.5 % std in eval loss,
so that test can only hold a poisoned run to 6 % of a clean one. Here the daemon's own
parts run in lockstep in this process, with every random choice seeded:

- one head replica and ``REPLICAS`` replicas of a single block stage, each a real
  ``StageRunner`` (forward, backward with weight stashing, clipped Adam on the configured
  schedule, NoLoCo offers, their decoding and distance, the outer step);
- the embedded corpus, one seeded stream of microbatches dealt round robin to the block
  replicas (SWARM routing spreads them evenly among equal replicas too);
- every ``sync.outer_steps`` steps the block replicas pair at random (a seeded draw over
  those not banned by each other, NoLoCo's one random partner; the odd one out takes a
  solo outer step, as does the lone head), and each side puts its partner's offer through
  ``node.services.sync.weight_screen``, the daemon's screen; a refusal bans the partner for good
  and the replica takes a solo step, as ``node.services.sync.SyncService`` does.

Two runs with the same seeds are bit-identical (tested over three rounds), so a poisoned run
against a control measures the poison's effect and nothing else. The poisoner is the last
block replica, its outgoing offers corrupted by ``sync.debug_poison`` (x1000, or NaN); the
others' eval loss must stay within 1 % of the control's. The control is not the clean run:
once the others ban the poisoner, three replicas pair and one steps alone each round, and
with the inner Adam's beta1 at 0.5 (the default) the one left alone in the last round ends
about 4 % above the clean run's paired replicas, poison or not (0.4 % at 0.9). So the control
is the same swarm with an honest last replica that the others refuse at the same draws:
the same bans, the same pairs, only the refused offers' contents differ. With the screen's
distance rule off the same x1000 poisoner wrecks them (tested), so the bound is not met by
accident.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch

from node.config import Config, resolve_config
from node.data.dataset import open_dataset
from node.services.sync import weight_screen
from node.stage.runner import StageRunner
from swarm.wirecodec import sync_codec_unmeasured

pytestmark = [pytest.mark.slow, pytest.mark.inprocess, pytest.mark.timeout(300)]

REPLICAS = 4
"""Block-stage replicas; the last one is the poisoner in a poisoned run."""
ROUNDS = 10
"""Outer rounds of every block replica."""
CATCH_UP_STEPS = 8
"""Steps a replica may lag at a round before it sits the round out."""
BOUND = 0.01
"""Issue 7: the others' eval loss within 1 % of a clean run."""
SETTINGS = {
    "swarm.num_block_stages": "1",
    "sync.method": "noloco",
    "sync.outer_steps": "5",
    "sync.schedule": "steps",  # lockstep replicas: a round every 5 steps, not on the clock
    "train.step_samples": "16",
    "train.warmup_steps": "10",
    "train.total_steps": "200",
    "train.eval_batches": "8",
    "data.batch_size": "8",
    "data.seq_len": "64",
    "node.threads": "1",
}


@dataclass
class Run:
    eval_loss: list[float]
    """Eval loss through the head and each block replica."""
    refused: list[int] = field(default_factory=lambda: [0] * REPLICAS)
    """Offers each block replica refused."""
    paired: list[int] = field(default_factory=lambda: [0] * REPLICAS)
    banned: list[set[int]] = field(default_factory=lambda: [set() for _ in range(REPLICAS)])
    late: int = 0
    """Microbatches run by replicas a skipped step had left behind the round."""
    fingerprints: list[float] = field(default_factory=list)
    """The sum of each block replica's slow weights after each round, in order."""

    @property
    def honest_loss(self) -> list[float]:
        return self.eval_loss[: REPLICAS - 1]


def config(extra: dict[str, str]) -> Config:
    return resolve_config(None, {}, {**SETTINGS, **extra})


def runner(c: Config, stage: int) -> StageRunner:
    r = StageRunner(c, stage)
    r._build()
    r.close()  # driven directly from this thread: its compute thread is not needed
    return r


def train(
    poison: str = "",
    screen_multiple: str | None = None,
    rounds: int = ROUNDS,
    until_wrecked: bool = False,
    refuse_last: bool = False,
) -> Run:
    """``rounds`` outer rounds, then the eval loss through each block replica. With
    ``until_wrecked``, fewer: training stops once every honest replica's slow weights sum to
    over ten times the poisoner's own (a x1000 offer averaged in) or are not finite. With
    ``refuse_last``, the others refuse the last replica's first offer to each of them as the
    screen refuses a poisoned one, and ban it."""
    extra = {} if screen_multiple is None else {"sync.screen_multiple": screen_multiple}
    base, poisoned = config(extra), config({**extra, "sync.debug_poison": poison})
    torch.manual_seed(0)
    head = runner(base, 0)
    blocks = [runner(poisoned if k == REPLICAS - 1 else base, 1) for k in range(REPLICAS)]
    screens = [weight_screen(base.sync) for _ in blocks]
    data = open_dataset(base.data, shard=0, seed=0, vocab_size=base.model.vocab_size)
    batches = torch.Generator().manual_seed(1)
    pairing = random.Random(2)
    per_step = base.train.step_samples // base.data.batch_size
    run = Run(eval_loss=[])

    def microbatch(k: int, mb_id: str) -> None:
        ids, labels = data.sample_batch(batches, base.data.batch_size, base.data.seq_len)
        out = blocks[k].block_forward(mb_id, head.head_embed(ids), train=True)
        _, grad = head.head_loss(out, labels, train=True)
        assert grad is not None
        head.head_backward(ids, blocks[k].block_backward(mb_id, grad))
        if head.sync_due:  # the lone head replica: solo outer steps
            head.apply_noloco(None)
            head.finish_sync(True)

    mb = 0
    for _ in range(rounds):
        for _ in range(base.sync.outer_steps * per_step):
            for k in range(REPLICAS):  # round robin: every replica steps in lockstep
                microbatch(k, f"mb{mb}")
                mb += 1
        # a replica whose spike guard skipped a step reaches the round that many steps
        # later; the others wait for it, as the daemon's round waits (up to a bound: one
        # that skips every step, say on NaN weights, sits the round out)
        for _ in range(CATCH_UP_STEPS * per_step):
            late = [k for k, b in enumerate(blocks) if b.sync_due != "outer"]
            if not late:
                break
            run.late += len(late)
            for k in late:
                microbatch(k, f"mb{mb}")
                mb += 1
        ready = [k for k, b in enumerate(blocks) if b.sync_due == "outer"]
        codec = sync_codec_unmeasured(base.sync.codec)
        offers = {k: blocks[k].outer_contribution(codec) for k in ready}
        order = list(ready)
        pairing.shuffle(order)
        partner: dict[int, int] = {}
        while len(order) >= 2:
            i = order.pop()
            j = next(
                (j for j in reversed(order) if j not in run.banned[i] and i not in run.banned[j]),
                None,
            )
            if j is None:
                continue  # nobody left who would pair with i: a solo step
            order.remove(j)
            partner[i], partner[j] = j, i
        for k in ready:
            b, offer = blocks[k], None
            if k in partner:
                offer = b.decode_offer(offers[partner[k]])
                refused = refuse_last and partner[k] == REPLICAS - 1  # the screen never sees it
                judge = screens[k].judge
                if refused or judge(offer.distance, offer.scale, offer.movement) is not None:
                    run.refused[k] += 1
                    run.banned[k].add(partner[k])
                    offer = None
                else:
                    run.paired[k] += 1
            b.apply_noloco(offer)
            b.finish_sync(True)
        sums = [float(b.phi.double().sum()) for b in blocks]
        run.fingerprints += sums
        if until_wrecked and all(
            not math.isfinite(x) or abs(x) > 10 * abs(sums[-1]) for x in sums[:-1]
        ):
            break
    evals = data.eval_batches(base.train.eval_batches, base.data.batch_size, base.data.seq_len)
    for k, b in enumerate(blocks):
        losses = [
            head.head_loss(
                b.block_forward(f"eval{k}", head.head_embed(ids), train=False), labels, train=False
            )[0]
            for ids, labels in evals
        ]
        run.eval_loss.append(sum(losses) / len(losses))
    return run


@pytest.fixture(scope="module")
def clean() -> Run:
    return train()


def test_runs_with_the_same_seeds_are_identical(clean: Run) -> None:
    again = train(rounds=3)  # the first three rounds again: every replica's slow weights
    assert again.fingerprints == clean.fingerprints[: 3 * REPLICAS]
    assert sum(clean.paired) >= REPLICAS * ROUNDS // 2  # replicas really average
    assert not any(clean.refused)  # and honest offers pass the screen
    assert clean.late == 0  # nothing spikes in a clean run: the replicas stay in lockstep
    assert all(math.isfinite(x) and x < 4.5 for x in clean.eval_loss), clean.eval_loss


@pytest.fixture(scope="module")
def left() -> Run:
    return train(refuse_last=True)


@pytest.mark.parametrize("poison", ["scale:1000", "nan"])
def test_a_poisoner_moves_the_others_eval_loss_by_under_1_percent(
    clean: Run, left: Run, poison: str
) -> None:
    run = train(poison)
    change = [p / c - 1 for p, c in zip(run.honest_loss, left.honest_loss, strict=True)]
    print(
        f"{poison}: clean {[round(x, 4) for x in clean.honest_loss]}, honest last replica "
        f"refused {[round(x, 4) for x in left.honest_loss]}, poisoned "
        f"{[round(x, 4) for x in run.honest_loss]}, change {[f'{c:+.3%}' for c in change]}, "
        f"refused {run.refused}"
    )
    poisoner = REPLICAS - 1
    # whoever drew the poisoner refused it once and never paired with it again
    assert all(r <= 1 for r in run.refused[:poisoner]) and sum(run.refused) >= 1
    assert all(poisoner in run.banned[k] for k in range(poisoner) if run.refused[k])
    # the control refused at the same draws: the same bans, so the same pairs
    assert left.refused == run.refused and left.banned == run.banned
    assert all(abs(c) <= BOUND for c in change)


def test_without_the_distance_rule_the_same_poisoner_wrecks_the_others() -> None:
    run = train("scale:1000", screen_multiple="0", until_wrecked=True)
    # the x1000 offers are averaged in: within a few rounds every honest replica holds
    # weights a thousand times too large (or NaN), and the run stops there. The poisoner
    # itself trains on honest weights of its own (only what it sends is corrupted): its
    # eval loss after the same rounds is the measure of an unharmed replica
    rounds = len(run.fingerprints) // REPLICAS
    assert all(p >= 1 for p in run.paired[: REPLICAS - 1])
    worst = max(run.honest_loss, key=lambda x: x if math.isfinite(x) else math.inf)
    unharmed = run.eval_loss[-1]
    print(f"unscreened x1000, {rounds} rounds: honest eval loss {run.honest_loss}, {unharmed}")
    assert not math.isfinite(worst) or worst > 1.1 * unharmed
