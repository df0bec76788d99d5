#!/usr/bin/env python
"""The native paged attention alone: 32 decode rows x 129 keys x 30 layers (SmolLM2's 9 query /
3 KV heads of 64 dims, float32 cache, 16-token blocks), from DRAM (30 layers' caches, 190 MB) and
from L3 (one layer's cache reused 30 times, 6 MB); medians of 7 after a 128 MB write.
docs/benchmarks.md#fig-attention-s18.

    PYTHONPATH=. python scripts/paged_attention_bench.py
"""

import statistics
import time

import torch

from axonserve.neuron.ops import native

k = native.kernels()
torch.set_num_threads(2)
B, L, HQ, HKV, D, BS, LAYERS = 32, 129, 9, 3, 64, 16, 30
per_seq = (L + BS - 1) // BS
table = torch.arange(B * per_seq).reshape(B, per_seq)
seq, kv_len = torch.arange(B), torch.full((B,), L)
q, out = torch.randn(B, HQ, D), torch.empty(B, HQ, D)
junk = torch.empty(128 << 20, dtype=torch.uint8)
caches = [(torch.randn(B * per_seq, BS, HKV, D), torch.randn(B * per_seq, BS, HKV, D)) for _ in range(LAYERS)]
for name, layers in (("DRAM", caches), ("L3", caches[:1] * LAYERS)):
    times = []
    for rep in range(7):
        junk.fill_(rep)
        t = time.perf_counter()
        for kc, vc in layers:
            k.paged_attention(out, q, kc, vc, table, seq, kv_len, D**-0.5)
        times.append((time.perf_counter() - t) * 1e3)
    print(f"{name}: {statistics.median(times):.2f} ms [{min(times):.2f}, {max(times):.2f}] per 30 layers")
