"""The daemon's allocator setting: 64 MiB frames come from reusable heap memory, not mmap."""

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, json, sys
from node.allocator import reuse_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
tuned = reuse_freed_memory()
before = libc.mallinfo2().hblkhd
first = libc.malloc(64 << 20)
mmapped = libc.mallinfo2().hblkhd - before
libc.free(first)
second = libc.malloc(64 << 20)
print(json.dumps({"tuned": tuned, "mmapped": mmapped, "reused": first == second}))
"""


def probe(**env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_large_frames_reuse_heap_memory_unless_turned_off() -> None:
    tuned = probe()
    assert tuned == {"tuned": True, "mmapped": 0, "reused": True}
    default = probe(MURMUR_MALLOC_REUSE="0")
    assert default["tuned"] is False and default["mmapped"] >= 64 << 20
