"""Tests for node/model.py: the split, deterministic init, composition, presets, dtypes."""

from __future__ import annotations

import math

import pytest
import torch

from node.stage.model import (
    PRESETS,
    Block,
    BlockStage,
    FullModel,
    HeadStage,
    KVCache,
    ModelConfig,
    build_model,
    build_stage,
    compose_stages,
    model_fingerprint,
    preset,
    stage_blocks,
)

SMALL = ModelConfig(d_model=32, num_heads=2, num_blocks=6, ffn_dim=64, max_seq_len=32)


def _ids(cfg: ModelConfig, batch: int = 2, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)


def test_stage_blocks_split() -> None:
    assert stage_blocks(SMALL, 3, 0) == range(0, 0)
    assert [stage_blocks(SMALL, 3, s) for s in (1, 2, 3)] == [range(0, 2), range(2, 4), range(4, 6)]
    assert stage_blocks(SMALL, 1, 1) == range(0, 6)
    assert stage_blocks(SMALL, 6, 6) == range(5, 6)


@pytest.mark.parametrize(
    ("num_block_stages", "stage", "match"),
    [(4, 1, "divisible"), (0, 0, ">= 1"), (3, 4, "0..3"), (3, -1, "0..3")],
)
def test_stage_blocks_errors(num_block_stages: int, stage: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        stage_blocks(SMALL, num_block_stages, stage)


def test_config_and_preset_errors() -> None:
    with pytest.raises(ValueError, match="divisible by num_heads"):
        ModelConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="even"):
        ModelConfig(d_model=36, num_heads=12)
    with pytest.raises(ValueError, match="tiny, small, 125m"):
        preset("huge")


def test_build_stage_deterministic() -> None:
    for stage in (0, 2):
        a = build_stage(SMALL, 3, stage, seed=7).state_dict()
        b = build_stage(SMALL, 3, stage, seed=7).state_dict()
        c = build_stage(SMALL, 3, stage, seed=8).state_dict()
        assert a.keys() == b.keys() == c.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], c[k]) for k in a if not k.endswith("norm.weight"))


