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
    scale = d**-0.5
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


def test_draft_tree_rows_attend_to_their_ancestors():
    """Speculative verification of draft trees: a tree's rows sit at position context + depth and
    attend to the context plus their ancestors (and themselves), through the batched short-chunk
    path (two equal trees), a prefill chunk (a tree of another size) and the native kernel's extra
    keys, next to a decode and a chain verification."""
    from axonserve.neuron.ops import native

    g = torch.Generator().manual_seed(1)
    bs, blocks, hkv, hq, d = 4, 64, 2, 4, 32
    # row parents: root (-1), then each draft's parent row
    tree_a = [-1, 0, 0, 1, 1, 2, 3]
    tree_b = [-1, 0, 1, 0, 3, 0, 5]
    tree_c = [-1, 0, 0, 0, 2]
    seqs = [(1, 9), (7, 5), (7, 14), (3, 6), (5, 10)]  # decode, two 7-row trees, a chain, a 5-row tree
    trees = {1: tree_a, 2: tree_b, 4: tree_c}
    tables = random_block_tables(seqs, bs, blocks, g)
    kinds = [None] + ([native.for_dtype(torch.float32)] if native.for_dtype(torch.float32) is not None else [])
    k_init = torch.randn(blocks, bs, hkv, d, generator=g)
    v_init = torch.randn(blocks, bs, hkv, d, generator=g)
    t = sum(q for q, _ in seqs)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    for kernels in kinds:
        meta = AttentionMetadata.build(
            [n for n, _ in seqs],
            [c for _, c in seqs],
            tables,
            bs,
            native=kernels,
            trees={i: [p - 1 for p in rows[1:]] for i, rows in trees.items()},
        )
        if kernels is None:
            assert meta.short == (2, 7) and len(meta.prefills) == 2
        k_cache, v_cache = k_init.clone(), v_init.clone()
        out = paged_attention(q, k, v, k_cache, v_cache, meta, d**-0.5)
        row = 0
        for i, ((qn, ctx), table) in enumerate(zip(seqs, tables)):
            parents = trees.get(i, list(range(-1, qn - 1)))
            depth, seen = [0] * qn, [{r} for r in range(qn)]
            for r, p in enumerate(parents):
                if p >= 0:
                    depth[r], seen[r] = depth[p] + 1, seen[r] | seen[p]
            assert meta.positions[row : row + qn].tolist() == [ctx + x for x in depth]
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx + qn)])
            keys = k_cache.view(-1, hkv, d)[slots].repeat_interleave(hq // hkv, dim=1)
            vals = v_cache.view(-1, hkv, d)[slots].repeat_interleave(hq // hkv, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[row : row + qn], keys) * d**-0.5
            mask = torch.tensor([[j < ctx or (j - ctx) in seen[r] for j in range(ctx + qn)] for r in range(qn)])
            ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vals)
            torch.testing.assert_close(out[row : row + qn], ref, atol=1e-5, rtol=1e-5)
            row += qn
    assert len(kinds) == 2 or native.kernels() is None  # the kernel path ran wherever it is built


def _fields(meta: AttentionMetadata) -> dict:
    out = {}
    for f in ("positions", "slot_mapping", "native_block_table", "native_row_seq", "native_row_kv_len"):
        out[f] = getattr(meta, f).tolist()
    out.update(native_rows=meta.native_rows, native_idx=meta.native_idx, prefills=meta.prefills)
    return out


def test_native_decode_batch_equals_the_general_build():
    """Single-token decodes on the native kernels take `_native_decodes`; it gives exactly what the
    general `_build` gives, from block lists and from the runner's persistent table."""
    from axonserve.neuron.block_table import BlockTable
    from axonserve.neuron.ops import native

    kernels = native.for_dtype(torch.float32)
    if kernels is None:
        import pytest

        pytest.skip("native kernels are not built here")
    g = torch.Generator().manual_seed(1)
    bs = 4
    ctx = [0, 3, 4, 7, 8, 31]  # block boundaries on both sides
    tables = random_block_tables([(1, c) for c in ctx], bs, 64, g)
    tables = [t + [63, 62] for t in tables]  # blocks held past the step's need (allocated ahead)
    bt = BlockTable(rows=2, width=2)  # grows in rows and columns
    bt.free(bt.add([5] * 11))  # a long row freed: the next request reuses it, its stale ids must not leak
    rows = [bt.add(t[:1]) for t in tables]
    for r, t in zip(rows, tables):
        bt.extend(r, t[1:])
    assert 5 in bt.rows(rows)[0].tolist()
    for source in (tables, bt.rows(rows)):
        fast = AttentionMetadata.build([1] * len(ctx), ctx, source, bs, native=kernels)
        general = AttentionMetadata._build([1] * len(ctx), ctx, tables, bs, kernels, None, None)
        assert _fields(fast) == _fields(general)
        windowed = AttentionMetadata._build([1] * len(ctx), ctx, tables, bs, kernels, None, 8)
        assert fast.rebuild is not None and _fields(fast.rebuild(8)) == _fields(windowed)


def test_block_table_rows_follow_adds_extends_and_frees():
    from axonserve.neuron.block_table import BlockTable

    bt = BlockTable(rows=1, width=1)
    a = bt.add([1, 2, 3])
    b = bt.add([7])
    bt.extend(b, [8, 9, 10, 11])
    got = bt.rows([b, a]).tolist()
    assert got[0] == [7, 8, 9, 10, 11] and got[1][:3] == [1, 2, 3]
    bt.free(a)
    c = bt.add([4])
    assert c == a and bt.rows([c]).tolist() == [[4]]
    bt.clear()
    assert bt.add([6]) in (a, b) and int(bt.count.sum()) == 1
