"""Paged attention against a dense per-sequence reference: decodes, the batched short-chunk
path (speculative verification) and ordinary prefill chunks in one flat batch."""

from __future__ import annotations

import torch

from axonserve.neuron.ops.attention import AttentionMetadata, paged_attention


def random_block_tables(seqs: list[tuple[int, int]], bs: int, blocks: int, g: torch.Generator) -> list[list[int]]:
    """Distinct, shuffled blocks covering each (query_len, context_len) sequence."""
    perm = torch.randperm(blocks, generator=g).tolist()
    tables, at = [], 0
    for qn, ctx in seqs:
        need = -(-(qn + ctx) // bs)
        tables.append(perm[at : at + need])
        at += need
    return tables


def test_mixed_batch_matches_dense_attention():
    g = torch.Generator().manual_seed(0)
    bs, blocks, hkv, hq, d = 4, 64, 2, 6, 8
    k_cache = torch.randn(blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(blocks, bs, hkv, d, generator=g)
    # (query_len, context_len): 2 decodes, 3 equal short chunks (one batched call), 1 prefill
    seqs = [(1, 7), (1, 12), (4, 5), (4, 9), (4, 17), (6, 3)]
    tables = random_block_tables(seqs, bs, blocks, g)
    meta = AttentionMetadata.build([q for q, _ in seqs], [c for _, c in seqs], tables, bs)
    assert meta.num_decodes == 2 and meta.short == (3, 4) and len(meta.prefills) == 1
    t = sum(q for q, _ in seqs)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    scale = d ** -0.5
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale)  # writes k, v into the caches first
    row = 0
    for (qn, ctx), table in zip(seqs, tables):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx + qn)])
        keys = k_cache.view(-1, hkv, d)[slots].repeat_interleave(hq // hkv, dim=1)  # [L, hq, d]
        vals = v_cache.view(-1, hkv, d)[slots].repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + qn], keys) * scale
        causal = torch.arange(ctx + qn)[None, :] <= (ctx + torch.arange(qn))[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        ref = torch.einsum("hqk,khd->qhd", probs, vals)
        torch.testing.assert_close(out[row : row + qn], ref, atol=1e-5, rtol=1e-5)
        row += qn