def test_build_does_not_touch_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(SMALL, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_block_stages_share_keys_and_shapes() -> None:
    stages = [build_stage(SMALL, 3, s, seed=0) for s in (1, 2, 3)]
    shapes = [{k: v.shape for k, v in s.state_dict().items()} for s in stages]
    assert shapes[0] == shapes[1] == shapes[2]
    assert "blocks.0.attn.wq.weight" in shapes[0]
    # Different blocks got different weights.
    assert not torch.equal(
        stages[0].state_dict()["blocks.0.attn.wq.weight"],
        stages[1].state_dict()["blocks.0.attn.wq.weight"],
    )


@pytest.mark.parametrize("num_block_stages", [1, 2, 3])
def test_stages_composed_equal_whole_model(num_block_stages: int) -> None:
    full = build_model(SMALL, seed=3)
    head = build_stage(SMALL, num_block_stages, 0, seed=3)
    assert isinstance(head, HeadStage)
    ids = _ids(SMALL)
    h = head.embed(ids)
    stages = []
    for s in range(1, num_block_stages + 1):
        stage = build_stage(SMALL, num_block_stages, s, seed=3)
        assert isinstance(stage, BlockStage)
        assert stage.first_block == stage_blocks(SMALL, num_block_stages, s).start
        stages.append(stage)
        h = stage(h)
    with torch.no_grad():
        torch.testing.assert_close(head.logits(h), full(ids), rtol=0, atol=1e-5)
        composed = compose_stages(head, stages)
        torch.testing.assert_close(composed(ids), full(ids), rtol=0, atol=1e-5)
    # compose_stages shares parameters rather than copying them.
    assert composed.head.lm_head.weight is head.lm_head.weight


def test_compose_stages_errors() -> None:
    head = build_stage(SMALL, 3, 0, seed=0)
    s1, s2, s3 = (build_stage(SMALL, 3, s, seed=0) for s in (1, 2, 3))
    assert isinstance(head, HeadStage)
    with pytest.raises(ValueError, match="in order"):
        compose_stages(head, [s2, s1, s3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="expected 6"):
        compose_stages(head, [s1, s2])  # type: ignore[list-item]


def test_loss_at_init_near_uniform() -> None:
    cfg = preset("tiny")
    model = build_model(cfg, seed=0)
    ids = _ids(cfg, batch=4, seq_len=64)
    with torch.no_grad():
        loss = model.loss(ids, ids)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.3


def test_adam_steps_reduce_loss_and_grads_reach_every_parameter() -> None:
    cfg = preset("tiny")
    model = build_model(cfg, seed=0)
    ids = _ids(cfg, batch=4, seq_len=32)
    labels = torch.roll(ids, -1, dims=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(8):
        opt.zero_grad()
        loss = model.loss(ids, labels)
        loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                assert p.grad is not None and p.grad.abs().sum() > 0, name
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_training_after_inference_mode_generation() -> None:
    model = build_model(SMALL, seed=0)
    ids = _ids(SMALL)
    with torch.inference_mode():
        model(ids)  # the first call caches the rotary tables
    model.loss(ids, ids).backward()


def test_fingerprint_stable_and_sensitive() -> None:
    base = model_fingerprint(SMALL, 3, 0)
    assert base == model_fingerprint(ModelConfig(**vars(SMALL)), 3, 0)
    assert len(base) == 16 and int(base, 16) >= 0
    others = {
        model_fingerprint(SMALL, 2, 0),
        model_fingerprint(SMALL, 3, 1),
        model_fingerprint(ModelConfig(**{**vars(SMALL), "rope_theta": 500.0}), 3, 0),
        model_fingerprint(ModelConfig(**{**vars(SMALL), "embed_norm": False}), 3, 0),
        model_fingerprint(ModelConfig(**{**vars(SMALL), "checkpoint": "0123456789abcdef"}), 3, 0),
    }
    assert base not in others and len(others) == 5
    with pytest.raises(ValueError, match="divisible"):
        model_fingerprint(SMALL, 4, 0)


def _meta_param_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = FullModel(HeadStage(cfg), [Block(cfg) for _ in range(cfg.num_blocks)])
    return sum(p.numel() for p in model.parameters())


def test_presets_param_counts() -> None:
    assert set(PRESETS) == {"tiny", "small", "125m"}
    assert preset("tiny") == ModelConfig()
    for name, cfg in PRESETS.items():
        assert cfg.num_params() == _meta_param_count(cfg), name
        assert cfg.num_params() == cfg.head_params() + cfg.num_blocks * cfg.block_params()
    big = preset("125m")
    assert big.num_params() == 85_347_840
    assert big.num_blocks * big.block_params() == 84_953_088
    small = build_model(preset("small"), seed=0)
    assert sum(p.numel() for p in small.parameters()) == preset("small").num_params()
    with torch.device("meta"):
        stage = BlockStage(big, 0, [Block(big) for _ in range(3)])
    assert sum(p.numel() for p in stage.parameters()) == 3 * big.block_params()


def test_bf16_autocast_close_to_fp32() -> None:
    cfg = preset("tiny")
    model = build_model(cfg, seed=0)
    ids = _ids(cfg, batch=2, seq_len=64)
    with torch.no_grad():
        ref = model(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = model.hidden(ids)
            low = model(ids)
            loss = model.loss(ids, ids)
    assert h.dtype == torch.float32  # the residual stream stays fp32 under autocast
    assert loss.dtype == torch.float32
    assert (low.float() - ref).abs().max().item() < 0.03
    assert abs(loss.item() - model.loss(ids, ids).item()) < 0.01


def test_too_long_sequence_rejected() -> None:
    model = build_model(SMALL, seed=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_ids(SMALL, seq_len=SMALL.max_seq_len + 1))


def test_without_embed_norm_the_embedding_is_the_table() -> None:
    cfg = ModelConfig(**{**vars(SMALL), "embed_norm": False})
    head = build_stage(cfg, 3, 0, seed=0)
    assert isinstance(head, HeadStage)
    assert "embed_norm.weight" not in head.state_dict()
    assert cfg.num_params() == _meta_param_count(cfg) == SMALL.num_params() - cfg.d_model
    ids = _ids(cfg)
    with torch.no_grad():
        assert torch.equal(head.embed(ids), head.tok_embedding.weight[ids])


def test_kv_cache_equals_full_forward() -> None:
    model = build_model(SMALL, seed=1).eval()
    ids = _ids(SMALL, batch=3, seq_len=SMALL.max_seq_len)
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(SMALL)
        # A prompt, single tokens, then a chunk after cached positions (the masked case).
        parts = [ids[:, :7], ids[:, 7:8], ids[:, 8:9], ids[:, 9:20], ids[:, 20:]]
        cached = torch.cat([model(part, cache) for part in parts], dim=1)
        assert cache.length == SMALL.max_seq_len
        torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="length 33 exceeds max_seq_len 32"):
            model(ids[:, :1], cache)
        # A wrong mask (past positions hidden, or future ones shown) would not be close.
        uncached_tail = model(ids[:, 9:20])
        assert (uncached_tail - full[:, 9:20]).abs().max() > 1e-3
