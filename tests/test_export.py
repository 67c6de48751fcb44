"""node/export.py and ``node export`` / ``node generate`` / ``node join --init``.

Unit tests fake the swarm's state fetches; the slow test trains a real local swarm, exports
it with ``node export`` as a subprocess, checks the exported model's loss offline against
the swarm's own evaluation, generates text, and starts a second swarm from the export.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from node.cli import main
from node.config import Config, resolve_config
from node.stage import export
from node.stage.export import (
    check_init_dir,
    eval_loss,
    export_model,
    generate,
    generate_ids,
    init_stage,
    load_export,
    load_export_tokenizer,
    read_info,
    stage_slice,
)
from node.stage.model import (
    BlockStage,
    HeadStage,
    build_model,
    build_stage,
    compose_stages,
    model_fingerprint,
    preset,
)
from protocol.messages import StageState
from tests.helpers import wait_for

N = 3


def _config(**overrides: Any) -> Config:
    return resolve_config(overrides={"swarm.num_block_stages": N, **overrides})


def _trained_stages(config: Config) -> list[HeadStage | BlockStage]:
    """The seed's stages with noise added, standing in for trained weights."""
    gen = torch.Generator().manual_seed(7)
    stages = [build_stage(config.model, N, s, config.swarm.seed) for s in range(N + 1)]
    with torch.no_grad():
        for module in stages:
            for p in module.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return stages


def _fake_swarm(
    config: Config, stages: list[HeadStage | BlockStage], monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Any], list[str]]:
    """A status as a head node reports it, and state fetches answered from ``stages``.
    Stage 1 has two replicas; the more advanced one refuses, so the other is used."""
    fetched: list[str] = []

    def fetch(address: str, stage: int, timeout_s: float = 60.0, auth: Any = None) -> StageState:
        fetched.append(address)
        if address == "b1-ahead:1":
            raise ValueError(f"cannot reach {address}")
        tensors = {f"param.{k}": v.clone() for k, v in stages[stage].state_dict().items()}
        tensors["adam_m.x"] = torch.zeros(1)
        return StageState(stage=stage, step=10 + stage, samples=320, tensors=tensors)

    monkeypatch.setattr(export, "fetch_stage_state", fetch)
    peer = {"ready": True}
    status = {
        "peer_id": "h" * 16,
        "address": "head:1",
        "stage": 0,
        "step": 10,
        "num_stages": N + 1,
        "fingerprint": model_fingerprint(config.model, N, config.swarm.seed),
        "peers": {
            "0": [],
            "1": [
                {**peer, "peer_id": "b1-behind", "address": "b1-behind:1", "step": 8},
                {**peer, "peer_id": "b1-ahead", "address": "b1-ahead:1", "step": 12},
            ],
            "2": [{**peer, "peer_id": "b2", "address": "b2:1", "step": 9}],
            "3": [{**peer, "peer_id": "b3", "address": "b3:1", "step": 9}],
        },
    }
    return status, fetched


def test_export_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config()
    stages = _trained_stages(config)
    status, fetched = _fake_swarm(config, stages, monkeypatch)
    info = export_model(status, config, tmp_path / "out")
    assert fetched == ["head:1", "b1-ahead:1", "b1-behind:1", "b2:1", "b3:1"]
    assert [s["address"] for s in info.sources] == ["head:1", "b1-behind:1", "b2:1", "b3:1"]
    doc = json.loads((tmp_path / "out" / "config.json").read_text())
    assert doc["format"] == "murmuration-export" and doc["tokenizer"] == "bytes"
    assert doc["model"]["vocab_size"] == 256 and doc["num_block_stages"] == N

    model, loaded = load_export(tmp_path / "out")
    assert loaded.fingerprint == status["fingerprint"]
    reference = compose_stages(stages[0], stages[1:])  # type: ignore[arg-type]
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))
    batches = [(ids[:, :-1], ids[:, 1:])]
    with torch.no_grad():
        expected = float(reference.loss(*batches[0]))
    assert eval_loss(model, batches) == pytest.approx(expected)


def test_export_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config()
    status, _ = _fake_swarm(config, _trained_stages(config), monkeypatch)
    with pytest.raises(ValueError, match=r"fingerprint .* seed 1\) .*--config"):
        export_model(status, _config(**{"swarm.seed": 1}), tmp_path / "x")
    status["peers"]["2"] = []
    with pytest.raises(ValueError, match="cannot collect stage 2: the node knows no live replica"):
        export_model(status, config, tmp_path / "x")
    with pytest.raises(ValueError, match="not an exported model: no config.json"):
        read_info(tmp_path / "nothing")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a Murmuration export"):
        read_info(tmp_path / "odd")


