"""``node.net.swarmtime``: the proofs' clock follows what most sealing members say, with
hand-made samples (a request sent at t0 and answered at t3 on this machine's wall clock,
sealed at t1 by the peer's)."""

from __future__ import annotations

import logging

import pytest

from node.net.swarmtime import UPDATE_S, SwarmTime
from protocol.auth import Identity, SwarmAuth

T = 1_800_000_000.0


class Mono:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def sample(
    time: SwarmTime, mono: Mono, peer: str, ahead_s: float, after_s: float = UPDATE_S
) -> None:
    """One exchange with ``peer`` ``after_s`` after the last (by default, late enough to
    renew the estimate), its seal ``ahead_s`` ahead of this machine's wall clock."""
    rtt_s = 0.02
    mono.t += after_s
    t0 = T + mono.t  # this machine's wall clock keeps pace with its monotonic one
    time.observe(peer, t0, t0 + rtt_s / 2 + ahead_s, t0 + rtt_s)


@pytest.fixture
def setup() -> tuple[SwarmTime, Mono]:
    mono = Mono()
    auth = SwarmAuth(b"a swarm key for the tests", Identity.from_seed(bytes(32)))
    return SwarmTime(auth, mono), mono


def test_a_joiner_hours_behind_takes_its_bootstraps_time_then_the_majoritys(
    setup: tuple[SwarmTime, Mono], caplog: pytest.LogCaptureFixture
) -> None:
    time, mono = setup
    with caplog.at_level(logging.WARNING, logger="node.net.swarmtime"):
        sample(time, mono, "bootstrap", 7200.0)
    assert time.auth.clock_offset_s == pytest.approx(7200.0)
    assert "clock is 7200 s behind the swarm's (1 of 1 members measured agree)" in caplog.text
    assert "set this machine's clock" in caplog.text
    sample(time, mono, "b", 7200.5)
    sample(time, mono, "wrong", -40.0)  # a member with a wrong clock of its own
    assert time.auth.clock_offset_s == pytest.approx(7200.25)  # the two that agree
    assert time.status() == {"offset_s": 7200.25, "members_measured": 3, "corrections": 1}


def test_a_clock_that_agrees_is_not_moved_by_one_wrong_member(
    setup: tuple[SwarmTime, Mono],
) -> None:
    time, mono = setup
    sample(time, mono, "wrong", 3600.0)  # the only member known: followed, to reach it
    assert time.auth.clock_offset_s == pytest.approx(3600.0)
    sample(time, mono, "a", 0.004)  # one member agrees with this clock: it counts 1.5
    assert time.auth.clock_offset_s == 0.0
    for _ in range(5):
        sample(time, mono, "a", -0.003)
        sample(time, mono, "b", 0.002)
    assert time.auth.clock_offset_s == 0.0  # no millisecond nudges
    assert time.corrections == 2


def test_the_estimate_is_renewed_at_most_every_update_s(setup: tuple[SwarmTime, Mono]) -> None:
    time, mono = setup
    sample(time, mono, "a", 600.0)
    sample(time, mono, "b", 900.0, after_s=0.1)  # two more within a second: read at the
    sample(time, mono, "c", 900.0, after_s=0.1)  # next renewal
    assert time.auth.clock_offset_s == pytest.approx(600.0)
    sample(time, mono, "b", 900.0)
    assert time.auth.clock_offset_s == pytest.approx(900.0)


@pytest.mark.parametrize("skews", [(0, 300), (0, 0, 300, 300), (0, 0, 0, 300, 300, 300)])
def test_a_swarm_split_half_and_half_between_two_clocks_settles_on_one(
    skews: tuple[int, ...],
) -> None:
    """Members measure each other's *proof* clocks (a seal carries its sealer's corrected
    time), so a correction feeds back: in a swarm split half and half, each half first
    takes the other's time, and the two could swap for ever. With real ``SwarmTime``s
    exchanging at random (five seeds; 5 to 50 ms round trips; a seal from every exchange,
    as stale refusals are sealed too), every member's proofs settle on one time within 15 s
    and stay there."""
    import random

    key = b"a swarm key for the tests"
    for seed in range(5):
        rng, mono = random.Random(seed), Mono()
        members = [(skew, SwarmTime(SwarmAuth(key, Identity.generate()), mono)) for skew in skews]
        proofs: list[tuple[float, ...]] = []
        for _ in range(400):  # 40 s, an exchange every 0.1 s
            mono.t += 0.1
            (skew_a, a), (skew_b, b) = rng.sample(members, 2)
            rtt = rng.uniform(0.005, 0.05)
            sent = T + mono.t + skew_a  # a's wall clock
            sealed = T + mono.t + rtt / 2 + skew_b + b.auth.clock_offset_s  # b's proof clock
            a.observe(b.auth.identity.peer_id, sent, sealed, sent + rtt)
            proofs.append(tuple(skew + m.auth.clock_offset_s for skew, m in members))
        settled = proofs[150:]  # from 15 s on: one time, give or take the round trips
        final = proofs[-1]
        assert max(final) - min(final) < 0.1, (seed, final)
        assert all(abs(x - final[0]) < 0.1 for p in settled for x in p), (seed, proofs[::20])
