"""The daemon's allocator setting: 64 MiB frames come from reusable heap memory, not mmap."""

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, json, os, sys
from node.allocator import reuse_freed_memory
from node.config import resolve_config

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
tuned = reuse_freed_memory(resolve_config(None, os.environ).node.malloc_reuse)
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


def test_the_documented_variable_is_a_setting_not_an_unknown_section() -> None:
    """``MURMUR_MALLOC_REUSE=0 node join`` once exited with "unknown config section 'malloc'"."""
    from node.config import resolve_config

    assert resolve_config(None, {"MURMUR_MALLOC_REUSE": "0"}).node.malloc_reuse is False
    assert resolve_config(None, {"MURMUR_NODE_MALLOC_REUSE": "0"}).node.malloc_reuse is False
    assert resolve_config(None, {}).node.malloc_reuse is True
    out = subprocess.run(
        [sys.executable, "-m", "node", "join", "--stage", "99"],
        env={**os.environ, "MURMUR_MALLOC_REUSE": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--stage must be" in out.stderr, out.stderr
