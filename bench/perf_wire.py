"""Wire benchmarks: bulk throughput and small-message latency, each against its bare baseline.

The sending side runs here, on the daemon's event loop (``node.cli.asyncio_run``) with the
daemon's ``HttpTransport``; the receiving side is ``bench/perf_peer.py`` in its own process.
Each comparison alternates the two methods within one run, so both see the same machine:

- throughput: one ``Forward`` frame carrying a ``payload_bytes`` float32 activation, sent with
  ``HttpTransport.request`` (frame encode from the tensor's memory, HTTP, bounded read and
  zero-copy decode on the peer, an ``Ack`` back), against the same bytes sent from the same
  memory with ``socket.sendall`` and read with ``recv_into`` into a preallocated buffer;
- latency: one activation hop of a small microbatch (a bf16 ``[1, 64, d_model]`` activation,
  what the daemon sends, checked on arrival as the daemon does), against a bare aiohttp echo
  of a body of the same size, and a bare aiohttp POST with a 2-byte reply. Each hop sends a
  fresh message whose frame was encoded before the clock starts, as the daemon's compute
  thread does (``protocol.messages.prepare``); "hop_encoding" times fresh messages encoded on
  the event loop inside the hop, what the daemon did before, so both are on record.

Does not own the peer process's handlers (``bench/perf_peer.py``) or the JSON (``bench/perf.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch

from node.cli import asyncio_run
from node.net.transport import HttpTransport
from protocol.frames import Limits, frame_nbytes
from protocol.messages import Forward, Hop, Message, encode_message, prepare
from protocol.quant import encode_tensor

_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class Peer:
    http: str
    raw_port: int


@contextlib.contextmanager
def peer_process(env: dict[str, str] | None = None) -> Iterator[Peer]:
    """Start ``bench.perf_peer`` (with ``env`` added to its environment); stop it on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.perf_peer"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        assert proc.stdout is not None
        ports = json.loads(proc.stdout.readline())
        yield Peer(f"127.0.0.1:{ports['http_port']}", ports["raw_port"])
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def forward(tensor: torch.Tensor, codec: str) -> Forward:
    """A ``Forward`` hop message carrying ``tensor`` encoded as the daemon encodes it."""
    tensors, meta = encode_tensor(tensor, codec, name="h")
    return Forward(
        mb_id="bench.1.1",
        target_stage=1,
        path=[Hop(0, "bench-head", "127.0.0.1:1")],
        eval=False,
        meta=meta,
        tensors=tensors,
    )


def _raw_round_trip(sock: socket.socket, payload: memoryview) -> float:
    t0 = time.perf_counter()
    sock.sendall(_LENGTH.pack(payload.nbytes))
    sock.sendall(payload)
    assert sock.recv(1) == b"k"
    return time.perf_counter() - t0


async def _frame_round_trip(transport: HttpTransport, address: str, msg: Message) -> float:
    t0 = time.perf_counter()
    await transport.request(address, msg, timeout_s=60.0)
    return time.perf_counter() - t0


def _pairs_summary(raw_s: list[float], http_s: list[float], payload_bytes: int) -> dict[str, Any]:
    ratios = [r / h for r, h in zip(raw_s, http_s, strict=True)]
    return {
        "payload_bytes": payload_bytes,
        "reps": len(raw_s),
        "raw_tcp_MBps": payload_bytes / statistics.median(raw_s) / 1e6,
        "http_frame_MBps": payload_bytes / statistics.median(http_s) / 1e6,
        "raw_tcp_s": raw_s,
        "http_frame_s": http_s,
        "ratio_per_pair": ratios,
        "wire_ratio_to_raw_tcp": statistics.median(ratios),
    }