async def test_init_slices_for_any_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config()
    stages = _trained_stages(config)
    status, _ = _fake_swarm(config, stages, monkeypatch)
    export_model(status, config, tmp_path / "out")
    init = str(tmp_path / "out")
    model, _ = load_export(init)
    full = {k: v for k, v in model.state_dict().items()}
    # Each stage's slice of a 3-way split is exactly the stage the swarm had...
    for s in range(N + 1):
        own = {f"param.{k}": v for k, v in stages[s].state_dict().items()}
        got = stage_slice(init, config.model, N, s)
        assert got.keys() == own.keys() and all(torch.equal(got[k], own[k]) for k in own)
    # ...and a new swarm may cut the same model differently (here 2 block stages).
    second = stage_slice(init, config.model, 2, 2)
    assert torch.equal(second["param.blocks.0.attn.wq.weight"], full["blocks.3.attn.wq.weight"])
    # On a real runner: the weights of the export, step 0, a fresh Adam.
    from node.stage.runner import StageRunner

    runner = StageRunner(_config(**{"swarm.num_block_stages": 2}), 2)
    await runner.start()
    try:
        await runner.compute(init_stage, runner, init)
        assert runner.step == 0 and not runner.optimizer.state
        assert torch.equal(
            runner.module.state_dict()["blocks.2.mlp.w2.weight"], full["blocks.5.mlp.w2.weight"]
        )
    finally:
        runner.close()
    bigger = _config(**{"model.d_model": 64})
    with pytest.raises(ValueError, match="differs from this node's model config: d_model 128"):
        check_init_dir(init, bigger.model)
    assert main(["join", "--init", str(tmp_path / "missing"), "--set", "node.stage=0"]) == 2


def test_generate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    config = _config()
    status, _ = _fake_swarm(config, _trained_stages(config), monkeypatch)
    export_model(status, config, tmp_path / "out")
    model, info = load_export(tmp_path / "out")
    tok = load_export_tokenizer(tmp_path / "out", info)
    greedy = generate(model, tok, "The ", max_tokens=12, temperature=0)
    assert greedy == generate(model, tok, "The ", max_tokens=12, temperature=0)
    a = generate(model, tok, "The ", max_tokens=20, temperature=1.0, top_k=5, seed=1)
    assert a == generate(model, tok, "The ", max_tokens=20, temperature=1.0, top_k=5, seed=1)
    assert len(tok.encode(a)) >= 1
    long_prompt = "x" * 500  # longer than max_seq_len: the window slides
    assert generate(model, tok, long_prompt, max_tokens=3, temperature=0.5, seed=0)
    with pytest.raises(ValueError, match="--temperature"):
        generate(model, tok, "x", temperature=-1)
    with pytest.raises(ValueError, match="--top-k"):
        generate(model, tok, "x", top_k=-1)
    argv = ["generate", "--model", str(tmp_path / "out"), "--prompt", "Hi", "--max-tokens", "5"]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("Hi")
    assert main(["generate", "--model", str(tmp_path / "none"), "--prompt", "x"]) == 2


def test_generate_with_kv_cache_gives_the_same_tokens_faster() -> None:
    cfg = preset("tiny")
    model = build_model(cfg, seed=5).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights further from the init, so tokens are not all alike
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    prompt = list(b"The quick brown fox ")
    # 400 tokens: the 128-token context fills and restarts from its last half four times.
    runs: dict[bool, tuple[list[int], float]] = {}
    for cache in (False, True):
        t0 = time.perf_counter()
        out = generate_ids(model, prompt, max_tokens=400, temperature=0, cache=cache)
        runs[cache] = (out, time.perf_counter() - t0)
    assert runs[True][0] == runs[False][0]
    assert len(set(runs[True][0][200:])) > 20  # varied tokens: a real comparison
    sampled = [
        generate_ids(model, prompt, max_tokens=150, temperature=1.0, top_k=20, seed=3, cache=c)
        for c in (False, True)
    ]
    assert sampled[0] == sampled[1]
    # A prompt longer than the context: both paths keep its last max_seq_len tokens.
    long_prompt = list(range(200))
    assert generate_ids(model, long_prompt, max_tokens=20, temperature=0, cache=True) == (
        generate_ids(model, long_prompt, max_tokens=20, temperature=0, cache=False)
    )
    print(
        f"\ngreedy, 400 tokens, tiny preset: no cache {400 / runs[False][1]:.0f} tokens/s, "
        f"KV cache {400 / runs[True][1]:.0f} tokens/s ({runs[False][1] / runs[True][1]:.1f}x)"
    )


# ---- integration --------------------------------------------------------------------------

# Training stops changing the weights once every stage is past total_steps: the cosine decays
# the learning rate to exactly 0 (min_lr_ratio 0) and sync "none" takes no outer steps. So the
# swarm's evaluation and the export see the same weights.
TRAIN_STEPS = 100
SWARM = {
    "node.join_wait_s": "1.0",
    "train.eval_interval_s": "0",
    "train.hop_timeout_s": "5",
    "train.microbatch_deadline_s": "10",
    "membership.ttl_s": "6",
    "sync.method": "none",
    "train.lr": "3e-3",
    "train.warmup_steps": "20",
    "train.total_steps": str(TRAIN_STEPS),
    "train.min_lr_ratio": "0",
    "train.eval_batches": "4",
    # the comparison with offline evaluation below counts on bf16 rounding at every stage
    # boundary: a fixed codec (``auto`` may pick int8 where a node's jobs are short)
    "train.wire_codec": "bf16",
}


