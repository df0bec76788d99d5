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
