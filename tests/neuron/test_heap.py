"""`keep_heap` (neuron/heap.py): freed activations stay in the heap, so a step's buffers are not
page-faulted in again on the next step. Each mode runs in a fresh process (mallopt is global)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_STEPS = """
import json, resource, sys, torch
if sys.argv[1] == "keep":
    from axonserve.neuron.heap import keep_heap
    assert keep_heap()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
MiB = 2**18  # float32 elements
out = []
for step in range(6):
    f0 = faults()
    live = [torch.empty(n * MiB).fill_(1) for n in (12, 3, 12, 6, 20, 1, 12, 12, 12)]  # ~90 MiB
    del live
    out.append(faults() - f0)
print(json.dumps(out))
"""


def _faults(mode: str) -> list[int]:
    r = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_keep_heap_stops_refaulting_step_buffers():
    default, kept = _faults("default"), _faults("keep")
    pages = 90 * 2**20 // 4096
    assert default[1] > pages // 2, default  # glibc trims the freed heap top: step 2 faults it all in again
    # kept: after the first step only the heap's fragmentation settling (measured <= 6144 pages vs >= 26k)
    assert 3 * sum(kept[1:]) < sum(default[1:]) and sum(kept[3:]) < pages // 20, (kept, default)


def _vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping holding `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


def test_huge_page_copies(monkeypatch):
    """Streamed weights move into one buffer advised for huge pages: equal, dense, cache-line
    aligned copies, the originals untouched; AXONSERVE_HUGEPAGES=0 leaves the tensors as they are."""
    import torch

    from axonserve.neuron.heap import collapse_huge_pages, huge_page_copies

    g = torch.Generator().manual_seed(0)
    ts = [
        torch.randn(96, 288, 16, 2, generator=g).bfloat16(),
        torch.randint(-128, 127, (300, 577), generator=g, dtype=torch.int8),
        torch.randn(7, generator=g),
        torch.randn(1024, 1024, generator=g),
    ]
    copies = huge_page_copies(ts)
    base = copies[0].data_ptr()
    for t, c in zip(ts, copies):
        assert c is not t and c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t) and c.data_ptr() % 64 == 0 and c.data_ptr() >= base
        assert c.untyped_storage().data_ptr() == copies[0].untyped_storage().data_ptr()  # one buffer
    assert base % (2 * 2**20) == 0
    if sys.platform.startswith("linux"):
        try:
            thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
        except OSError:
            thp = "[never]"
        if "[never]" not in thp:
            assert "hg" in _vm_flags(base), "the buffer was not advised for huge pages"
    assert collapse_huge_pages() is not None  # the kernel may refuse (memory state): it must only finish
    assert collapse_huge_pages() is None  # each buffer once
    assert all(torch.equal(c, t) for c, t in zip(copies, ts))  # collapsing keeps the data
    monkeypatch.setenv("AXONSERVE_HUGEPAGES", "0")
    assert all(a is b for a, b in zip(huge_page_copies(ts), ts))