def _bf16_wire_loss(model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The loss as the swarm computes it: activations rounded to bf16 at each of the 1 + N
    stage boundaries (head -> 1 -> 2 -> 3 -> head), everything else fp32."""
    per_stage = model.cfg.num_blocks // N
    losses = []
    with torch.no_grad():
        for ids, labels in batches:
            h = model.head.embed(ids)
            cos, sin = model.rotary(ids.shape[1], h.device)
            for i, block in enumerate(model.blocks):
                if i % per_stage == 0:
                    h = h.bfloat16().float()
                h = block(h, cos, sin)
            losses.append(float(model.head.loss(h.bfloat16().float(), labels)))
    return sum(losses) / len(losses)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_swarm_export_generate_and_init(tmp_path: Path) -> None:
    from node.client import fetch_status, request_eval
    from node.data.dataset import DataConfig, open_dataset
    from node.demo import LocalSwarm, wait_ready

    first = LocalSwarm(tmp_path / "first", SWARM)
    first.log_dir.mkdir()
    # eval_interval_s > 0: a head evaluates once the pipeline is complete, before training.
    second = LocalSwarm(tmp_path / "second", {**SWARM, "train.eval_interval_s": "600"})
    second.log_dir.mkdir()
    try:
        t0 = time.monotonic()
        head = first.start_node(0)
        for stage in range(1, N + 1):
            first.start_node(stage)
        for a in first.addresses:
            wait_ready(a, 90, first)

        def all_done() -> bool:
            st = fetch_status(head)
            steps = [st["stages"][s]["step"] for s in ("0", "1", "2", "3") if s in st["stages"]]
            return len(steps) == N + 1 and min(steps) >= TRAIN_STEPS + 2

        wait_for(all_done, 240, f"every stage past step {TRAIN_STEPS}")
        train_s = time.monotonic() - t0
        swarm_loss = request_eval(head)

        out = tmp_path / "model"
        cmd = [sys.executable, "-m", "node", "export", "--out", str(out), head]
        cmd += [arg for k, v in SWARM.items() for arg in ("--set", f"{k}={v}")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "wrote" in done.stdout

        model, _ = load_export(out)
        data = DataConfig()
        dataset = open_dataset(data, shard=0, seed=0, vocab_size=256)
        batches = dataset.eval_batches(4, data.batch_size, data.seq_len)
        offline = eval_loss(model, batches)
        offline_bf16 = _bf16_wire_loss(model, batches)
        swarm_again = request_eval(head)

        gen = subprocess.run(
            [sys.executable, "-m", "node", "generate", "--model", str(out), "--prompt", "The "]
            + ["--max-tokens", "80", "--seed", "1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0, gen.stderr
        sample = gen.stdout.strip()
        first.stop(grace_s=5.0)

        t1 = time.monotonic()
        new_head = second.start_node(0, extra=["--init", str(out)])
        for stage in range(1, N + 1):
            second.start_node(stage, extra=["--init", str(out)])
        for a in second.addresses:
            wait_ready(a, 90, second)
        wait_for(lambda: fetch_status(new_head)["evals"], 120, "the new swarm's first evaluation")
        first_eval = fetch_status(new_head)["evals"][0]["loss"]
        init_s = time.monotonic() - t1

        print(
            f"\ntrain {train_s:.0f}s to step {TRAIN_STEPS}; eval loss: swarm {swarm_loss:.5f} "
            f"(again {swarm_again:.5f}), offline fp32 {offline:.5f}, offline bf16 wire "
            f"{offline_bf16:.5f}; --init swarm first eval {first_eval:.5f} after {init_s:.0f}s; "
            f"ln 256 = {math.log(256):.3f}\nsample: {sample!r}"
        )
        # Frozen weights: the swarm's evaluation is reproducible...
        assert swarm_again == pytest.approx(swarm_loss, abs=1e-5)
        # ...and bf16 rounding at the stage boundaries is the only difference from offline.
        assert offline_bf16 == pytest.approx(swarm_loss, abs=1e-4)
        assert offline == pytest.approx(swarm_loss, abs=0.02)
        assert offline < math.log(256) - 1.0, "the swarm learned something"
        assert sample.startswith("The ") and len(sample) > 20
        # The new swarm starts where the export left off, not from scratch.
        assert first_eval == pytest.approx(swarm_loss, abs=1e-4)
    finally:
        first.stop(grace_s=5.0)
        second.stop(grace_s=5.0)
