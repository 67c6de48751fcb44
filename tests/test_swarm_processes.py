"""Real ``node join`` processes on 127.0.0.1: training, failover, shutdown, status, bad input.

Each test starts its own swarm (a unique swarm name, free ports) and always stops every
process it started, even on failure.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from node.client import NodeRefused, fetch_status, post_to_node, request_eval
from node.data.dataset import shard_of
from node.demo import LocalSwarm, wait_ready
from node.identity import IDENTITY_FILE
from protocol.auth import Identity
from protocol.frames import encode_frame, join_frame
from protocol.messages import Error, Forward, Hop, decode_message, encode_message
from protocol.quant import encode_tensor
from tests.helpers import FAST_SWARM, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FAST = {
    **FAST_SWARM,
    "train.microbatch_deadline_s": "6",
    "train.max_in_flight": "4",
}


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Any]:
    swarms: list[LocalSwarm] = []

    def make(**settings: str) -> LocalSwarm:
        s = LocalSwarm(tmp_path, {**FAST, **settings})
        swarms.append(s)
        return s

    yield make
    for s in swarms:
        s.stop(grace_s=5.0)


def counters(address: str) -> dict[str, int]:
    c: dict[str, int] = fetch_status(address)["counters"]
    return c


def post_frame(address: str, body: bytes) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://{address}/rpc", data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, decode_message(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, decode_message(e.read())


def start(s: LocalSwarm, stages: list[int]) -> list[str]:
    addresses = [s.start_node(stage) for stage in stages]
    for a in addresses:
        wait_ready(a, 90, s)
    return addresses


@pytest.mark.parametrize("predict", [False, True])
def test_swarm_trains_and_eval_loss_falls(swarm: Any, predict: bool) -> None:
    """With weight prediction (``train.predict_weights``) as without: the block stages run
    their forwards ahead by the delay they measure, and the swarm still learns."""
    s = swarm(**{"train.predict_weights": str(predict).lower()})
    head, *blocks = start(s, [0, 1, 2, 3])
    before = request_eval(head)
    wait_for(lambda: fetch_status(head)["step"] >= 60, 150, "60 head steps")
    after = request_eval(head)
    st = fetch_status(head)
    assert before > 5.0, before
    assert after < before - 1.5, (before, after)
    assert st["counters"].get("microbatches_completed", 0) >= 60
    # its table holds stages 3, 0 and 1; stage 2 it knows from its neighbours' summaries
    assert {k: len(v) for k, v in st["peers"].items()} == {"0": 0, "1": 1, "3": 1}
    assert {k: v["ready"] for k, v in st["stages"].items()} == {"0": 1, "1": 1, "2": 1, "3": 1}
    # 4 in flight: each block stage's gradients land steps after their forwards
    assert all(fetch_status(b)["grad_delay_steps"] > 0 for b in blocks), blocks


def test_killing_one_of_two_replicas_does_not_stop_training(swarm: Any) -> None:
    s = swarm()
    head, before, victim, survivor, _ = start(s, [0, 1, 2, 2, 3])
    wait_for(lambda: counters(head).get("microbatches_completed", 0) >= 10, 90, "training")
    name = next(n for n, _, _ in s.procs if n.endswith(victim.rsplit(":", 1)[1]))
    proc = next(p for n, p, _ in s.procs if n == name)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_at_kill = counters(head).get("microbatches_completed", 0)
    wait_for(
        lambda: counters(head).get("microbatches_completed", 0) >= done_at_kill + 30,
        90,
        "30 more microbatches",
    )
    # routing bans the dead peer at its first failure; the peer table drops it once it has
    # been silent for ttl_s (4 s) - which a fast machine may not have reached yet (stage 1's
    # table holds stage 2; the head's does not)
    wait_for(
        lambda: [p["address"] for p in fetch_status(before)["peers"]["2"]] == [survivor],
        15,
        "stage 1 to drop the victim (ttl 4 s)",
    )
    st = fetch_status(head)
    # the victim's in-flight work was rerouted or re-issued, and every issue is accounted for
    c = st["counters"]
    assert c["microbatches_issued"] >= c["microbatches_completed"] + c.get(
        "microbatches_retried", 0
    )


def test_sigterm_leaves_cleanly_and_peers_drop_it_at_once(swarm: Any) -> None:
    s = swarm(**{"membership.ttl_s": "60"})  # so only the Leave message can explain the drop
    head, before, leaver, _, _ = start(s, [0, 1, 2, 2, 3])
    wait_for(lambda: counters(head).get("microbatches_completed", 0) >= 5, 90, "training")
    name = next(n for n, _, _ in s.procs if n.endswith(leaver.rsplit(":", 1)[1]))
    proc = next(p for n, p, _ in s.procs if n == name)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert time.monotonic() - t0 < 6.0
    # ttl is 60 s: a drop within a few seconds can only come from the Leave message (sent
    # with a 1 s deadline; a loaded machine may need a moment to process it)
    wait_for(
        lambda: leaver not in [p["address"] for p in fetch_status(before)["peers"]["2"]],
        5,
        "stage 1 to drop the leaver",
        interval_s=0.2,
    )
    done = counters(head)["microbatches_completed"]
    wait_for(
        lambda: counters(head)["microbatches_completed"] >= done + 10, 60, "training after leave"
    )


def test_joining_a_live_stage_copies_its_weights(swarm: Any) -> None:
    s = swarm()
    head, first, *_ = start(s, [0, 1, 2, 3])
    wait_for(lambda: fetch_status(first)["step"] >= 10, 90, "stage 1 steps")
    late = s.start_node(1)
    st = wait_ready(late, 90, s)
    assert st["step"] >= 10  # copied, not started from step 0
    log = (s.log_dir / f"stage1-{late.rsplit(':', 1)[1]}.log").read_text()
    assert "copied stage 1 state" in log


def test_status_cli_text_and_json(swarm: Any) -> None:
    s = swarm()
    head, *_ = start(s, [0, 1, 2, 3])
    out = subprocess.run(
        [sys.executable, "-m", "node", "status", head],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "head of 4 stages" in out and "stage 3: 1 peer(s)" in out and "sync noloco" in out
    js = subprocess.run(
        [sys.executable, "-m", "node", "status", "--json", head],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert json.loads(js)["stage"] == 0
    bad = subprocess.run(
        [sys.executable, "-m", "node", "status", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "cannot reach a node" in bad.stderr


def test_profile_cli_and_endpoint(swarm: Any) -> None:
    s = swarm(**{"swarm.num_block_stages": "1"})
    head, block = start(s, [0, 1])
    wait_for(lambda: counters(head).get("microbatches_completed", 0) >= 3, 90, "training")
    out = subprocess.run(
        [sys.executable, "-m", "node", "profile", "--seconds", "3", "--top", "40", block],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "block stage 1" in out and "backward" in out and "aten::mm" in out, out

    def profile_head() -> dict[str, Any]:
        return post_to_node(head, "/profile", query={"seconds": "3"}, timeout_s=60)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(profile_head)
        time.sleep(1.0)
        with pytest.raises(NodeRefused, match="profile_running"):  # one at a time
            profile_head()
        p = running.result()
    assert p["stage"] == 0 and p["samples"] > 0 and p["thread_cpu_s"] > 0
    assert p["phases_cpu_s"]["backward"] > 0
    assert sum(p["phases_cpu_s"].values()) == pytest.approx(p["thread_cpu_s"])
    assert {"aten::mm", "aten::embedding"} <= {op["op"] for op in p["ops"]}
    for seconds in ["0", "nan", "301", "ten"]:
        with pytest.raises(NodeRefused, match="bad_request") as refused:
            post_to_node(block, "/profile", query={"seconds": seconds}, timeout_s=10)
        assert refused.value.status == 400
    assert counters(block)["rejected_bad_request"] == 4
    assert counters(head)["rejected_profile_running"] == 1
    done = counters(head)["microbatches_completed"]
    wait_for(lambda: counters(head)["microbatches_completed"] >= done + 5, 60, "training on")


def test_bad_input_is_refused_counted_and_training_goes_on(swarm: Any) -> None:
    s = swarm()
    head, s1, *_ = start(s, [0, 1, 2, 3])
    wait_for(lambda: counters(head).get("microbatches_completed", 0) >= 3, 90, "training")
    path = [Hop(0, fetch_status(head)["peer_id"], head)]  # a peer s1 knows

    def forward(h: torch.Tensor, stage: int = 1, mb_id: str = "x", sender: str = "") -> bytes:
        tensors, meta = encode_tensor(h, "fp32", name="h")
        hops = [Hop(0, sender, "127.0.0.1:9")] if sender else path
        return join_frame(
            encode_message(
                Forward(
                    mb_id=mb_id,
                    target_stage=stage,
                    path=hops,
                    eval=True,
                    meta=meta,
                    tensors=tensors,
                )
            )
        )

    assert post_frame(s1, forward(torch.zeros(1, 4, 128), mb_id="dup"))[0] == 200

    cases = {
        b"GET / HTTP/1.0 garbage garbage": "bad_magic",
        b"MRMR": "truncated_frame",
        join_frame(encode_frame("forward", {"mb_id": 3}, {})): "malformed_message",
        join_frame(encode_frame("teleport", {}, {})): "unknown_message_type",
        forward(torch.full((1, 4, 128), float("nan"))): "non_finite",
        forward(torch.zeros(1, 4, 64)): "bad_shape",
        forward(torch.zeros(1, 4, 128), stage=2): "wrong_stage",
        forward(torch.zeros(1, 4, 128), mb_id="dup"): "duplicate_microbatch",
        forward(torch.zeros(1, 4, 128), sender="ffffffffffffffff"): "unknown_peer",
    }
    for body, code in cases.items():
        status, reply = post_frame(s1, body)
        assert isinstance(reply, Error) and reply.code == code, (code, reply)
        assert 400 <= status < 500
    c = counters(s1)
    for code in cases.values():
        assert c[f"rejected_{code}"] >= 1
    done = counters(head)["microbatches_completed"]
    wait_for(
        lambda: counters(head)["microbatches_completed"] >= done + 10,
        60,
        "training after bad input",
    )
    assert all(p.poll() is None for _, p, _ in s.procs)


def test_a_lone_far_stage_is_seen_by_the_head_that_every_joiner_asks(swarm: Any) -> None:
    # four stages: the head's table holds 3, 0 and 1, stage 2's holds 1, 2 and 3; with nobody
    # on 1 or 3 no node holds both, and only stage 2's greetings can tell the head of it (a
    # head blind to it told the next --stage auto joiners that stage 2 was empty)
    s = swarm()
    head = s.start_node(0)
    wait_ready(head, 90, s)
    far = s.start_node(2)
    wait_ready(far, 90, s)

    def stage_2_ready() -> dict[str, Any] | None:
        seen: dict[str, Any] = fetch_status(head)["stages"].get("2", {})
        return seen if seen.get("ready", 0) == 1 else None

    seen = wait_for(stage_2_ready, 10, "the head to see stage 2 ready")
    assert seen["held"] is False and seen["replicas"] == 1 and seen["contact"] == far


def test_stage_auto_fills_empty_stages_and_data_flag_is_used(swarm: Any, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    lines = [
        json.dumps({"text": f"Document {i}: the quick brown fox jumps over the lazy dog. " * 20})
        for i in range(200)
    ]
    corpus.write_text("\n".join(lines) + "\n")
    s = swarm()
    for name in ("h1", "h2"):  # identities whose peer ids both prefer shard 0 of 2
        identity = next(i for i in iter(Identity.generate, None) if shard_of(i.peer_id, 2) == 0)
        (tmp_path / name).mkdir()
        (tmp_path / name / IDENTITY_FILE).write_bytes(identity.to_pem())
    head_args = ["--data", str(corpus), "--set", "data.num_shards=2"]
    head = s.start_node(0, extra=[*head_args, "--state-dir", str(tmp_path / "h1")])
    wait_ready(head, 90, s)
    stages: list[int] = []
    for _ in range(3):
        # the default 2 s of listening, not the fast swarm's 1 s: a joiner chooses from what
        # it has heard by then, and under a loaded machine 1 s missed the last joiner once
        address = s.start_node("auto", extra=["--set", "node.join_wait_s=2.0"])
        stages.append(wait_ready(address, 90, s)["stage"])
        # the next joiner learns the swarm through the head: let the head hear of this one
        # first (joiners a moment apart may share a stage; rebalancing moves one later,
        # tests/test_balance_processes.py)
        wait_for(
            lambda: all(
                fetch_status(head)["stages"].get(str(k), {}).get("ready", 0) >= 1 for k in stages
            ),
            30,
            "the head to hear of the joiner",
        )
    assert sorted(stages) == [1, 2, 3]  # each joiner took an empty stage
    second_head = s.start_node(0, extra=[*head_args, "--state-dir", str(tmp_path / "h2")])
    shards = [fetch_status(head)["data_shard"], wait_ready(second_head, 90, s)["data_shard"]]
    assert shards == [0, 1]  # the second head found shard 0 taken and took the free one
    wait_for(
        lambda: counters(head).get("microbatches_completed", 0) >= 20, 90, "training on --data"
    )
    log = (s.log_dir / f"stage0-{head.rsplit(':', 1)[1]}.log").read_text()
    assert "data: shard" in log
    # this corpus is one repeated sentence: the loss falls far below what the embedded corpus allows
    wait_for(
        lambda: (fetch_status(head).get("loss_ema") or 9) < 2.0, 120, "loss on a repetitive corpus"
    )
