"""hivemind on the same machine: tensor throughput between two peers, and averaging time.

Runs under a separate virtual environment that has hivemind (never the project's: hivemind is
not a dependency), so it imports only torch and hivemind::

    python3 -m venv /work/hm-venv
    /work/hm-venv/bin/pip install -c constraints.txt --find-links /opt/wheels hivemind
    /work/hm-venv/bin/python bench/perf_hivemind.py --numel 401920 --sizes 2,4,8

- throughput: one ``payload_bytes`` float32 tensor from one peer to another as hivemind moves
  tensors (``serialize_torch_tensor``, ``split_for_streaming``, a streaming protobuf call over
  its libp2p daemons, ``combine_from_streaming`` and ``deserialize_torch_tensor`` on arrival),
  the receiver in its own process, the same way ``bench/perf_wire.py`` times our frames;
- averaging: ``DecentralizedAverager`` with a group of N peers averaging one stage-sized
  tensor. ``allreduce_s`` is the all-reduce alone (matchmaking done first, then every peer
  triggered at once, hivemind's own pattern for overlapping it with compute); ``step_s`` is
  a whole step including matchmaking (``min_matchmaking_time`` as set).

Prints one JSON object. Started by ``bench/perf.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from hivemind import DHT, DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

HANDLER = "bench.tensor"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def serve_receiver() -> None:
    """A peer that takes streamed tensors and acknowledges each; prints its address."""
    p2p = await P2P.create()

    async def handle(parts: AsyncIterator[runtime_pb2.Tensor], _: Any) -> runtime_pb2.Tensor:
        received = [part async for part in parts]
        deserialize_torch_tensor(combine_from_streaming(received))
        return runtime_pb2.Tensor()

    await p2p.add_protobuf_handler(HANDLER, handle, runtime_pb2.Tensor, stream_input=True)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    print(json.dumps({"maddrs": maddrs, "peer_id": p2p.peer_id.to_base58()}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await p2p.shutdown()


async def send_tensors(payload_bytes: int, reps: int) -> dict[str, Any]:
    recv = subprocess.Popen(
        [sys.executable, __file__, "--role", "receiver"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert recv.stdout is not None
        info = json.loads(recv.stdout.readline())
        p2p = await P2P.create(initial_peers=info["maddrs"])
        peer = PeerID.from_base58(info["peer_id"])
        x = torch.randn(payload_bytes // 4)

        async def once() -> float:
            t0 = time.perf_counter()

            async def parts() -> AsyncIterator[runtime_pb2.Tensor]:
                for part in split_for_streaming(serialize_torch_tensor(x)):
                    yield part

            await p2p.call_protobuf_handler(peer, HANDLER, parts(), runtime_pb2.Tensor)
            return time.perf_counter() - t0

        await once()  # warm-up: connection, page faults
        times = [await once() for _ in range(reps)]
        await p2p.shutdown()
    finally:
        if recv.stdin is not None:
            recv.stdin.close()
        recv.wait(timeout=30)
    return {
        "payload_bytes": payload_bytes,
        "reps": reps,
        "seconds": times,
        "MBps": payload_bytes / statistics.median(times) / 1e6,
    }


def _wait_stage(controls: list[Any], stage: AveragingStage, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(c.stage == stage or c.done() for c in controls):
        if time.monotonic() > deadline:
            raise TimeoutError(f"averagers did not reach {stage.name} in {timeout_s:.0f}s")
        time.sleep(0.01)


def average(n: int, numel: int, reps: int, matchmaking_s: float) -> dict[str, Any]:
    """``reps`` all-reduces (triggered) and ``reps`` whole steps of a group of ``n`` peers."""
    first = DHT(start=True)
    dhts = [first] + [
        DHT(initial_peers=first.get_visible_maddrs(), start=True) for _ in range(n - 1)
    ]
    tensors = [torch.full((numel,), float(i)) for i in range(n)]
    averagers = [
        DecentralizedAverager(
            [t],
            dht=d,
            prefix=f"bench{n}",
            target_group_size=n,
            min_group_size=n,
            min_matchmaking_time=matchmaking_s,
            request_timeout=matchmaking_s / 2,
            start=True,
        )
        for t, d in zip(tensors, dhts, strict=True)
    ]
    allreduce_s, step_s, failed = [], [], 0
    try:
        for _ in range(reps):
            controls = [a.step(wait=False, require_trigger=True, timeout=60) for a in averagers]
            _wait_stage(controls, AveragingStage.AWAITING_TRIGGER, 90.0)
            t0 = time.perf_counter()
            for c in controls:
                c.allow_allreduce()
            failed += sum(c.result() is None for c in controls)
            allreduce_s.append(time.perf_counter() - t0)
        for _ in range(reps):
            t0 = time.perf_counter()
            controls = [a.step(wait=False, timeout=60) for a in averagers]
            failed += sum(c.result() is None for c in controls)
            step_s.append(time.perf_counter() - t0)
        with averagers[0].get_tensors() as (mine,):
            expected = (n - 1) / 2
            error = float((mine - expected).abs().max())
    finally:
        for a in averagers:
            a.shutdown()
        for d in dhts:
            d.shutdown()
    return {
        "n": n,
        "allreduce_s": statistics.median(allreduce_s),
        "step_s": statistics.median(step_s),
        "min_matchmaking_time_s": matchmaking_s,
        "failed_steps": failed,
        "max_error_vs_mean": error,
        "reps": reps,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--role", choices=["bench", "receiver"], default="bench")
    p.add_argument("--numel", type=int, default=401_920)
    p.add_argument("--sizes", default="2,4,8")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--payload-bytes", type=int, default=64 << 20, help="0: no throughput test")
    p.add_argument("--matchmaking-s", type=float, default=1.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.role == "receiver":
        asyncio.run(serve_receiver())
        return
    import hivemind

    result: dict[str, Any] = {"status": "ok", "version": hivemind.__version__}
    if args.payload_bytes > 0:
        _say(f"hivemind: tensor throughput, {args.payload_bytes >> 20} MiB")
        result["throughput"] = asyncio.run(send_tensors(args.payload_bytes, args.reps))
    result["averaging"] = []
    for n in [int(s) for s in args.sizes.split(",")]:
        _say(f"hivemind: averaging among {n} peers")
        result["averaging"].append(average(n, args.numel, args.reps, args.matchmaking_s))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
