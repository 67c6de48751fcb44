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

from bench.perf_pipeline import classify, op_kind, parse_profile, torch_breakdown

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
    ops = result["pipeline"]["torch_profile"]
    assert set(ops["swarm"]["by_node_cpu_ms"]) == {f"stage {k}" for k in range(4)}
    assert set(ops["one_process"]["by_node_cpu_ms"]) == {"one process"}
    for side in (ops["swarm"], ops["one_process"]):
        assert side["tokens"] > 0 and side["kinds_ms"]["matmul"] > 0
        assert sum(side["phases_ms"].values()) == pytest.approx(side["thread_cpu_ms"])
        assert sum(side["kinds_ms"].values()) == pytest.approx(side["thread_cpu_ms"], rel=0.02)


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


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("aten::mm", "matmul"),
        ("aten::linear", "matmul"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
        ("aten::_log_softmax_backward_data", "loss (log-softmax, NLL)"),
        ("aten::_to_copy", "dtype conversions and copies"),
        ("aten::transpose", "views, allocations and fills"),
        ("autograd::engine::evaluate_function: MmBackward0", "autograd and optimizer bookkeeping"),
        ("MmBackward0", "autograd and optimizer bookkeeping"),
        ("ScaledDotProductFlashAttentionForCpuBackward0", "autograd and optimizer bookkeeping"),
        ("Optimizer.step#Adam.step", "autograd and optimizer bookkeeping"),
        ("aten::silu_backward", "elementwise, norms, activations"),
        ("aten::topk", "elementwise, norms, activations"),  # not aten::to
        ("my_annotation", "other"),
    ],
)
def test_operators_are_sorted_by_kind(name: str, kind: str) -> None:
    assert op_kind(name) == kind


def node_profile(cpu: float, outside: float, ops: dict[str, float]) -> dict[str, object]:
    phases = {"backward": 0.0, "optimizer": 0.0, "other operators": cpu - outside}
    return {
        "thread_cpu_s": cpu,
        "runqueue_wait_s": 0.5,
        "phases_cpu_s": {**phases, "outside operators": outside},
        "ops": [{"op": k, "self_cpu_s": v} for k, v in ops.items()],
    }


def test_torch_breakdown_sums_the_threads_per_1000_tokens() -> None:
    profile = {
        "tokens": 2000,
        "nodes": {
            "stage 0": node_profile(0.1, 0.02, {"aten::mm": 0.05, "aten::add": 0.03}),
            "stage 1": node_profile(0.3, 0.04, {"aten::mm": 0.2, "aten::copy_": 0.06}),
        },
    }
    b = torch_breakdown(profile)
    assert b["thread_cpu_ms"] == pytest.approx(200.0)  # 0.4 s over 2000 tokens
    assert b["runqueue_wait_ms"] == pytest.approx(500.0)
    assert b["by_node_cpu_ms"] == pytest.approx({"stage 0": 50.0, "stage 1": 150.0})
    assert b["kinds_ms"] == pytest.approx(
        {
            "matmul": 125.0,
            "elementwise, norms, activations": 15.0,
            "dtype conversions and copies": 30.0,
            "Python outside operators": 30.0,
        }
    )
    assert list(b["kinds_ms"])[0] == "matmul"
    assert b["phases_ms"]["other operators"] == pytest.approx(170.0)
    assert b["top_ops_ms"] == pytest.approx(
        {"aten::mm": 125.0, "aten::copy_": 30.0, "aten::add": 15.0}
    )
