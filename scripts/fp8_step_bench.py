#!/usr/bin/env python
"""Decode step time of SmolLM2-135M: bf16 vs -q fp8 (and int8), through the model's own forward
(native attention + fused stack), batch sizes B, context 128; 3 interleaved rounds, median of 10
steps each (13 steps, the first 3 dropped); prints per config the median of the 3 round medians and
their range. Usage: PYTHONPATH=. python scripts/fp8_step_bench.py [threads]"""

import statistics
import sys
import time

import torch

from axonserve.neuron.config import ModelConfig
from axonserve.neuron.loader import load_model
from axonserve.neuron.model_source import resolve_model
from axonserve.neuron.ops import native
from axonserve.neuron.ops.attention import AttentionMetadata

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
mc = ModelConfig.from_dir(resolve_model(None))
configs = {q or "bf16": load_model(mc, torch.bfloat16, progress=False, quantization=q) for q in ("", "fp8", "int8")}
BS, CTX = 16, 128


def step_time(model, b):
    shape = (b * 16, BS, mc.num_kv_heads, mc.head_dim)
    caches = [
        (torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
        for _ in range(mc.num_layers)
    ]
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(b)]
    meta = AttentionMetadata.build([1] * b, [CTX] * b, tables, BS, native=native.for_dtype(torch.bfloat16))
    ids = torch.randint(0, mc.vocab_size, (b,))
    model.model._stack = None
    ts = []
    with torch.inference_mode():
        for _ in range(13):
            t0 = time.perf_counter()
            model(ids, meta.positions, caches, meta)
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts[3:]) * 1e3


for b in (1, 8):
    res = {k: [] for k in configs}
    for _ in range(3):
        for k, m in configs.items():
            res[k].append(step_time(m, b))
    for k, v in res.items():
        print(f"batch {b:3d} {k:5s} median {statistics.median(v):7.2f} ms  range {min(v):.2f}-{max(v):.2f}", flush=True)
