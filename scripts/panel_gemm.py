#!/usr/bin/env python
"""A decode step's matmuls (SmolLM2-135M's 30 x (qkv, o, gate_up, down) + LM head shapes, random
weights as its GGUF holds them: Q4_1 layers, Q8_0 LM head, dequantized to float32; 540 MB, from
DRAM) through torch's float32 linear (MKL) and through the native panel kernel (layers/quant.py
PanelWeight) with those weights as codes (what serving uses for them), as float32 panels, and as
bf16 panels (a bf16 checkpoint's case). Interleaved rounds, medians [min, max];
GFLOP/s = 2 M sum(N K) / time. docs/benchmarks.md#fig-panel-gemm.

    PYTHONPATH=. python scripts/panel_gemm.py 1 4 32 128 1024
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from axonserve.neuron.layers.quant import PanelWeight, panel_kernels

k = panel_kernels(torch.float32)
if k is None:
    sys.exit("panel_linear is not built here (AVX2 CPUs without AVX-512 only)")
torch.set_num_threads(2)
torch.manual_seed(0)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def gguf_like(n: int, kk: int, bits: int) -> torch.Tensor:
    """float32 of q d + m per row and block of 32 (Q4_1: q 0..15; Q8_0: q -127..127, m = 0)."""
    blocks = (n, kk // 32)
    d = (torch.rand(blocks) * 0.01 + 1e-4).half().double()
    if bits == 4:
        q, m = torch.randint(0, 16, (*blocks, 32)).double(), (torch.randn(blocks) * 0.05).half().double()
        q[..., 0], q[..., 1] = 0, 15  # as llama.cpp quantizes: the block's min and max are codes 0 and 15
    else:
        q, m = torch.randint(-127, 128, (*blocks, 32)).double(), torch.zeros(blocks, dtype=torch.float64)
        q[..., 0] = 127  # the block's largest magnitude
    return (q * d[..., None] + m[..., None]).float().reshape(n, kk)


dense = [gguf_like(n, kk, 8 if n == 49152 else 4) for n, kk in SHAPES]
coded = [PanelWeight(w, k) for w in dense]
assert {c.format for c in coded} == {"q4", "q8"}
panels = {"panel f32": [k.pack_panels(w) for w in dense], "panel bf16": [k.pack_panels(w.bfloat16()) for w in dense]}
rounds = 5
print(
    "| rows | MKL float32 ms | panel codes ms | panel float32 ms | panel bf16 ms | GFLOP/s MKL / codes / f32 / bf16 |"
)  # noqa: E501
print("|---|---|---|---|---|---|")
for m in [int(a) for a in sys.argv[1:]] or [1, 4, 32, 128]:
    xs = {kk: torch.randn(m, kk) for kk in (576, 1536)}
    times: dict[str, list[float]] = {"mkl": [], "codes": [], "panel f32": [], "panel bf16": []}
    for _ in range(rounds):
        for name in times:
            t = time.perf_counter()
            for i, w in enumerate(dense):
                x = xs[w.shape[1]]
                if name == "mkl":
                    F.linear(x, w)
                elif name == "codes":
                    coded[i].matmul(x)
                else:
                    k.panel_linear(x, panels[name][i])
            times[name].append((time.perf_counter() - t) * 1e3)
    med = {n: statistics.median(v) for n, v in times.items()}
    gf = 2 * m * sum(n * kk for n, kk in SHAPES) / 1e6
    cells = " | ".join(f"{med[n]:.1f} [{min(times[n]):.1f}, {max(times[n]):.1f}]" for n in times)
    print(f"| {m} | {cells} | {' / '.join(f'{gf / med[n]:.0f}' for n in times)} |", flush=True)
