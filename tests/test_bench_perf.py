"""The performance benchmark (``bench/perf.py``) works end to end; never how fast anything is.

The short run starts real processes (a wire peer, a four-node swarm, single-process
training), so it is marked slow. The profile classifier is checked on hand-written stacks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.perf_pipeline import classify, parse_profile

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_short_run_writes_every_figure(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench.perf", "--short", "--out", str(tmp_path)]
    cmd += ["--hivemind-python", str(tmp_path / "no-such-python")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "perf.json").read_text())
    assert (tmp_path / "perf.png").stat().st_size > 0
    assert result["mode"] == "short"
    for key in ("wire_ratio_to_raw_tcp", "hop_p50_ratio_to_echo", "pipeline_efficiency"):
        assert result[key] > 0, key
    sizes = result["activation_bytes"]
    assert sizes["int8"] < sizes["bf16"] < sizes["fp32"]
    assert result["hivemind"]["status"] == "unavailable"
    assert "no-such-python" in result["hivemind"]["reason"]
    swarm = result["pipeline"]["swarm"]
    assert swarm["tokens"] > 0 and swarm["counters"].get("microbatches_completed", 0) > 0
    assert set(swarm["cpu_ms_per_1k_tokens_by_thread"]) == {"event loop thread", "other threads"}
    for codec in ("fp32", "bf16", "int8"):
        assert result["codecs"][codec]["final_eval_loss"] > 0


NODE = 'process 1:"python -m bench.perf_pipeline swarm";process 2:"python -m node join --stage 1 --listen x"'


def stack(thread: str, *frames: str) -> str:
    return ";".join([NODE, thread, *(f"{f} (x.py:1)" for f in frames)])


def test_profile_samples_are_sorted_by_thread_and_category() -> None:
    compute = "thread (7): compute-s1_0"
    loop = "thread (2): MainThread"
    raw = "\n".join(
        [
            stack(compute, "_worker", "StageRunner.block_forward", "Linear.forward") + " 6",
            stack(compute, "StageRunner.block_backward", "BlockStage.forward") + " 2",
            stack(compute, "StageRunner.block_backward", "Tensor.backward") + " 2",
            stack(compute, "Thread.run", "_worker") + " 50",
            stack(loop, "Runner.run", "Node._handle_rpc", "decode_message") + " 3",
            stack(loop, "Runner.run") + " 40",
            stack(loop, "_find_and_load", "exec_module") + " 9",
            'process 1:"python -m bench.perf_pipeline swarm";thread (1): MainThread;main (x.py:1) 5',
        ]
    )
    profile = parse_profile(raw)
    assert profile["busy_samples"] == {"compute thread": 10, "event loop thread": 3}
    assert profile["idle_or_native_samples"] == 90
    assert profile["share_by_thread"]["compute thread"] == {
        "forward": 0.6,
        "recompute forward (stale graph)": 0.2,
        "backward": 0.2,
    }
    assert profile["share_by_thread"]["event loop thread"] == {"frame decode": 1.0}
    assert classify(stack(loop, "RequestHandler.start (aiohttp/web_protocol.py:1)")) == (
        "HTTP (aiohttp)"
    )
