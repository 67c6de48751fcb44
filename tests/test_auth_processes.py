"""Real ``node join`` processes: a keyed swarm trains while strangers, wrong keys, replays,
tampered frames and impersonators are refused; a node keeps its peer id across restarts."""

from __future__ import annotations

import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node.client import NodeRefused, fetch_status, request_eval
from node.demo import LocalSwarm, wait_ready
from node.identity import IDENTITY_FILE
from protocol.auth import AUTH_HEADER, Identity, SwarmAuth, frame_digest
from protocol.frames import join_frame
from protocol.messages import Error, Leave, Message, decode_message, encode_message
from tests.helpers import FAST_SWARM, LIBFAKETIME, wait_for, wrong_clock

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FAST = {  # two nodes, one block stage, a light pipeline: patient enough for a loaded machine
    **FAST_SWARM,
    "train.eval_batches": "1",
    "train.max_in_flight": "2",
    "train.hop_timeout_s": "10",
    "train.microbatch_deadline_s": "30",
    "membership.ttl_s": "8",
    "swarm.num_block_stages": "1",
}


@pytest.fixture
def swarms(tmp_path: Path) -> Iterator[Any]:
    started: list[LocalSwarm] = []

    def make(**settings: str) -> LocalSwarm:
        s = LocalSwarm(tmp_path, {**FAST, **settings})
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop(grace_s=5.0)


def completed(address: str) -> int:
    return int(fetch_status(address)["counters"].get("microbatches_completed", 0))


