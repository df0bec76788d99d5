"""The kernels' own thread pool (csrc/thread_pool.h): loops claimed chunk by chunk give the same bits
as the same loops on OpenMP (at::parallel_for), with more threads than cores, from two Python
threads at once, and over many loops in a row (a chunk lost or run twice would show). The decoder
stack puts a step on the pool when all of its linears are the kernels' own (`pool_scope` here)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from axonserve.neuron.ops import native
from axonserve.neuron.ops.attention import AttentionMetadata, paged_attention

from .test_attention import random_block_tables

K = native.kernels()
pytestmark = pytest.mark.skipif(K is None, reason="native kernels unavailable (no compiler): torch path only")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    K.pool_scope(True)
    yield lambda n: torch.set_num_threads(n)
    K.pool_scope(False)
    torch.set_num_threads(before)
    K.set_thread_pool(True)


def _pool_threads() -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names.count("axon-pool")


def _workload(dtype: torch.dtype):
    """Each kernel that runs a decode step, at sizes that cut its loop into several chunks."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 576, generator=g).to(dtype)
    r = torch.randn(600, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    gu = torch.randn(700, 2 * 1536, generator=g).to(dtype)
    logits = torch.randn(64, 4096, generator=g).to(dtype)
    hq, hkv, d, bs = 9, 3, 64, 16
    seqs = [(1, 60 + 9 * i) for i in range(48)]  # decodes of different contexts
    k_cache = torch.randn(1024, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(1024, bs, hkv, d, generator=g).to(dtype)
    tables = random_block_tables(seqs, bs, 1024, g)
    args = ([q for q, _ in seqs], [c for _, c in seqs], tables, bs)
    t = len(seqs)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    dense = None  # a projection as a decode step runs it (AMX tiles, or the dot-product loop)
    if dtype == torch.bfloat16 and K.has_bf16_gemv():
        wp = K.pack_gemv_weight(torch.randn(1536, 576, generator=g).to(dtype))
        dense = (torch.randn(min(32, K.skinny_rows(wp)), 576, generator=g).to(dtype), wp)

    def run() -> list[torch.Tensor]:
        out = torch.empty_like(x)
        res = r.clone()
        K.rms_norm(out, x, res, w, 1e-5)
        meta = AttentionMetadata.build(*args, native=K)
        kc, vc = k_cache.clone(), v_cache.clone()
        attn = paged_attention(q, k, v, kc, vc, meta, d**-0.5)
        outs = [out, res, K.silu_and_mul(gu), K.argmax_rows(logits), attn, kc, vc]
        if dense is not None:
            outs.append(K.skinny_bf16(*dense))
        return outs

    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 5])  # the CI's cores; more threads than cores
def test_pool_gives_openmps_bits(dtype, n, threads):
    threads(n)
    run = _workload(dtype)
    K.set_thread_pool(False)
    ref = run()
    K.set_thread_pool(True)
    for _ in range(20):
        got = run()
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
    assert _pool_threads() >= n - 1  # the loops ran on the pool (members are made on first use)


def test_scope_is_per_thread_and_restored(threads):
    """Outside a scope (and in other threads) the loops stay on OpenMP; pool_scope returns the
    setting it replaced, as the decoder stack's scope restores it."""
    assert K.pool_scope(False) is True
    assert K.pool_scope(True) is False
    seen: list[bool] = []
    t = threading.Thread(target=lambda: seen.append(K.pool_scope(False)))
    t.start()
    t.join(timeout=30)
    assert seen == [False]


def test_two_callers_at_once(threads):
    """A second Python thread's loop runs on its own while the pool is busy: both stay right."""
    threads(2)
    run = _workload(torch.bfloat16)
    K.set_thread_pool(False)
    ref = run()
    K.set_thread_pool(True)
    bad: list[str] = []

    def caller():
        K.pool_scope(True)  # (per thread)
        for _ in range(15):
            if not all(torch.equal(a, b) for a, b in zip(run(), ref)):
                bad.append("differs")

    ts = [threading.Thread(target=caller) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts) and not bad


# The data is made on one thread: a parent that has started an OpenMP team leaves GNU OpenMP
# unusable in a forked child (its team is gone), whatever the pool does; the pool's own loops
# never start one.
CHILD = """
import os, torch
from axonserve.neuron.ops import native
K = native.kernels()
print("spin", K.pool_spin_us(), flush=True)
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
gu = torch.randn(700, 2 * 1536, generator=g).to(torch.bfloat16)
logits = torch.randn(64, 4096, generator=g).to(torch.bfloat16)
torch.set_num_threads(2)
K.pool_scope(True)
run = lambda: [K.silu_and_mul(gu), K.argmax_rows(logits)]
ref = run()
names = lambda: [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
tasks = lambda: names().count("axon-pool")
assert tasks() >= 1
pid = os.fork()
if pid == 0:  # the child's pool is its own: members made anew, same bits
    before = K.pool_loops()
    ok = all(torch.equal(a, b) for _ in range(5) for a, b in zip(run(), ref))
    os._exit(0 if ok and tasks() >= 1 and K.pool_loops() > before else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.parametrize(("value", "spin"), [(None, 20), ("50", 50), ("99999999999", 1000), ("-5", 0), ("junk", 0)])
def test_spin_bounded_and_fork_gets_its_own_pool(value, spin):
    """AXONSERVE_POOL_SPIN_US is read once, within 0-1000 µs; a process forked after the pool ran
    makes a pool of its own (threads are not inherited) and computes the same bits on it."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("AXONSERVE_POOL_SPIN_US", "AXONSERVE_POOL")}
    if value is not None:
        env["AXONSERVE_POOL_SPIN_US"] = value
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"spin {spin}\n" in r.stdout and "child 0\n" in r.stdout, r.stdout
