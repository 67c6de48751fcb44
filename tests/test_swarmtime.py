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
