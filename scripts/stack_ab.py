#!/usr/bin/env python
"""One model step on the fused decoder stack built twice, interleaved step by step in one process
(the machine's swings hit both alike): with an environment switch off and on, or from another
build's kernels and this checkout's.

A switch must be one the native stack reads when it is built (models/fused.py `build`), e.g.
AXONSERVE_GATE_UP_SILU (gate_up and silu_and_mul in one pass). `--base SO` instead builds the "off"
stack from another checkout's compiled kernels (as scripts/attention_ab.py). Decode (default): `--batch` rows of
`--context` keys each; prompt (`--prefill N`): one N-token prompt in one chunk (AMX attention).
`--cold` writes 128 MiB before each step. Prints each variant's median and the per-pair ratio
(on / off, median [min, max]); outputs are compared bit for bit first.

    PYTHONPATH=. python scripts/stack_ab.py AXONSERVE_GATE_UP_SILU --batch 32 --context 128
    PYTHONPATH=. python scripts/stack_ab.py AXONSERVE_GATE_UP_SILU --prefill 1024
    PYTHONPATH=. python scripts/stack_ab.py --base "$BASE" --batch 1   # BASE: see attention_ab.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from axonserve.neuron.config import ModelConfig
from axonserve.neuron.loader import load_model
from axonserve.neuron.model_source import resolve_model
from axonserve.neuron.models import fused
from axonserve.neuron.ops import native
from axonserve.neuron.ops.attention import AttentionMetadata

BS = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("switch", nargs="?", default="", help="env variable the stack reads when built (0 off, 1 on)")
    p.add_argument("--base", default="", help="the other build's compiled kernels (.so): the 'off' stack")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--prefill", type=int, default=0, help="one prompt of this many tokens instead of decodes")
    p.add_argument("--steps", type=int, default=30, help="pairs of steps")
    p.add_argument("--cold", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    dt = torch.bfloat16
    kernels = native.for_dtype(dt)
    mc = ModelConfig.from_dir(resolve_model(None))
    model = load_model(mc, dt, progress=False)
    inner = model.model  # the LlamaModel, which holds the stack
    rows, ctx = (a.prefill, 0) if a.prefill else (a.batch, a.context)
    seqs = 1 if a.prefill else a.batch
    nb = (ctx + rows + BS - 1) // BS if a.prefill else (ctx + BS) // BS + 1
    shape = (seqs * nb, BS, mc.num_kv_heads, mc.head_dim)
    caches = [(torch.randn(shape).to(dt), torch.randn(shape).to(dt)) for _ in range(mc.num_layers)]
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(seqs)]
    if a.prefill:
        meta = AttentionMetadata.build([rows], [0], tables, BS, native=kernels, native_chunks=True)
    else:
        meta = AttentionMetadata.build([1] * rows, [ctx] * rows, tables, BS, native=kernels)
    ids = torch.randint(0, mc.vocab_size, (rows,))
    assert fused.takes(meta, torch.empty(rows, mc.hidden_size)), "this step does not run on the fused stack"
    assert bool(a.switch) != bool(a.base), "a switch or --base, one of them"
    stacks = {}
    for v in ("0", "1"):
        if a.switch:
            os.environ[a.switch] = v
        stacks[v] = fused.build(inner, caches, native.load_build(a.base) if a.base and v == "0" else kernels)
        assert stacks[v] is not None, "no fused stack for this model"
    key = fused.cache_key(caches)
    flush = torch.empty(128 << 20, dtype=torch.uint8)

    def step(v: str) -> tuple[float, torch.Tensor]:
        inner._stack = (key, stacks[v])
        if a.cold:
            flush.add_(1)
        t0 = time.perf_counter()
        out = model(ids, meta.positions, caches, meta)
        return time.perf_counter() - t0, out

    with torch.inference_mode():
        outs = [step(v)[1] for v in ("0", "1")]
        same = torch.equal(outs[0], outs[1])
        print(f"outputs {'identical' if same else 'DIFFER: max ' + str((outs[0] - outs[1]).abs().max().item())}")
        ts: dict[str, list[float]] = {"0": [], "1": []}
        for i in range(a.steps):
            for v in ("0", "1") if i % 2 == 0 else ("1", "0"):
                ts[v].append(step(v)[0] * 1e3)
    what = f"prompt of {rows}" if a.prefill else f"decode {rows} rows x {ctx + 1} keys"
    print(f"{what}, {'cold' if a.cold else 'warm'}, {a.steps} pairs")
    label = a.switch or "build"
    for v, name in (("0", "base" if a.base else "off"), ("1", "this" if a.base else "on")):
        med, mean = statistics.median(ts[v]), statistics.fmean(ts[v])
        print(f"  {label}={v} ({name}): {med:.2f} ms [{min(ts[v]):.2f}, {max(ts[v]):.2f}], mean {mean:.2f}")
    r = [x / y for x, y in zip(ts["1"], ts["0"])]
    which = "this / base" if a.base else "on / off"
    print(f"  {which} per pair: {statistics.median(r):.3f} [{min(r):.3f}, {max(r):.3f}]")


if __name__ == "__main__":
    main()
