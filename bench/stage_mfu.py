"""One block stage's training throughput and model FLOP utilisation (issue 8), CPU or CUDA.

Runs the daemon's own compute path, ``node.stage.runner.StageRunner``: ``block_forward`` then
``block_backward`` per microbatch, the optimizer stepping every ``train.step_samples``
samples, on random ``[batch, seq, d_model]`` activations handed over as the daemon hands
them (float32 CPU tensors decoded from the wire, copied to the device inside the stage).
``train.compute_dtype`` is bfloat16 (autocast) unless ``--dtype float32``. After
``--warmup`` microbatches, ``--steps`` are timed, the device synchronised before each read
of the clock.

Model FLOPs per token of a stage of ``L`` blocks follow the PaLM accounting (Chowdhery et
al., 2022, arXiv 2204.02311, appendix B): ``6 * N`` for the weight multiplies forward and
backward (``N`` the stage's block parameters) plus ``12 * L * seq * d_model`` for attention
scores and values; MFU is achieved model FLOP/s over the device's peak. The peak is
``--peak-tflops``, or for CUDA looked up from the device name (dense bf16 tensor cores);
a CPU has no known peak, so there only FLOP/s are reported.

Usage: ``python -m bench.stage_mfu [--device cuda] [--preset 125m] [--short]``; writes
``--out`` (default ``bench/results/stage_mfu.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from node.config import resolve_config
from node.stage.model import ModelConfig, stage_blocks
from node.stage.runner import StageRunner

RESULTS = Path(__file__).resolve().parent / "results" / "stage_mfu.json"

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
"""Dense bf16 tensor-core peak by CUDA device name (NVIDIA data sheets, SXM parts)."""


def flops_per_token(cfg: ModelConfig, num_block_stages: int, seq_len: int) -> int:
    """Training FLOPs per token of one block stage (PaLM accounting, see the docstring)."""
    blocks = len(stage_blocks(cfg, num_block_stages, 1))
    return 6 * blocks * cfg.block_params() + 12 * blocks * seq_len * cfg.d_model


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    """The peak to divide by: ``given``, else a CUDA device's from its name, else None."""
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {
        "swarm.model": args.preset,
        "swarm.num_block_stages": str(args.stages),
        "node.device": args.device,
        "node.threads": str(args.threads),
        "train.compute_dtype": args.dtype,
        "train.step_samples": str(args.batch * args.accumulate),
    }
    config = resolve_config(None, {}, overrides)
    cfg = config.model
    if args.seq > cfg.max_seq_len:
        raise SystemExit(f"--seq {args.seq} exceeds the {args.preset} preset's {cfg.max_seq_len}")
    runner = StageRunner(config, 1)
    runner._build()  # on this thread: the benchmark is the compute thread
    device = runner.device
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.seq, cfg.d_model, generator=g)
    grad = torch.randn(args.batch, args.seq, cfg.d_model, generator=g) * 1e-3

    def microbatch(i: int) -> None:
        runner.block_forward(f"mb{i}", x, train=True)
        runner.block_backward(f"mb{i}", grad)

    for i in range(args.warmup):
        microbatch(i)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(args.steps):
        microbatch(args.warmup + i)
    _sync(device)
    seconds = time.perf_counter() - t0
    tokens = args.steps * args.batch * args.seq
    per_token = flops_per_token(cfg, args.stages, args.seq)
    achieved = per_token * tokens / seconds
    peak = peak_tflops(device, args.peak_tflops)
    runner.close()
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "preset": args.preset,
        "block_stages": args.stages,
        "blocks_in_stage": len(stage_blocks(cfg, args.stages, 1)),
        "stage_params": sum(p.numel() for p in runner.module.parameters()),
        "dtype": args.dtype,
        "batch": args.batch,
        "seq_len": args.seq,
        "microbatches": args.steps,
        "optimizer_steps": runner.step,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "model_flops_per_token": per_token,
        "achieved_tflops": achieved / 1e12,
        "peak_tflops": peak,
        "mfu": achieved / (peak * 1e12) if peak else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default=None, help="model preset (default: 125m on CUDA, tiny)")
    p.add_argument("--stages", type=int, default=None, help="block stages (default 3 tiny, 4)")
    p.add_argument("--batch", type=int, default=None, help="samples per microbatch")
    p.add_argument("--seq", type=int, default=None, help="tokens per sample")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--accumulate", type=int, default=4, help="microbatches per optimizer step")
    p.add_argument("--threads", type=int, default=2, help="torch threads (a CPU stage)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--short", action="store_true", help="smoke run: tiny model, a few steps")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.preset = args.preset or ("125m" if cuda and not args.short else "tiny")
    args.stages = args.stages or (3 if args.preset == "tiny" else 4)
    args.batch = args.batch or (16 if cuda else 8)
    args.seq = args.seq or (1024 if args.preset == "125m" else 128)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.short else 10)
    args.steps = args.steps or (4 if args.short else 50)
    print(
        f"stage_mfu: {args.preset}, 1 of {args.stages} block stages, [{args.batch}, {args.seq}] "
        f"{args.dtype} on {args.device}, {args.warmup} + {args.steps} microbatches",
        file=sys.stderr,
    )
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    mfu = f", MFU {result['mfu']:.1%}" if result["mfu"] is not None else ""
    print(
        f"{result['tokens_per_s']:.0f} tokens/s, {result['achieved_tflops']:.3f} model TFLOP/s{mfu}"
    )
    return result


if __name__ == "__main__":
    main()
