#!/usr/bin/env python
"""Time one decode step (the model's forward over B single-token rows + the LM head) in-process,
with a warm and with a cold L3 (a 128 MB buffer written before each cold step); medians of 10.
The serving path: the fused C++ decoder stack where it applies. Run it twice with different
environments or trees, interleaved, to compare them (docs/benchmarks.md#fig-omp-wait):

    PYTHONPATH=. python scripts/decode_step.py float32 32 128
    PYTHONPATH=. python scripts/decode_step.py float32 32 128 int8   # --activation-quantization int8
"""

import statistics
import sys
import time

import torch

from axonserve.neuron.config import ModelConfig
from axonserve.neuron.loader import load_model
from axonserve.neuron.model_source import resolve_model
from axonserve.neuron.ops import native
from axonserve.neuron.ops.attention import AttentionMetadata

dtype_name, B, CTX = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 128
ACT = sys.argv[4] if len(sys.argv) > 4 else ""
dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
torch.set_num_threads(2)
mc = ModelConfig.from_dir(resolve_model(None))
model = load_model(mc, dt, progress=False, activation_quantization=ACT)
BS = 16
nb = (CTX + BS) // BS + 1
shape = (B * nb, BS, mc.num_kv_heads, mc.head_dim)
caches = [(torch.randn(shape).to(dt), torch.randn(shape).to(dt)) for _ in range(mc.num_layers)]
tables = [list(range(i * nb, (i + 1) * nb)) for i in range(B)]
meta = AttentionMetadata.build([1] * B, [CTX] * B, tables, BS, native=native.for_dtype(dt))
ids = torch.randint(0, mc.vocab_size, (B,))
flush = torch.empty(128 << 20, dtype=torch.uint8)


def step(cold: bool) -> float:
    if cold:
        flush.add_(1)
    t0 = time.perf_counter()
    model.compute_logits(model(ids, meta.positions, caches, meta))
    return time.perf_counter() - t0


with torch.inference_mode():
    for _ in range(3):
        step(False)
    for cold in (False, True):
        ts = [step(cold) for _ in range(10)]
        where = "cold" if cold else "warm"
        med, lo, hi = statistics.median(ts) * 1e3, min(ts) * 1e3, max(ts) * 1e3
        print(f"{dtype_name} batch {B} ctx {CTX} {where} L3: step {med:.2f} ms [{lo:.2f}, {hi:.2f}]")
