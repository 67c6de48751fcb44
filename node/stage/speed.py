"""A node's own speed: how many samples per second it serves on one block stage.

Owns the start-up benchmark a ``--stage auto`` node runs before choosing a stage (forward
plus backward of one block stage on its device, with a microbatch of the configured shape,
for ``balance.benchmark_s`` after a warm-up), its cache in the state directory (keyed by
everything the figure depends on, so a restart does not pay for it again), and the same
rate slowed by a configured compute delay. Does not own what the figure is used for
(``node.services.balance``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from node.config import Config
from node.stage.model import build_stage

log = logging.getLogger(__name__)


def speed_key(config: Config) -> str:
    """Everything the benchmark figure depends on, as a cache key."""
    d = config.data
    return json.dumps(
        {
            "model": dataclasses.asdict(config.model),
            "block_stages": config.swarm.num_block_stages,
            "batch": d.batch_size,
            "seq": d.seq_len,
            "device": config.node.device,
            "threads": config.node.threads,
            "dtype": config.train.compute_dtype,
            "torch": torch.__version__,
        },
        sort_keys=True,
    )


def configure_compute_thread(config: Config) -> None:
    """Set the calling thread up for a stage's compute, training and measuring alike:
    torch's intra-op threads (``node.threads``) and subnormal floats flushed to zero or not
    (``node.flush_denormal``; the CPU's flag is per thread, and threads started from this
    one inherit it)."""
    torch.set_num_threads(config.node.threads)
    torch.set_flush_denormal(config.node.flush_denormal)


def measure_block_rate(config: Config, budget_s: float) -> float:
    """Samples per second of forward plus backward through one block stage, undelayed."""
    configure_compute_thread(config)
    device = torch.device(config.node.device)
    stage = build_stage(config.model, config.swarm.num_block_stages, 1, config.swarm.seed)
    stage.to(device)
    b, t = config.data.batch_size, config.data.seq_len
    x = torch.randn(b, t, config.model.d_model, device=device)
    autocast: Any = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if config.train.compute_dtype == "bfloat16"
        else torch.autocast(device.type, enabled=False)
    )

    def once() -> None:
        xi = x.detach().requires_grad_(True)
        with autocast:
            out = stage(xi).float()
        out.backward(torch.ones_like(out))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    once()  # warm-up: allocator, kernels, lazy init
    runs, t0 = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - t0 < budget_s:
        once()
        runs += 1
    return b * runs / (time.perf_counter() - t0)


def with_delay(rate: float, config: Config, stage: int) -> float:
    """A block rate slowed as configured: the stage's artificial delay (one per microbatch
    forward) and the emulated slowdown."""
    delay = config.train.delay_on(stage)
    if rate <= 0:
        return rate
    rate /= config.train.slowdown
    return config.data.batch_size / (config.data.batch_size / rate + delay) if delay else rate


def cached_or_measured_rate(config: Config, cache: Path | None) -> float:
    """The undelayed block rate from ``cache`` when it was measured under the same key,
    else measured now (``balance.benchmark_s``) and written there. Blocks: run it off the
    event loop."""
    key = speed_key(config)
    if cache is not None and cache.is_file():
        try:
            cached = json.loads(cache.read_text())
            if cached.get("key") == key and float(cached["rate"]) > 0:
                rate = float(cached["rate"])
                log.info("own speed %.1f samples/s (cached in %s)", rate, cache)
                return rate
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring unreadable speed cache %s: %s", cache, e)
    t0 = time.monotonic()
    rate = measure_block_rate(config, config.balance.benchmark_s)
    log.info(
        "own speed %.1f samples/s through one block stage (measured in %.1fs)",
        rate,
        time.monotonic() - t0,
    )
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps({"key": key, "rate": rate}))
        except OSError as e:
            log.warning("cannot cache own speed in %s: %s", cache, e)
    return rate
