"""Pipeline efficiency: a local swarm's tokens/s against one process training the same model.

The swarm is what ``node demo`` starts (``node.demo.LocalSwarm``): real ``node join``
processes on loopback, one head stage and three block stages with one replica each, the
tiny model, default settings except evaluation off (evaluations are not training tokens) and
the head reading shard 0. Its throughput is the head's completed tokens over a window after
a warm-up; the CPU it used in that window is read from ``/proc`` for every node.

The reference is one process training the same model (``node.stage.model.build_model``, the same
initial weights) on microbatches of the same shape from the same shard, with the runner's
optimizer rule (Adam, samples accumulated to ``step_samples``, clipping, the same schedule),
at a given number of torch threads.

Where the swarm's CPU goes is read two ways. py-spy (a dev tool, not a dependency:
``.venv/bin/pip install py-spy``) samples every node's threads in a separate run, each sample
sorted into a category by the Python functions on its stack (``classify``). torch's profiler
records the compute threads' operators: every node's through ``POST /profile`` over one
window of the measured swarm, and the one process's over a window of its own run; both are
put per 1000 tokens by phase and by kind of operator (``op_kind``, ``torch_breakdown``).

Usage (the benchmark driver is ``bench/perf.py``)::

    python -m bench.perf_pipeline single --threads 2 --seconds 20   # one JSON line
    python -m bench.perf_pipeline single --threads 1 --torch-profile  # and its operators
    python -m bench.perf_pipeline swarm --seconds 40                # one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from node.client import fetch_status, post_to_node
from node.config import Config, TrainConfig, resolve_config
from node.data.dataset import open_dataset
from node.demo import LocalSwarm, wait_ready
from node.stage.adam import Adam
from node.stage.model import build_model
from node.stage.opprofile import OpProfile
from node.stage.runner import lr_at

NUM_BLOCK_STAGES = 3
SWARM_SETTINGS = {
    "node.join_wait_s": "1.0",
    "train.eval_interval_s": "0",
    "data.shard": "0",
    "swarm.num_block_stages": str(NUM_BLOCK_STAGES),
}
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _config() -> Config:
    return resolve_config(None, {}, dict(SWARM_SETTINGS))


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- one process


def runner_step(
    params: list[torch.nn.Parameter],
    opt: Adam,
    microbatches: int,
    step: int,
    train: TrainConfig,
) -> None:
    """One optimizer step as ``StageRunner`` takes it: mean over the accumulated
    microbatches, global-norm clipping, the scheduled learning rate."""
    for p in params:
        if p.grad is not None:
            p.grad.div_(microbatches)
    torch.nn.utils.clip_grad_norm_(params, train.clip_norm)
    for group in opt.param_groups:
        group["lr"] = lr_at(step, train)
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_single(
    threads: int, seconds: float, warmup_s: float, torch_profile: bool = False
) -> dict[str, Any]:
    """Train the whole model in this process; tokens/s and CPU per token after ``warmup_s``.
    ``torch_profile``: record the measured window's operators (``node.stage.opprofile``) too."""
    torch.set_num_threads(threads)
    cfg = _config()
    train, data = cfg.train, cfg.data
    model = build_model(cfg.model, cfg.swarm.seed)
    params = list(model.parameters())
    opt = Adam(params, lr=lr_at(0, train), betas=train.betas, eps=1e-8)
    dataset = open_dataset(data, shard=0, seed=cfg.swarm.seed, vocab_size=cfg.model.vocab_size)
    gen = torch.Generator().manual_seed(0)
    step = acc_samples = acc_microbatches = tokens = 0
    start = time.monotonic()
    t0 = cpu0 = None
    prof = OpProfile()
    while True:
        now = time.monotonic()
        if t0 is None and now - start >= warmup_s:
            t0, cpu0, tokens = now, time.process_time(), 0
            if torch_profile:
                prof.start()
        if t0 is not None and now - t0 >= seconds:
            break
        ids, labels = dataset.sample_batch(gen, data.batch_size, data.seq_len)
        model.loss(ids, labels).backward()
        tokens += ids.numel()
        acc_samples += ids.shape[0]
        acc_microbatches += 1
        if acc_samples >= train.step_samples:
            runner_step(params, opt, acc_microbatches, step, train)
            step += 1
            acc_samples = acc_microbatches = 0
    assert t0 is not None and cpu0 is not None
    wall = time.monotonic() - t0
    cpu_s = time.process_time() - cpu0
    out: dict[str, Any] = {
        "threads": threads,
        "tokens_per_s": tokens / wall,
        "cpu_ms_per_1k_tokens": 1e6 * cpu_s / tokens,
        "seconds": wall,
    }
    if torch_profile:
        out["torch_profile"] = {"tokens": tokens, "nodes": {"one process": prof.stop()}}
    return out