def post(address: str, msg: Message, auth: SwarmAuth | None, **tamper: Any) -> tuple[int, Any]:
    """POST ``msg``, sealed by ``auth`` (or not); ``tamper`` swaps the header or body."""
    buffers = encode_message(msg)
    headers: dict[str, str] = {}
    if auth is not None:
        sent = auth.sign_request(address, "POST", "/rpc", frame_digest(buffers), time.time())
        headers[AUTH_HEADER] = sent.header
    headers.update(tamper.get("headers", {}))
    body = tamper.get("body", join_frame(buffers))
    req = urllib.request.Request(f"http://{address}/rpc", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, decode_message(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, decode_message(e.read())


def test_a_keyed_swarm_trains_and_refuses_outsiders(swarms: Any, tmp_path: Path) -> None:
    key = secrets.token_hex(32)
    key_file = tmp_path / "swarm.key"
    key_file.write_text(key + "\n")
    s = swarms(**{"net.swarm_key_file": str(key_file)})
    head, block = s.start_node(0), s.start_node(1)
    head_id = wait_ready(head, 90, s)["peer_id"]
    wait_ready(block, 90, s)
    wait_for(lambda: completed(head) >= 5, 120, "keyed training")
    assert fetch_status(block)["auth"] == "swarm_key" and len(head_id) == 32

    member = SwarmAuth(key.encode(), Identity.generate())  # holds the key, has its own id
    me = Leave(peer_id=member.identity.peer_id)  # harmless: forget a peer nobody knows
    wrong_key = SwarmAuth(b"not this swarm's key at all", Identity.generate())

    def header(stamp: float) -> dict[str, Any]:
        sent = member.sign_request(block, "POST", "/rpc", frame_digest(encode_message(me)), stamp)
        return {"headers": {AUTH_HEADER: sent.header}}

    sealed, tampered = header(time.time()), join_frame(encode_message(Leave(peer_id="0" * 32)))
    cases = [
        ("member", me, None, sealed, "ok"),
        ("replayed", me, None, sealed, "auth_replay"),
        ("no key", me, None, {}, "auth_missing"),
        ("wrong key", me, wrong_key, {}, "auth_bad_mac"),
        ("tampered", me, member, {"body": tampered}, "auth_bad_mac"),
        ("stale", me, None, header(time.time() - 300), "auth_stale"),
        ("impersonating", Leave(peer_id=head_id), member, {}, "identity_mismatch"),
    ]
    for what, msg, auth, tamper, code in cases:
        status, reply = post(block, msg, auth, **tamper)
        got = reply.code if isinstance(reply, Error) else "ok"
        assert got == code, (what, status, reply)
        assert (status == 200) == (code == "ok"), (what, status)
    counters = fetch_status(block)["counters"]
    for code in {c[-1] for c in cases} - {"ok"}:
        assert counters[f"rejected_{code}"] >= 1, (code, counters)
    assert head_id in {p["peer_id"] for p in fetch_status(block)["peers"]["0"]}  # not forgotten
    with pytest.raises(NodeRefused, match="auth_missing") as refused:  # evaluating too
        request_eval(head, timeout_s=10)
    assert refused.value.status == 401
    assert request_eval(head, timeout_s=120, auth=member) > 0

    # a volunteer given the wrong key is told why nobody takes it (not only the head's log)
    other_file = tmp_path / "other.key"
    other_file.write_text(secrets.token_hex(32))
    outsider = s.start_node(1, extra=["--set", f"net.swarm_key_file={other_file}"])
    outsider_log = s.log_dir / f"stage1-{outsider.rsplit(':', 1)[1]}.log"
    told = f"bootstrap {head}: refused us (auth_bad_mac"
    wait_for(lambda: told in outsider_log.read_text(), 60, "the outsider told why")

    # the right key but a clock two hours ahead (the machine's, where libfaketime is
    # installed): refused as stale and told to set the clock, but the refusal is sealed
    # with the head's time, so it stamps its proofs with the swarm's time and joins
    if LIBFAKETIME.exists():
        extra, env = wrong_clock(7200)
        late = s.start_node(1, extra=extra, env=env)
        late_log = s.log_dir / f"stage1-{late.rsplit(':', 1)[1]}.log"
        stale = f"bootstrap {head}: refused us (auth_stale: request stamped"
        advice = "set this machine's clock (NTP"
        corrected = "this machine's clock is 7200 s ahead of the swarm's"
        wait_for(
            lambda: all(t in late_log.read_text() for t in (stale, advice, corrected)),
            60,
            "the wrong clock told why, and what to do, and corrected",
            describe=lambda: late_log.read_text()[-1500:],
        )
        late_status = wait_ready(late, 120, s)
        assert late_status["swarm_time"]["offset_s"] == pytest.approx(-7200, abs=2)
        wait_for(lambda: fetch_status(late)["samples"] > 0, 120, "the corrected node trains")

    done = completed(head)
    wait_for(lambda: completed(head) >= done + 5, 120, "training after the refusals")
    assert outsider_log.read_text().count(told) == 1  # once, not every round
    logs = "".join(p.read_text() for p in s.log_dir.glob("stage*.log"))
    assert "swarm key set" in logs and "swarm is open" not in logs
    assert key not in logs


def test_a_restarted_node_keeps_its_identity(swarms: Any, tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = swarms()
    address = first.start_node(0, extra=["--state-dir", str(state)])
    peer_id = wait_ready(address, 90, first)["peer_id"]
    first.stop(grace_s=10.0)
    log = next(first.log_dir.glob("stage0-*.log")).read_text()
    assert "swarm is open" in log  # no key: the daemon says so at start-up
    assert peer_id == Identity.from_pem((state / IDENTITY_FILE).read_bytes()).peer_id

    again = swarms()
    address = again.start_node(0, extra=["--state-dir", str(state)])
    assert wait_ready(address, 90, again)["peer_id"] == peer_id


def test_a_keyed_swarm_of_neighbourhoods_trains(swarms: Any, tmp_path: Path) -> None:
    # four stages: each table holds its stage and the two next to it, so the head and
    # stage 2 never greet each other; summaries, hellos and hops all go through the key
    key_file = tmp_path / "swarm.key"
    key_file.write_text(secrets.token_hex(32) + "\n")
    s = swarms(**{"net.swarm_key_file": str(key_file), "swarm.num_block_stages": "3"})
    addresses = [s.start_node(stage) for stage in (0, 1, 2, 3)]
    for a in addresses:
        wait_ready(a, 90, s)
    head = addresses[0]
    wait_for(lambda: completed(head) >= 5, 180, "keyed training through four stages")
    st = fetch_status(head)
    assert sorted(st["peers"]) == ["0", "1", "3"]
    assert not st["stages"]["2"]["held"] and st["stages"]["2"]["ready"] == 1
    middle = fetch_status(addresses[2])
    assert sorted(middle["peers"]) == ["1", "2", "3"] and middle["stages"]["0"]["ready"] == 1
    for a in addresses:  # members never refuse each other's signatures
        counters = fetch_status(a)["counters"]
        assert not any(k.startswith("rejected_auth") for k in counters), (a, counters)
    assert not s.dead()