def measure_throughput(
    payload_bytes: int, reps: int, peer_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Median over ``reps`` alternating pairs of (raw TCP, HTTP frame) sends of one payload."""
    numel = payload_bytes // 4
    x = torch.randn(numel // (128 * 1024), 128, 1024) if numel >= 1 << 17 else torch.randn(numel)
    msg = forward(x, "fp32")
    payload = memoryview(x.numpy().data).cast("B")

    async def run(peer: Peer) -> dict[str, Any]:
        transport = HttpTransport(Limits())
        await transport.start()
        with socket.create_connection(("127.0.0.1", peer.raw_port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _raw_round_trip(sock, payload)  # warm both paths: connections, page faults
            await _frame_round_trip(transport, peer.http, msg)
            raw_s, http_s = [], []
            for i in range(reps):
                # Alternate which goes first, so neither always follows the other's cleanup.
                if i % 2:
                    http_s.append(await _frame_round_trip(transport, peer.http, msg))
                    raw_s.append(_raw_round_trip(sock, payload))
                else:
                    raw_s.append(_raw_round_trip(sock, payload))
                    http_s.append(await _frame_round_trip(transport, peer.http, msg))
        await transport.close()
        return _pairs_summary(raw_s, http_s, payload.nbytes)

    with peer_process(peer_env) as peer:
        result: dict[str, Any] = asyncio_run(run(peer))
    result["frame_bytes"] = frame_nbytes(encode_message(msg))
    return result


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
        "mean_ms": 1e3 * statistics.fmean(ordered),
    }


def measure_latency(num_hops: int, d_model: int = 128, seq_len: int = 64) -> dict[str, Any]:
    """p50/p99 of one small activation hop vs bare aiohttp echo and POST, interleaved in blocks."""
    msg = forward(torch.randn(1, seq_len, d_model), "bf16")
    frame_bytes = frame_nbytes(encode_message(msg))
    body = bytes(frame_bytes)
    block = 50

    async def run(peer: Peer) -> dict[str, list[float]]:
        transport = HttpTransport(Limits())
        await transport.start()
        samples: dict[str, list[float]] = {"hop": [], "hop_encoding": [], "echo": [], "post": []}

        def fresh() -> Forward:  # a new message: no frame kept from an earlier hop
            return dataclasses.replace(msg, mb_id=f"bench.{len(samples['hop'])}.1")

        async with aiohttp.ClientSession() as session:

            async def bare(path: str) -> float:
                t0 = time.perf_counter()
                async with session.post(f"http://{peer.http}{path}", data=body) as resp:
                    await resp.read()
                return time.perf_counter() - t0

            for _ in range(block):  # warm-up, discarded
                await _frame_round_trip(transport, peer.http, prepare(fresh()))
                await _frame_round_trip(transport, peer.http, fresh())
                await bare("/echo")
                await bare("/ok")
            for _ in range(max(1, num_hops // block)):
                for _ in range(block):
                    hop = prepare(fresh())
                    samples["hop"].append(await _frame_round_trip(transport, peer.http, hop))
                for _ in range(block):
                    hop = fresh()
                    samples["hop_encoding"].append(
                        await _frame_round_trip(transport, peer.http, hop)
                    )
                for _ in range(block):
                    samples["echo"].append(await bare("/echo"))
                for _ in range(block):
                    samples["post"].append(await bare("/ok"))
        await transport.close()
        return samples

    with peer_process() as peer:
        samples: dict[str, list[float]] = asyncio_run(run(peer))
    out: dict[str, Any] = {
        "activation_shape": [1, seq_len, d_model],
        "frame_bytes": frame_bytes,
        "num_samples": len(samples["hop"]),
    }
    for name, values in samples.items():
        out[name] = _percentiles(values)
    out["hop_p50_ratio_to_echo"] = out["hop"]["p50_ms"] / out["echo"]["p50_ms"]
    out["hop_p99_ratio_to_echo"] = out["hop"]["p99_ms"] / out["echo"]["p99_ms"]
    out["hop_p50_ratio_to_post"] = out["hop"]["p50_ms"] / out["post"]["p50_ms"]
    out["hop_encoding_p50_ratio_to_echo"] = out["hop_encoding"]["p50_ms"] / out["echo"]["p50_ms"]
    return out