def run_single(
    threads: int, seconds: float, warmup_s: float, torch_profile: bool = False
) -> dict[str, Any]:
    """``train_single`` in a fresh process (its own threads, like a node)."""
    cmd = [sys.executable, "-m", "bench.perf_pipeline", "single"]
    cmd += ["--threads", str(threads), "--seconds", str(seconds), "--warmup-s", str(warmup_s)]
    cmd += ["--torch-profile"] if torch_profile else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=seconds + 300)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------- the swarm


def _cpu_s(stat_path: Path) -> float:
    """User plus system CPU seconds so far, from a ``/proc`` ``stat`` file."""
    fields = stat_path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds of a node's event-loop thread (the main thread) and of all its others."""
    loop = _cpu_s(Path(f"/proc/{pid}/task/{pid}/stat"))
    return {"event loop thread": loop, "other threads": _cpu_s(Path(f"/proc/{pid}/stat")) - loop}


def _wait_for_tokens(head: str, swarm: LocalSwarm, tokens: int, train_s: float) -> None:
    """Until the head has completed ``tokens`` and trained ``train_s`` seconds."""
    deadline = time.monotonic() + train_s + 120.0
    while True:
        st = fetch_status(head)
        if st.get("tokens", 0) >= tokens and st.get("train_s", 0.0) >= train_s:
            return
        if swarm.dead() or time.monotonic() > deadline:
            raise RuntimeError(f"the swarm is not training; logs in {swarm.log_dir}")
        time.sleep(0.2)


def profile_nodes(addresses: list[str], seconds: float) -> dict[str, Any]:
    """Every node's compute-thread operators over the same ``seconds`` (``POST /profile``),
    with the tokens the head (the first address) completed meanwhile."""
    head = addresses[0]
    before = fetch_status(head)["tokens"]
    with ThreadPoolExecutor(len(addresses)) as pool:
        query = {"seconds": f"{seconds:g}"}
        futures = [
            pool.submit(post_to_node, a, "/profile", None, seconds + 120.0, query)
            for a in addresses
        ]
        profiles = [f.result() for f in futures]
    return {
        "tokens": fetch_status(head)["tokens"] - before,
        "nodes": {f"stage {p['stage']}": p for p in profiles},
    }


