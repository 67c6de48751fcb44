"""Process-wide memory allocator settings for a daemon that receives large frames.

Every received frame lands in a fresh buffer, and the tensors in it stay views of that
buffer until they are done with. glibc serves allocations above its mmap threshold (at
most 32 MiB by default) with a fresh ``mmap`` and returns them to the kernel on free, so
each 64 MiB activation or weight frame pays for faulting in 16,384 new pages: on a VM that
costs as much as moving the bytes (``bench/perf_wire.py`` measures both). Raising the
threshold and the trim threshold makes glibc keep freed memory and hand it out again.

The price is that the process's resident memory stays at its peak instead of shrinking
after a burst; for a daemon whose working set is steady that is the right trade. Set
``node.malloc_reuse = false`` (or ``MURMUR_MALLOC_REUSE=0``) to keep glibc's defaults.
Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 30
"""Allocations up to this size come from the heap and are reused (``net.max_frame_bytes``)."""


def reuse_freed_memory(enabled: bool = True) -> bool:
    """Tell glibc to keep and reuse freed memory (``enabled``: ``node.malloc_reuse``); True
    if it took the settings."""
    if not enabled:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, 2 * THRESHOLD_BYTES - 1)
    )
    if not ok:
        log.debug("mallopt refused the allocator settings; keeping the defaults")
    return ok
