#!/usr/bin/env python
"""A decode step's matmuls (SmolLM2-135M's 30 x (qkv, o, gate_up, down) + LM head shapes, random
weights, 270-540 MB: from DRAM) through torch's float32 linear (MKL) and through the native panel
kernel with bf16 and float32 panels (layers/quant.py PanelWeight). Interleaved rounds, medians;
GFLOP/s = 2 M sum(N K) / time. docs/benchmarks.md#fig-panel-gemm.

    PYTHONPATH=. python scripts/panel_gemm.py 1 4 32 128 1024
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from axonserve.neuron.layers.quant import panel_kernels

k = panel_kernels(torch.float32)
if k is None:
    sys.exit("panel_linear is not built here (AVX2 CPUs without AVX-512 only)")
torch.set_num_threads(2)
torch.manual_seed(0)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
dense = [torch.randn(n, kk).bfloat16().float() for n, kk in SHAPES]  # bf16 values: both panel formats are exact
panels = {"panel bf16": [k.pack_panels(w.bfloat16()) for w in dense], "panel f32": [k.pack_panels(w) for w in dense]}
rounds = 5
print("| rows | MKL float32 ms | panel bf16 ms | panel float32 ms | GFLOP/s MKL / bf16 / f32 |")
print("|---|---|---|---|---|")
for m in [int(a) for a in sys.argv[1:]] or [1, 4, 32, 128]:
    xs = {kk: torch.randn(m, kk) for kk in (576, 1536)}
    times: dict[str, list[float]] = {"mkl": [], "panel bf16": [], "panel f32": []}
    for _ in range(rounds):
        for name in times:
            t = time.perf_counter()
            for i, w in enumerate(dense):
                x = xs[w.shape[1]]
                F.linear(x, w) if name == "mkl" else k.panel_linear(x, panels[name][i])
            times[name].append((time.perf_counter() - t) * 1e3)
    med = {n: statistics.median(v) for n, v in times.items()}
    gf = 2 * m * sum(n * kk for n, kk in SHAPES) / 1e6
    cells = " | ".join(f"{med[n]:.1f} [{min(times[n]):.1f}, {max(times[n]):.1f}]" for n in times)
    print(f"| {m} | {cells} | {' / '.join(f'{gf / med[n]:.0f}' for n in times)} |", flush=True)