def measure_swarm(seconds: float, warmup_s: float, torch_profile_s: float = 0.0) -> dict[str, Any]:
    """Start the swarm, wait ``warmup_s`` of training, then measure over ``seconds``; then,
    with ``torch_profile_s``, profile every node's operators over that long."""
    log_dir = Path(tempfile.mkdtemp(prefix="murmuration-perf-"))
    swarm = LocalSwarm(log_dir, dict(SWARM_SETTINGS))
    try:
        for stage in range(1 + NUM_BLOCK_STAGES):
            swarm.start_node(stage)
        for address in swarm.addresses:
            wait_ready(address, 180.0, swarm)
        head = swarm.addresses[0]
        _wait_for_tokens(head, swarm, 1, warmup_s)
        pids = {name.split("-")[0]: proc.pid for name, proc, _ in swarm.procs}
        st0, t0 = fetch_status(head), time.time()
        cpu0 = {n: _cpu_by_role(p) for n, p in pids.items()}
        time.sleep(seconds)
        _wait_for_tokens(head, swarm, st0["tokens"] + 1, 0.0)  # a window holds a microbatch
        st1, t1 = fetch_status(head), time.time()
        cpu1 = {n: _cpu_by_role(p) for n, p in pids.items()}
        if torch_profile_s > 0:
            _say(
                f"pipeline: torch profiler on every node's compute thread, {torch_profile_s:.0f} s"
            )
            torch_profile = profile_nodes(swarm.addresses, torch_profile_s)
    finally:
        swarm.stop()
    shutil.rmtree(log_dir, ignore_errors=True)
    tokens = st1["tokens"] - st0["tokens"]
    by_role = {n: {r: cpu1[n][r] - cpu0[n][r] for r in cpu0[n]} for n in pids}
    cpu = {n: sum(roles.values()) for n, roles in by_role.items()}
    role_ms = Counter[str]()
    for roles in by_role.values():
        role_ms.update({r: 1e6 * s / max(1, tokens) for r, s in roles.items()})
    counters = {
        k: v - st0["counters"].get(k, 0)
        for k, v in st1["counters"].items()
        if v != st0["counters"].get(k, 0)
    }
    out = {
        "tokens_per_s": tokens / (t1 - t0),
        "seconds": t1 - t0,
        "tokens": tokens,
        "cpu_ms_per_1k_tokens": 1e6 * sum(cpu.values()) / max(1, tokens),
        "cpu_cores_used": sum(cpu.values()) / (t1 - t0),
        "cpu_ms_per_1k_tokens_by_thread": dict(role_ms),
        "cpu_s_by_node": {n: round(s, 2) for n, s in cpu.items()},
        "counters": counters,
    }
    if torch_profile_s > 0:
        out["torch_profile"] = torch_profile
    return out


# --------------------------------------------------------------------------- profile

_STARTUP = "start-up and shutdown"
CATEGORIES: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    # First match wins. A category matches when all needles of one of its alternatives are
    # somewhere in the stack (function qualnames and file paths, outermost frame first).
    (
        "start-up and shutdown",
        (
            ("_find_and_load",),
            ("StageRunner._build",),
            ("HeadTrainer.prepare",),
            ("measure_block_rate",),
            ("finalize._exitfunc",),
        ),
    ),
    ("codec encode (compute thread)", (("encode_tensor",),)),
    ("activation decode + check", (("WireTensor.decode",), ("Node._activation",))),
    ("frame encode", (("encode_message",),)),
    ("frame decode", (("decode_message",),)),
    ("optimizer step", (("StageRunner._optimizer_step",),)),  # runs inside a backward
    ("recompute forward (stale graph)", (("StageRunner.block_backward", "BlockStage.forward"),)),
    ("backward", (("StageRunner.block_backward",), ("StageRunner.head_backward",))),
    ("forward", (("StageRunner.block_forward",), ("StageRunner.head_embed",))),
    ("head loss forward + backward", (("StageRunner.head_loss",),)),
    ("data sampling", (("sample_batch",),)),
    ("outer sync", (("StageSync",), ("GossipService",), ("apply_noloco",))),
    ("HTTP (aiohttp)", (("(aiohttp/",),)),
)


def classify(stack: str) -> str:
    """The category of one py-spy stack (frames joined by ';', outermost first)."""
    for name, alternatives in CATEGORIES:
        if any(all(n in stack for n in needles) for needles in alternatives):
            return name
    frames = [f for f in stack.split(";") if not f.startswith("process ")]
    if not frames:
        return "native threads (no Python frame)"
    if frames[-1].startswith("Runner.run "):
        return "event loop in uvloop (socket I/O, callbacks)"
    return "other"


def _role(stack: str) -> str | None:
    """Which thread of a node a sample is from, or None for an idle or unreadable one."""
    frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
    if not frames:
        return None  # no Python frame could be read
    leaf = frames[-1].split(" (")[0]
    if leaf == "_worker":
        return None  # an executor thread waiting for a job
    if "compute-s" in stack:
        return "compute thread"
    if "MainThread" in stack:
        return None if leaf == "Runner.run" else "event loop thread"  # in uvloop's C code
    return "other threads"


