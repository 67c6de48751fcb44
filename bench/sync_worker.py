"""One replica of the synchronisation benchmark, as its own process.

It serves the daemon's ``POST /rpc`` frames with the daemon's HTTP transport, wrapped in the
same latency and bandwidth emulation the daemon uses (``node.net.netem``), and runs the same
services the daemon runs for a stage: ``swarm.gossip`` (NoLoCo exchange) and
``swarm.allreduce`` (ring). Every replica starts each repetition at the same wall-clock
instant, so what is measured is the synchronisation itself, not replicas waiting for each
other. Prints one JSON line per measurement. Started by ``bench/sync_scaling.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import torch
from aiohttp import web

from node.config import NetConfig
from node.net.netem import ShapedTransport
from node.net.tcp import CongestionControl
from node.net.transport import RPC_PATH, HttpTransport, frame_response, read_frame
from protocol.errors import ProtocolError
from protocol.frames import Limits
from protocol.messages import Ack, Error, GossipRequest, Hop, PeerRecord, RingChunk
from protocol.quant import encode_tensor
from swarm.allreduce import RingAllReduce, RingFailed
from swarm.gossip import Contribution, GossipConfig, GossipService
from swarm.seams import MonotonicClock, Refused


async def main(args: argparse.Namespace) -> None:
    addresses = args.addresses.split(",")
    me = addresses[args.index]
    ids = [f"w{i:03d}" for i in range(len(addresses))]
    limits = Limits()
    congestion = CongestionControl(NetConfig().tcp_congestion)  # the daemon's sockets' own
    congestion.check()
    http = HttpTransport(limits, congestion=congestion)
    await http.start()
    link = ShapedTransport(http, args.latency_ms / 1000, args.bandwidth_mbps * 125_000 or None)
    records = [
        PeerRecord(peer_id=i, address=a, stage=1, ready=True)
        for i, a in zip(ids, addresses, strict=True)
    ]
    gossip = GossipService(
        GossipConfig(
            request_timeout_s=args.timeout_s,
            hold_s=args.timeout_s / 2,
            round_deadline_s=1.5 * args.timeout_s,
            listen_s=args.listen_s,
        ),
        transport=link,
        clock=MonotonicClock(),
        rng=random.Random(args.index),
        self_id=ids[args.index],
        stage=1,
        replicas=lambda: [r for r in records if r.peer_id != ids[args.index]],
    )
    ring = RingAllReduce(
        link,
        MonotonicClock(),
        ids[args.index],
        codec=args.codec,
        step_timeout_s=1.5 * args.timeout_s,
    )

    async def handle(request: web.Request) -> web.Response:
        try:
            msg = await read_frame(request, limits)
            if isinstance(msg, GossipRequest):
                return frame_response(await gossip.handle_request(msg))
            if isinstance(msg, RingChunk):
                ring.deliver(msg)
                return frame_response(Ack())
            raise Refused("unexpected_message", msg.TYPE, 400)
        except ProtocolError as e:
            return frame_response(Error(code=e.code, message=str(e)), e.http_status)
        except Refused as e:
            return frame_response(Error(code=e.code, message=e.message), e.http_status)

    app = web.Application(client_max_size=limits.max_frame_bytes)
    app.router.add_post(RPC_PATH, handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = me.rsplit(":", 1)
    await web.SockSite(runner, congestion.listening_socket(host, int(port))).start()

    gen = torch.Generator().manual_seed(args.index)
    phi = torch.randn(args.numel, generator=gen)
    delta = 0.01 * torch.randn(args.numel, generator=gen)
    (phi_t, phi_m), (d_t, d_m) = (
        encode_tensor(phi, args.codec, name="phi"),
        encode_tensor(delta, args.codec, name="delta"),
    )
    offer = Contribution({**phi_t, **d_t}, {"phi": phi_m, "delta": d_m})
    members = [Hop(1, i, a) for i, a in zip(ids, addresses, strict=True)]

    async def until(t: float) -> None:
        await asyncio.sleep(max(0.0, t - time.time()))

    for rep in range(args.reps):
        t_round = args.start_at + rep * args.period
        await until(t_round)
        t0 = time.monotonic()
        outcome = await gossip.exchange(rep, offer)
        noloco_s = time.monotonic() - t0
        print(
            json.dumps(
                {
                    "method": "noloco",
                    "rep": rep,
                    "s": noloco_s,
                    "paired": outcome.partner_id is not None,
                }
            ),
            flush=True,
        )
        await until(t_round + args.period / 2)
        t0 = time.monotonic()
        try:
            await ring.allreduce(f"bench:{rep}", members, delta)
            print(
                json.dumps({"method": "ring", "rep": rep, "s": time.monotonic() - t0, "ok": True}),
                flush=True,
            )
        except RingFailed as e:
            print(
                json.dumps(
                    {
                        "method": "ring",
                        "rep": rep,
                        "s": time.monotonic() - t0,
                        "ok": False,
                        "error": str(e),
                    }
                ),
                flush=True,
            )
    await asyncio.sleep(2.0)  # let slower peers finish their last requests to us
    await http.close()
    await runner.cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--addresses", required=True)
    p.add_argument("--numel", type=int, required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--start-at", type=float, required=True)
    p.add_argument("--period", type=float, required=True)
    p.add_argument("--latency-ms", type=float, default=25.0)
    p.add_argument("--bandwidth-mbps", type=float, default=100.0)
    p.add_argument("--listen-s", type=float, default=0.05)
    p.add_argument("--timeout-s", type=float, default=20.0, help="gossip request timeout")
    p.add_argument("--codec", default="fp32")
    asyncio.run(main(p.parse_args()))
