"""The receiving side of the wire benchmarks (``bench/perf_wire.py``), as its own process.

Serves, on 127.0.0.1 and on the event loop the daemon uses (``node.cli.asyncio_run``):

- ``POST /rpc``: the daemon's request path: ``node.net.transport.read_frame`` (bounded read,
  zero-copy frame decode), then for a ``Forward`` what the daemon's ``_activation`` does on
  arrival (``open_tensor`` and the finiteness check on the encoded tensor; the daemon
  decodes it to float32 on its compute thread, so this peer does not) unless the activation
  decodes to more than ``--check-max-bytes`` (the 64 MiB throughput payload is only decoded, so that
  the wire is measured and not torch), and an ``Ack`` frame back;
- ``POST /echo``: bare aiohttp, the request body read and sent back;
- ``POST /ok``: bare aiohttp, the request body read and a 2-byte reply;
- a raw TCP port: an 8-byte little-endian length, then that many bytes read with
  ``recv_into`` into one preallocated buffer, then a 1-byte reply (the ceiling).

Sets the allocator as the daemon does (``node/allocator.py``), unless the environment says
``MURMUR_MALLOC_REUSE=0``. Prints one JSON line with its two ports, then serves until its
stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import struct
import sys
import threading

import torch
from aiohttp import web

from node.allocator import reuse_freed_memory
from node.cli import asyncio_run
from node.net.transport import RPC_PATH, frame_response, read_frame
from protocol.errors import ProtocolError
from protocol.frames import Limits
from protocol.messages import Ack, Error, Forward
from protocol.quant import open_tensor

_LENGTH = struct.Struct("<Q")


def serve_raw(listener: socket.socket) -> None:
    """Accept connections forever; each sends length-prefixed payloads, one reply byte each."""
    buf = bytearray()
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                head = conn.recv(_LENGTH.size, socket.MSG_WAITALL)
                if len(head) < _LENGTH.size:
                    break
                (size,) = _LENGTH.unpack(head)
                if len(buf) < size:
                    buf = bytearray(size)
                view, got = memoryview(buf), 0
                while got < size:
                    n = conn.recv_into(view[got:size])
                    if not n:
                        return
                    got += n
                conn.sendall(b"k")


def make_app(limits: Limits, check_max_bytes: int) -> web.Application:
    async def rpc(request: web.Request) -> web.Response:
        try:
            msg = await read_frame(request, limits)
        except ProtocolError as e:
            return frame_response(Error(code=e.code, message=str(e)), e.http_status)
        if isinstance(msg, Forward):
            activation = open_tensor(msg.tensors, msg.meta)
            if 4 * math.prod(activation.shape) <= check_max_bytes:  # float32 bytes, decoded
                assert activation.finite()
        return frame_response(Ack())

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def ok(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"ok")

    app = web.Application(client_max_size=limits.max_frame_bytes)
    app.router.add_post(RPC_PATH, rpc)
    app.router.add_post("/echo", echo)
    app.router.add_post("/ok", ok)
    return app


async def serve(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    runner = web.AppRunner(make_app(Limits(), args.check_max_bytes), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    http_port = runner.addresses[0][1]
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve_raw, args=(listener,), daemon=True).start()
    print(json.dumps({"http_port": http_port, "raw_port": listener.getsockname()[1]}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # returns when the parent closes stdin
    await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check-max-bytes", type=int, default=1 << 20)
    args = p.parse_args()
    reuse_freed_memory()  # as ``node join`` does at start-up
    asyncio_run(serve(args))


if __name__ == "__main__":
    main()