def parse_profile(raw: str) -> dict[str, Any]:
    """Shares of busy samples by category within each thread role, from py-spy
    ``record --subprocesses --threads -f raw`` output; start-up and shutdown left out."""
    counts: dict[str, Counter[str]] = {}
    unattributed = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if "node join --stage" not in stack or not count.isdigit():
            continue
        category, role = classify(stack), _role(stack)
        if category == _STARTUP:
            continue
        if role is None:
            unattributed += int(count)
            continue
        counts.setdefault(role, Counter())[category] += int(count)

    def shares(c: Counter[str]) -> dict[str, float]:
        total = sum(c.values())
        return {k: v / total for k, v in c.most_common()}

    return {
        "busy_samples": {role: sum(c.values()) for role, c in counts.items()},
        "idle_or_native_samples": unattributed,
        "share_by_thread": {role: shares(c) for role, c in sorted(counts.items())},
    }


def profile_swarm(seconds: float, warmup_s: float, rate_hz: int = 50) -> dict[str, Any]:
    """Run the swarm under ``py-spy record --subprocesses`` and sort its samples."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        return {"status": "unavailable", "reason": "py-spy is not installed"}
    out = Path(tempfile.mkdtemp(prefix="murmuration-pyspy-")) / "samples.txt"
    cmd = [py_spy, "record", "--subprocesses", "--threads", "--nonblocking", "-r", str(rate_hz)]
    cmd += ["-f", "raw", "-o", str(out), "--", sys.executable, "-m", "bench.perf_pipeline"]
    cmd += ["swarm", "--seconds", str(seconds), "--warmup-s", str(warmup_s)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 400)
    if not out.exists():
        return {"status": "unavailable", "reason": done.stderr.strip()[-500:]}
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    result = parse_profile(out.read_text())
    result["rate_hz"] = rate_hz
    result["profiled_run"] = json.loads(lines[-1]) if lines else None
    shutil.rmtree(out.parent, ignore_errors=True)
    return result


# --------------------------------------------------------------------------- torch profiler

_MATMUL = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"})
_COPIES = frozenset(
    {"aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous"}
)
_LAYOUT = frozenset(
    {
        *("aten::view", "aten::_unsafe_view", "aten::reshape", "aten::transpose", "aten::t"),
        *("aten::as_strided", "aten::slice", "aten::select", "aten::expand", "aten::permute"),
        *("aten::unsqueeze", "aten::squeeze", "aten::chunk", "aten::split", "aten::narrow"),
        *("aten::detach", "aten::alias", "aten::empty", "aten::empty_strided"),
        *("aten::empty_like", "aten::zeros", "aten::zeros_like", "aten::fill_", "aten::zero_"),
        *("aten::resize_", "aten::lift_fresh", "aten::unbind", "aten::flatten"),
    }
)
_BOOKKEEPING = ("autograd::", "torch::autograd::", "Optimizer.")
TOP_OPS = 30


def op_kind(name: str) -> str:
    """The kind of one torch profiler operator, for the breakdown."""
    if name in _MATMUL:
        return "matmul"
    if "scaled_dot_product" in name:
        return "attention"
    if "log_softmax" in name or "nll_loss" in name:
        return "loss (log-softmax, NLL)"
    if name in _COPIES:
        return "dtype conversions and copies"
    if name in _LAYOUT:
        return "views, allocations and fills"
    if name.startswith(_BOOKKEEPING) or name.rstrip("0123456789").endswith("Backward"):
        return "autograd and optimizer bookkeeping"
    if name.startswith("aten::"):
        return "elementwise, norms, activations"
    return "other"


def torch_breakdown(p: dict[str, Any]) -> dict[str, Any]:
    """CPU ms per 1000 tokens by phase and by kind of operator (plus Python outside any
    operator), summed over the profiled compute threads: ``profile_nodes``'s answer or a
    single run's ``torch_profile``."""
    per_1k = 1e6 / max(1, p["tokens"])
    phases, kinds, ops = Counter[str](), Counter[str](), Counter[str]()
    for node in p["nodes"].values():
        phases.update(node["phases_cpu_s"])
        for op in node["ops"]:
            kinds[op_kind(op["op"])] += op["self_cpu_s"]
            ops[op["op"]] += op["self_cpu_s"]
        kinds["Python outside operators"] += node["phases_cpu_s"]["outside operators"]
    return {
        "tokens": p["tokens"],
        "thread_cpu_ms": per_1k * sum(n["thread_cpu_s"] for n in p["nodes"].values()),
        "runqueue_wait_ms": per_1k * sum(n["runqueue_wait_s"] for n in p["nodes"].values()),
        "by_node_cpu_ms": {k: per_1k * n["thread_cpu_s"] for k, n in p["nodes"].items()},
        "phases_ms": {k: per_1k * v for k, v in phases.items()},
        "kinds_ms": {k: per_1k * v for k, v in kinds.most_common()},
        "top_ops_ms": {k: per_1k * v for k, v in ops.most_common(TOP_OPS)},
    }


