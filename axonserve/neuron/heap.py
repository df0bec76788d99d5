"""Process memory for a serving worker: keep freed memory in the heap instead of handing it
back to the kernel, and put the weights a decode step streams into huge pages.

glibc serves allocations above a (dynamic) threshold with fresh `mmap`s and trims the heap top
on free, so a prefill step's multi-megabyte activations are page-faulted in again on every step
(`clear_page_erms` in perf), which made prefill steps slower and erratic
(docs/benchmarks.md#fig-neuron-heap). vLLM-CPU asks for tcmalloc via LD_PRELOAD for the same
reason; two `mallopt` calls get the effect without a preload or a dependency. The heap then
stays at the process's peak working set, which a serving process reaches again anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import weakref

import structlog
import torch

log = structlog.get_logger()

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX_THRESHOLD = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
_NEVER_TRIM = 2**31 - 1  # mallopt takes a C int: the largest trim threshold it can express


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def keep_heap() -> bool:
    """Allocations up to 32 MiB come from the heap and up to 2 GiB of free heap top is kept
    (glibc only; False elsewhere, where nothing changes). Fixing the thresholds also ends glibc's dynamic
    threshold, which otherwise only grows after a large block has already been unmapped."""
    try:
        mallopt = _libc().mallopt
        ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    except (OSError, AttributeError, TypeError):
        ok = False
    if not ok:
        log.info("heap.default_malloc", why="no glibc mallopt")
    return ok


# ---------------------------------------------------------------- huge pages for streamed weights

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux >= 6.1: back a range with huge pages now (a copy in the kernel)
_HUGE = 2 * 2**20
_ALIGN = 64  # each tensor starts on a cache line (the kernels' vector loads)


def _madvise(addr: int, length: int, advice: int) -> bool:
    try:
        madvise = _libc().madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return madvise(addr, length, advice) == 0
    except (OSError, AttributeError, TypeError):
        return False


def huge_page_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` in one buffer that the kernel is asked to back with transparent huge
    pages. A decode step streams every weight once: in 4 KiB pages that is a TLB miss and a page
    walk every 4 KiB (SmolLM2 bf16: 65k per step). In 2 MiB pages the step's matmuls ran faster
    (docs/benchmarks.md#fig-neuron-heap). The buffer is filled in ordinary pages (asking for huge
    pages at fault time can stall the load for seconds in direct compaction on a fragmented host)
    and advised for huge pages; `collapse_huge_pages` later has the kernel collapse it at once, else
    khugepaged gets to it in the background. AXONSERVE_HUGEPAGES=0 keeps the tensors as they are; so
    do hosts without transparent huge pages (the copy is then harmless)."""
    if os.environ.get("AXONSERVE_HUGEPAGES", "1") in ("0", "false", "no") or not tensors:
        return tensors
    sizes = [-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors]
    raw = torch.empty(sum(sizes) + _HUGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE
    out, offset = [], start
    for t, n in zip(tensors, sizes):
        nbytes = t.numel() * t.element_size()
        dst = raw[offset : offset + nbytes].view(t.dtype).view(t.shape)
        dst.copy_(t)
        out.append(dst)
        offset += n
    length = (offset - start) // _HUGE * _HUGE
    if length and _madvise(raw.data_ptr() + start, length, _MADV_HUGEPAGE):
        # the first copy starts the range; a weak reference: a model dropped meanwhile is not kept
        _to_collapse.append((weakref.ref(out[0]), length))
    return out


_to_collapse: list[tuple[weakref.ref, int]] = []  # advised ranges not collapsed yet: (first tensor, bytes)


def collapse_huge_pages() -> int | None:
    """Collapse the buffers `huge_page_copies` made (MADV_COLLAPSE, Linux 6.1+: the data stays valid
    and in use meanwhile); returns the MiB collapsed, None when none was pending. Seconds of
    kernel time for SmolLM2's 270 MB: the worker runs it off its event loop after its warm-up
    (run during the load it slowed the warm-up; run after ready it slowed the first seconds of
    serving: docs/benchmarks.md#fig-neuron-heap)."""
    jobs = list(_to_collapse)
    _to_collapse.clear()
    if not jobs:
        return None
    mib = 0
    for ref, length in jobs:
        first = ref()  # held during the call: it keeps the whole buffer mapped
        if first is None:
            continue
        ok = _madvise(first.data_ptr(), length, _MADV_COLLAPSE)
        log.info("heap.huge_pages", mib=length // 2**20, collapsed=ok, errno=0 if ok else ctypes.get_errno())
        mib += length // 2**20 if ok else 0
    return mib
