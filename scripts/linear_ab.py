#!/usr/bin/env python
"""A decode step's linears on this checkout's kernels against another build's, interleaved in one process.

SmolLM2-135M's shapes (30 layers of qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576,
1536], each layer its own weights, then the tied LM head [49152, 576]: 268 MB of bf16) multiplied
by `--rows` rows each, as one decode step of that batch runs them. Before each sweep a buffer of 4x
the L3 is written, so the weights come from DRAM, as a busy neighbour leaves the cache. Each round
sweeps once with each contender: this build's skinny kernel (`this`), the base build's (`base`,
where it takes that many rows) and oneDNN on the reordered weight (`onednn`, what rows above the
skinny limit get), plus `dot`, the AVX512-BF16 dot-product loop (`dot_bf16`, what a CPU without
AMX runs for 1-128 rows), with `--dot`. Per-round ratios to `base` (else `onednn`) are reported: the machine's hourly
swings cancel in a ratio of neighbouring sweeps.

    BASE=$(cd /tmp && PYTHONPATH=/tmp/base python -c \
        "from axonserve.neuron.ops import native; print(native.kernels().__file__)")
    PYTHONPATH=. python scripts/linear_ab.py --base "$BASE" --rows 32,64,96,128

docs/benchmarks.md#fig-amx-passes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from axonserve.bench.repeat import l3_bytes
from axonserve.neuron.layers.quant import PackedWeight, QuantizedWeight, onednn_matmul
from axonserve.neuron.ops import native

HIDDEN, QKV, INTER, VOCAB, LAYERS = 576, 960, 1536, 49152, 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="", help="path of the other build's compiled kernels (.so)")
    p.add_argument("--rows", default="32,64,96,128", help="comma-separated row counts")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--int8", action="store_true", help="int8 weights (skinny_int8) instead of bf16")
    p.add_argument("--dot", action="store_true", help="also this build's dot_bf16 (AVX512-BF16, no AMX)")
    args = p.parse_args()
    torch.manual_seed(0)
    this = native.for_dtype(torch.bfloat16)
    mods = {"this": this}
    if args.base:
        mods["base"] = native.load_build(args.base)
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]
    # the engine's own weights: the skinny copy (the same layout in every build) and oneDNN's
    weights = [
        QuantizedWeight(w, "int8", torch.bfloat16) if args.int8 else PackedWeight(w)
        for w in (torch.randn(n, k, dtype=torch.bfloat16) / k**0.5 for n, k in shapes)
    ]
    if weights[0].skinny is None:
        raise SystemExit("no skinny kernels on this CPU")
    skinny = [q.skinny for q in weights]
    reordered = [q.data for q in weights]

    def mul(mod, x: torch.Tensor, i: int) -> torch.Tensor:
        if mod == "dot":
            return this.dot_bf16(x, skinny[i])
        if args.int8:
            return mod.skinny_int8(x, skinny[i], weights[i].skinny_scales)
        return mod.skinny_bf16(x, skinny[i])

    flush = torch.empty(4 * l3_bytes() // 4, dtype=torch.float32)

    def sweep(name: str, x: dict[int, torch.Tensor]) -> float:
        flush.fill_(1.0)
        t = time.perf_counter()
        if name == "onednn":
            for (_, k), w in zip(shapes, reordered):
                onednn_matmul(x[k], w)
        else:
            mod = mods.get(name, name)
            for i, (_, k) in enumerate(shapes):
                mul(mod, x[k], i)
        return (time.perf_counter() - t) * 1e3

    mb = sum(w.numel() * w.element_size() for w in skinny) / 1e6
    kind = "int8" if args.int8 else "bf16"
    print(f"{len(skinny)} linears, {mb:.0f} MB {kind}, {torch.get_num_threads()} threads, cold L3 each sweep")
    for rows in [int(r) for r in args.rows.split(",")]:
        x = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (HIDDEN, INTER)}
        names = [n for n, m in mods.items() if rows <= m.skinny_rows(skinny[0])] + ["onednn"]
        if args.dot and rows <= 128:
            names.insert(0, "dot")
        outs = {}
        for n in names:  # correctness and warm-up: the products agree to a bf16 rounding
            outs[n] = mul(mods.get(n, n), x[HIDDEN], 2) if n != "onednn" else onednn_matmul(x[HIDDEN], reordered[2])
        ref = outs["onednn"].float()
        ms: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.rounds):
            for n in names:
                ms[n].append(sweep(n, x))
        ref_name = "base" if "base" in ms else "onednn"
        print(f"## {rows} rows")
        for n in names:
            err = (outs[n].float() - ref).abs().max().item()
            ratios = [a / b for a, b in zip(ms[n], ms[ref_name])]
            print(
                f"  {n:7s} {statistics.median(ms[n]):7.2f} ms [{min(ms[n]):.2f}, {max(ms[n]):.2f}]"
                f"  {mb / statistics.median(ms[n]):5.1f} GB/s  /{ref_name} {statistics.median(ratios):.3f}"
                f" [{min(ratios):.3f}, {max(ratios):.3f}]  max|d| vs onednn {err:.3g}"
            )


if __name__ == "__main__":
    main()