# --------------------------------------------------------------------------- the comparison


def measure_pipeline(
    seconds: float,
    warmup_s: float,
    single_threads: list[int],
    profile: bool,
    short: bool = False,
    torch_profile_s: float = 0.0,
) -> dict[str, Any]:
    """Single-process runs before and after the swarm, then (optionally) a profiled swarm.
    ``short``: one single-process run, after the swarm, of a second. ``torch_profile_s``:
    after the swarm's measured window, its operators over that long, and a one-thread
    process's over as long (``torch_breakdown``)."""
    singles: dict[int, list[dict[str, Any]]] = {t: [] for t in single_threads}
    single_s, single_warmup_s = (1.0, 0.5) if short else (max(5.0, seconds / 3), 3.0)
    for t in [] if short else single_threads:
        _say(f"pipeline: one process, {t} threads")
        singles[t].append(run_single(t, single_s, single_warmup_s))
    _say(f"pipeline: swarm of {1 + NUM_BLOCK_STAGES} processes, {seconds:.0f} s window")
    swarm = measure_swarm(seconds, warmup_s, torch_profile_s)
    for t in single_threads:
        _say(f"pipeline: one process, {t} threads (after the swarm)")
        singles[t].append(run_single(t, single_s, single_warmup_s))
    single = {
        str(t): {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "cpu_ms_per_1k_tokens": statistics.median(r["cpu_ms_per_1k_tokens"] for r in runs),
            "runs": runs,
        }
        for t, runs in singles.items()
    }
    best = max(single.values(), key=lambda s: s["tokens_per_s"])
    least_cpu = min(s["cpu_ms_per_1k_tokens"] for s in single.values())
    result: dict[str, Any] = {
        "num_nodes": 1 + NUM_BLOCK_STAGES,
        "swarm": swarm,
        "single_process": single,
        "pipeline_efficiency": swarm["tokens_per_s"] / best["tokens_per_s"],
        # CPU work per token, single over swarm: what a contended machine cannot flatter.
        "pipeline_cpu_efficiency": least_cpu / swarm["cpu_ms_per_1k_tokens"],
        "pipeline_efficiency_by_threads": {
            t: swarm["tokens_per_s"] / s["tokens_per_s"] for t, s in single.items()
        },
    }
    if torch_profile_s > 0:
        _say(f"pipeline: torch profiler on one process, 1 thread, {torch_profile_s:.0f} s")
        one = run_single(1, torch_profile_s, single_warmup_s, torch_profile=True)
        result["torch_profile"] = {
            "seconds": torch_profile_s,
            "swarm": torch_breakdown(swarm.pop("torch_profile")),
            "one_process": torch_breakdown(one["torch_profile"]),
            # what recording costs: the profiled run's tokens/s over the unprofiled runs'
            "one_process_profiled_speed": one["tokens_per_s"] / single["1"]["tokens_per_s"],
        }
    if profile:
        _say("pipeline: profiling the swarm with py-spy")
        result["profile"] = profile_swarm(seconds, warmup_s)
    return result


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("role", choices=["single", "swarm"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument(
        "--torch-profile", action="store_true", help="single: record the window's operators"
    )
    args = p.parse_args()
    if args.role == "single":
        result = train_single(args.threads, args.seconds, args.warmup_s, args.torch_profile)
        print(json.dumps(result))
    else:
        print(json.dumps(measure_swarm(args.seconds, args.warmup_s)), flush=True)


if __name__ == "__main__":
    main()
