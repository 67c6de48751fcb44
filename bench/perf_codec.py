"""Activation compression on the wire: bytes per microbatch and eval-loss cost of each codec.

The daemon encodes every activation and gradient it sends with ``train.wire_codec`` (fp32,
bf16 (the default) or int8, ``protocol.quant``) and decodes it on arrival. Here that is
reproduced in one process so that the codecs are compared on exactly the same batches and
initial weights: the tiny model is cut into its head and three block stages as the swarm
cuts it, every stage boundary passes the forward activation and the backward gradient
through ``encode_tensor``/``decode_tensor``, and each stage has its own Adam and clipping as
a runner does. What this leaves out is the swarm's asynchrony (stale gradients), which is
the same for every codec. Bytes are those of the real ``Forward`` frame a microbatch's
activation travels in.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from bench.perf_pipeline import runner_step
from node.config import Config, resolve_config
from node.data.dataset import open_dataset
from node.stage.adam import Adam
from node.stage.model import BlockStage, HeadStage, build_stage
from node.stage.runner import lr_at
from protocol.frames import frame_nbytes
from protocol.messages import Forward, Hop, encode_message
from protocol.quant import CODECS, decode_tensor, encode_tensor

NUM_BLOCK_STAGES = 3


def round_trip(x: torch.Tensor, codec: str) -> torch.Tensor:
    """What a peer receives when ``x`` is sent under ``codec`` (float32)."""
    tensors, meta = encode_tensor(x, codec, name="h")
    return decode_tensor(tensors, meta)


class WireRoundTrip(torch.autograd.Function):
    """Identity in the graph, with the codec applied to the activation and to its gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codec: str) -> torch.Tensor:
        ctx.codec = codec
        return round_trip(x, codec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return round_trip(grad, ctx.codec), None


def _config() -> Config:
    return resolve_config(None, {}, {"swarm.num_block_stages": str(NUM_BLOCK_STAGES)})


def frame_bytes(codec: str, shape: tuple[int, ...]) -> int:
    """Bytes of the ``Forward`` frame carrying one activation of ``shape`` under ``codec``."""
    tensors, meta = encode_tensor(torch.randn(shape), codec, name="h")
    msg = Forward(
        mb_id="0123abcd.1.1",
        target_stage=1,
        path=[Hop(0, "0123abcd" * 4, "127.0.0.1:7070")],
        eval=False,
        meta=meta,
        tensors=tensors,
    )
    return frame_nbytes(encode_message(msg))


def codec_seconds(codec: str, shape: tuple[int, ...], reps: int = 20) -> float:
    """Median seconds to encode and decode one activation of ``shape``."""
    x = torch.randn(shape)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        round_trip(x, codec)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _pipeline_loss(
    head: HeadStage, blocks: list[BlockStage], ids: torch.Tensor, labels: torch.Tensor, codec: str
) -> torch.Tensor:
    h = head.embed(ids)
    for stage in blocks:
        h = stage(WireRoundTrip.apply(h, codec))
    loss: torch.Tensor = head.loss(WireRoundTrip.apply(h, codec), labels)
    return loss


def train_with_codec(codec: str, num_microbatches: int, seed: int = 0) -> dict[str, Any]:
    """Train for ``num_microbatches`` with every boundary under ``codec``; eval loss after."""
    cfg = _config()
    train, data = cfg.train, cfg.data
    stages = [build_stage(cfg.model, NUM_BLOCK_STAGES, s, cfg.swarm.seed) for s in range(4)]
    head, blocks = stages[0], stages[1:]
    assert isinstance(head, HeadStage) and all(isinstance(b, BlockStage) for b in blocks)
    opts = [Adam(s.parameters(), lr=lr_at(0, train), betas=train.betas, eps=1e-8) for s in stages]
    dataset = open_dataset(data, shard=0, seed=cfg.swarm.seed, vocab_size=cfg.model.vocab_size)
    evals = dataset.eval_batches(train.eval_batches, data.batch_size, data.seq_len)
    gen = torch.Generator().manual_seed(seed)

    def evaluate() -> float:
        with torch.no_grad():
            losses = [_pipeline_loss(head, blocks, i, lab, codec) for i, lab in evals]  # type: ignore[arg-type]
        return float(sum(losses) / len(losses))

    initial = evaluate()
    step = acc_samples = acc_microbatches = 0
    t0 = time.perf_counter()
    for _ in range(num_microbatches):
        ids, labels = dataset.sample_batch(gen, data.batch_size, data.seq_len)
        _pipeline_loss(head, blocks, ids, labels, codec).backward()  # type: ignore[arg-type]
        acc_samples += ids.shape[0]
        acc_microbatches += 1
        if acc_samples < train.step_samples:
            continue
        for stage, opt in zip(stages, opts, strict=True):  # each stage steps alone, as a runner
            params = [p for p in stage.parameters() if p.grad is not None]
            runner_step(params, opt, acc_microbatches, step, train)
        step += 1
        acc_samples = acc_microbatches = 0
    return {
        "initial_eval_loss": initial,
        "final_eval_loss": evaluate(),
        "optimizer_steps": step,
        "tokens": num_microbatches * data.batch_size * data.seq_len,
        "train_s": time.perf_counter() - t0,
    }


def measure_codecs(num_microbatches: int) -> dict[str, Any]:
    """Every codec: frame bytes per activation, encode+decode time, eval loss after training."""
    torch.set_num_threads(1)
    cfg = _config()
    shape = (cfg.data.batch_size, cfg.data.seq_len, cfg.model.d_model)
    out: dict[str, Any] = {"activation_shape": list(shape), "num_microbatches": num_microbatches}
    for codec in CODECS:
        print(f"codecs: {codec}, {num_microbatches} microbatches", file=sys.stderr, flush=True)
        out[codec] = {
            "frame_bytes": frame_bytes(codec, shape),
            "encode_decode_ms": 1e3 * codec_seconds(codec, shape),
            **train_with_codec(codec, num_microbatches),
        }
    base = out["fp32"]["final_eval_loss"]
    for codec in CODECS:
        out[codec]["eval_loss_vs_fp32"] = out[codec]["final_eval_loss"] / base - 1.0
        out[codec]["bytes_vs_fp32"] = out[codec]["frame_bytes"] / out["fp32"]["frame_bytes"]
    return out
