"""Keep freed memory in the process heap instead of handing it back to the kernel.

glibc serves allocations above a (dynamic) threshold with fresh `mmap`s and trims the heap top
on free, so a prefill step's multi-megabyte activations are page-faulted in again on every step
(`clear_page_erms` in perf): a 31 x 64-token prefill of SmolLM2 took 360-1,200 ms instead of
~340 ms, with 1.7x the page faults. vLLM-CPU asks for tcmalloc via LD_PRELOAD for the same
reason; two `mallopt` calls get the effect without a preload or a dependency. The heap then
stays at the process's peak working set, which a serving process reaches again anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import structlog

log = structlog.get_logger()

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX_THRESHOLD = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
_NEVER_TRIM = 2**31 - 1  # mallopt takes a C int: the largest trim threshold it can express


def keep_heap() -> bool:
    """Allocations up to 32 MiB come from the heap and up to 2 GiB of free heap top is kept
    (glibc only; False elsewhere, where nothing changes). Fixing the thresholds also ends glibc's dynamic
    threshold, which otherwise only grows after a large block has already been unmapped."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    except (OSError, AttributeError, TypeError):
        ok = False
    if not ok:
        log.info("heap.default_malloc", why="no glibc mallopt")
    return ok
