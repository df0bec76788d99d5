#!/usr/bin/env python
"""Paged attention of this checkout's kernels against another build's, interleaved in one process.

SmolLM2's attention shape (9 query / 3 KV heads of 64 dims, bf16 cache in 16-slot blocks in random
order), 30 layers' caches cycled so the keys come from DRAM. Decode (default): `--rows` sequences
of `--context` keys decode one token each. Prefill (`--prefill N`): one N-token prompt in one
chunk (the AMX prompt kernel). `--prefix-len P --prefix-groups G`: the decode rows' first P keys
are one of G shared prefixes (whole blocks; row i takes prefix i % G), as a chat workload's system
prompts leave them (the shared-prefix path, amx_attention.h). Each round times 30 layers with one
build, then with the other, and the per-round ratios (this / base) are reported: the machine's
hourly swings cancel in a ratio of neighbouring rounds.
The base build is another checkout's compiled module, e.g. the previous commit's:

    git worktree add /tmp/base HEAD~1
    BASE=$(cd /tmp && PYTHONPATH=/tmp/base python -c \
        "from axonserve.neuron.ops import native; print(native.kernels().__file__)")
    PYTHONPATH=. python scripts/attention_ab.py --base "$BASE" --rows 128 --context 160
    PYTHONPATH=. python scripts/attention_ab.py --base "$BASE" --prefill 2048
    PYTHONPATH=. python scripts/attention_ab.py --base "$BASE" --rows 16 --context 600 \
        --prefix-len 512 --prefix-groups 2

docs/benchmarks.md#fig-decode-attention-bound, #fig-amx-prefill-overlap, #fig-shared-prefix.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from axonserve.neuron.ops import native
from axonserve.neuron.ops.attention import AttentionMetadata, paged_attention

HQ, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="path of the other build's compiled kernels (.so)")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--prefill", type=int, default=0, help="one prompt of this many tokens instead of decodes")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--prefix-len", type=int, default=0, help="decode rows share this many leading keys (whole blocks)")
    p.add_argument("--prefix-groups", type=int, default=1, help="distinct shared prefixes (row i: prefix i %% groups)")
    args = p.parse_args()
    torch.manual_seed(0)
    mods = {"this": native.for_dtype(torch.bfloat16), "base": native.load_build(args.base)}
    seqs, rows = (1, args.prefill) if args.prefill else (args.rows, args.rows)
    query_lens, context_lens = ([rows], [0]) if args.prefill else ([1] * rows, [args.context] * rows)
    per = -(-(context_lens[0] + query_lens[0]) // BS)
    shared = min(args.prefix_len // BS, per - 1) if not args.prefill else 0  # blocks a group's rows share
    groups = max(1, args.prefix_groups) if shared else 0
    blocks = groups * shared + seqs * (per - shared)  # a layer's
    k_cache = torch.randn(blocks * LAYERS, BS, HKV, D, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(rows, HQ, D, dtype=torch.bfloat16)
    k, v = torch.randn(rows, HKV, D, dtype=torch.bfloat16), torch.randn(rows, HKV, D, dtype=torch.bfloat16)
    tables = []
    for layer in range(LAYERS):
        perm = (torch.randperm(blocks) + layer * blocks).tolist()
        prefixes, own = perm[: groups * shared], perm[groups * shared :]
        own_n = per - shared  # row i: its group's (i % groups) prefix blocks, then its own
        tables.append(
            [
                prefixes[(i % groups) * shared : (i % groups + 1) * shared] + own[i * own_n : (i + 1) * own_n]
                for i in range(seqs)
            ]
            if shared
            else [perm[i * per : (i + 1) * per] for i in range(seqs)]
        )
    metas = {
        name: [
            AttentionMetadata.build(query_lens, context_lens, t, BS, native=m, native_chunks=bool(args.prefill))
            for t in tables
        ]
        for name, m in mods.items()
    }
    outs = [paged_attention(q, k, v, k_cache, v_cache, metas[n][0], D**-0.5, False).float() for n in mods]
    print(f"max |this - base| = {(outs[0] - outs[1]).abs().max().item():.3g}")
    ms: dict[str, list[float]] = {name: [] for name in mods}
    for _ in range(args.rounds):
        for name in mods:
            t = time.perf_counter()
            for meta in metas[name]:
                paged_attention(q, k, v, k_cache, v_cache, meta, D**-0.5, False)
            ms[name].append((time.perf_counter() - t) / LAYERS * 1e3)
    shape = f"one {rows}-token prompt" if args.prefill else f"{rows} rows x {args.context + 1} keys"
    if shared:
        shape += f", the first {shared * BS} shared by the rows of each of {groups} group(s)"
    print(f"{shape}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    for name, xs in ms.items():
        print(f"  {name}: {statistics.median(xs):.3f} ms a layer [{min(xs):.3f}, {max(xs):.3f}]")
    ratios = [a / b for a, b in zip(ms["this"], ms["base"])]
    print(f"  this / base per round: {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")


if __name__ == "__main__":
    main()
