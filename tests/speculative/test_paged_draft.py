"""The native paged drafter (speculative/paged_draft.py) drafts what a from-scratch recompute of the head
drafts, and leaves the recompute's K/V in the target's slots, over rounds with crops, block
boundaries and draft positions past the allocated blocks (the scratch block)."""

from __future__ import annotations

import pytest
import torch

from axonserve.neuron.ops import native
from axonserve.speculative.eagle import DraftKV, propose
from axonserve.speculative.paged_draft import PagedDrafter
from axonserve.speculative.training.evaluate import reference_tree

from .test_eagle import confident_head, make_head, reference_chain

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="native kernels unavailable: dense path only")
BS = 16


@pytest.mark.parametrize("k,min_prob", [(0, 0.0), (1, 0.0), (4, 0.0), (4, 0.1)])
def test_paged_propose_matches_full_recompute(tiny_llama_dir, k, min_prob):
    """min_prob > 0: chains stopped by confidence (ChainDrafts) match the recompute's too."""
    head = confident_head(tiny_llama_dir) if min_prob else make_head(tiny_llama_dir)
    drafter = PagedDrafter.maybe(head, num_blocks=32, block_size=BS, max_rows=4, max_position=512)
    assert drafter is not None
    torch.manual_seed(1)
    lens = [40, 23, 31]
    feats = [torch.randn(n, 64) for n in lens]
    toks = [torch.randint(0, 49152, (n,)) for n in lens]
    # n_i per round: prefill, then accepted+1; request 2 drafts past its last block (the scratch) twice
    rounds = [[9, 1, 14], [3, 5, 1], [1, 4, 2]]
    owned = [[7, 2, 30], [0], [11, 12]]  # scattered blocks; each round allocates what the target would
    done = [0, 0, 0]
    for ns in rounds:
        starts = list(done)
        for i, n in enumerate(ns):  # the target's blocks cover the positions it computed
            while len(owned[i]) * BS < starts[i] + n:
                owned[i].append(13 + len(owned[i]) + 4 * i)
        tables = [list(o[: -(-(s + n) // BS)]) for o, s, n in zip(owned, starts, ns)]
        got = drafter.propose(
            tables,
            starts,
            [toks[i][s : s + n].tolist() for i, (s, n) in enumerate(zip(starts, ns))],
            [feats[i][s : s + n] for i, (s, n) in enumerate(zip(starts, ns))],
            k,
            min_prob,
        )[0]
        for i, n in enumerate(ns):
            done[i] += n
            want, f_all, t_all = reference_chain(head, feats[i][: done[i]], toks[i][: done[i]], k, min_prob)
            assert got[i] == want, (i, got[i], want)
            with torch.no_grad():
                _, kf, vf = head(f_all[None, : done[i]], t_all[None, : done[i]], return_kv=True)
            pos = torch.arange(done[i])
            blocks = torch.tensor(tables[i])[pos // BS]
            torch.testing.assert_close(drafter.k[blocks, pos % BS].transpose(0, 1), kf[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(drafter.v[blocks, pos % BS].transpose(0, 1), vf[0], atol=1e-5, rtol=1e-5)


def test_packed_bf16_head_drafts_like_the_dense_path(tiny_llama_dir, tmp_path):
    """The serving form (bf16, packed weights): the paged drafter and `propose` agree on nearly every draft
    (their attention accumulates in another order, so a near-tie may differ; 24 of 24 here)."""
    from axonserve.speculative.eagle import EagleHead

    make_head(tiny_llama_dir).save_pretrained(str(tmp_path), dtype=torch.bfloat16)
    head = EagleHead.from_pretrained(str(tmp_path), tiny_llama_dir, dtype=torch.bfloat16).pack()
    drafter = PagedDrafter.maybe(head, num_blocks=64, block_size=BS, max_rows=8, max_position=512)
    torch.manual_seed(2)
    b, n = 8, 37
    feats = [torch.randn(n, 64).bfloat16() for _ in range(b)]
    toks = [torch.randint(0, 49152, (n,)) for _ in range(b)]
    tables = [list(range(i * 8, i * 8 + 3)) for i in range(b)]
    got = drafter.propose(tables, [0] * b, [t.tolist() for t in toks], feats, 3)[0]
    want = propose(head, [DraftKV.for_head(head) for _ in range(b)], [0] * b, toks, feats, 3)
    # a near-tie that flips one request's first draft changes its later drafts too: allow two of those
    first = sum(g[0] == w[0] for g, w in zip(got, want))
    same = sum(g == w for gs, ws in zip(got, want) for g, w in zip(gs, ws))
    assert first >= b - 2 and same >= 3 * (b - 2), (got, want)  # unrelated drafters agree on ~1/512


def test_positions_past_the_scratch_block_are_refused(tiny_llama_dir):
    head = make_head(tiny_llama_dir)
    drafter = PagedDrafter.maybe(head, num_blocks=8, block_size=BS, max_rows=2, max_position=512)
    with pytest.raises(ValueError, match="past its blocks"):  # 17 drafts from position 15: two blocks past
        drafter.propose([[3]], [15], [[1]], [torch.zeros(1, 64)], BS + 3)


def test_int8_head_drafts_like_the_bf16_head(tiny_llama_dir, tmp_path):
    """A target served with quantized weights gets an int8 head (half the bytes a draft step
    reads): its drafts match the bf16 head's but for near-ties."""
    from axonserve.neuron.layers.quant import QuantizedWeight
    from axonserve.speculative.eagle import EagleHead

    make_head(tiny_llama_dir).save_pretrained(str(tmp_path), dtype=torch.bfloat16)
    heads = [
        EagleHead.from_pretrained(str(tmp_path), tiny_llama_dir, dtype=torch.bfloat16).pack(q) for q in ("", "int8")
    ]
    ws = [heads[1].fc.w, heads[1].layer.packed_qkv.w, heads[1].layer.down_proj.w, heads[1].packed_lm_head.w]
    assert all(isinstance(w, QuantizedWeight) and w.method == "int8" for w in ws)
    torch.manual_seed(3)
    b, n = 8, 29
    feats = [torch.randn(n, 64).bfloat16() for _ in range(b)]
    toks = [torch.randint(0, 49152, (n,)) for _ in range(b)]
    tables = [list(range(i * 8, i * 8 + 3)) for i in range(b)]
    got = [
        PagedDrafter.maybe(h, num_blocks=64, block_size=BS, max_rows=8, max_position=512).propose(
            tables, [0] * b, [t.tolist() for t in toks], feats, 2
        )[0]
        for h in heads
    ]
    first = sum(g[0] == w[0] for g, w in zip(*got))
    assert first >= b - 2, got  # unrelated drafters agree on ~1/512


@pytest.mark.parametrize("width,depth,budgets", [(3, 4, [8, 5, 1]), (4, 3, [9, 12, 4]), (2, 2, [3, 0, 2])])
def test_paged_tree_matches_full_recompute(tiny_llama_dir, width, depth, budgets):
    """EAGLE-2 trees (TreeDrafts over the scratch block, tree attention through the kernel's extra
    keys) are the trees a full recompute of the head builds, over two rounds, each request with
    its own node budget; the catch-up K/V stays the recompute's."""
    head = confident_head(tiny_llama_dir)
    drafter = PagedDrafter.maybe(head, num_blocks=32, block_size=BS, max_rows=4, max_position=512)
    torch.manual_seed(4)
    lens = [40, 23, 31]
    feats = [torch.randn(n, 64) for n in lens]
    toks = [torch.randint(0, 49152, (n,)) for n in lens]
    owned = [[7, 2, 30], [0, 5], [11, 12]]
    done = [0, 0, 0]
    for ns in ([17, 15, 16], [3, 1, 15]):  # request 2's second round ends on its block's last position
        starts = list(done)
        tables = [list(o[: -(-(s + n) // BS)]) for o, s, n in zip(owned, starts, ns)]
        got, parents = drafter.propose(
            tables,
            starts,
            [toks[i][s : s + n].tolist() for i, (s, n) in enumerate(zip(starts, ns))],
            [feats[i][s : s + n] for i, (s, n) in enumerate(zip(starts, ns))],
            max(budgets),
            tree=(width, depth, budgets),
        )
        for i, n in enumerate(ns):
            done[i] += n
            want = reference_tree(head, feats[i][: done[i]], toks[i][: done[i]], depth, width, budgets[i])
            assert (got[i], parents[i]) == want, i
            assert len(got[i]) == budgets[i] and all(p < j for j, p in enumerate(parents[i]))
            with torch.no_grad():
                _, kf, _ = head(feats[i][None, : done[i]], toks[i][None, : done[i]], return_kv=True)
            pos = torch.arange(done[i])
            blocks = torch.tensor(tables[i])[pos // BS]
            torch.testing.assert_close(drafter.k[blocks, pos % BS].transpose(0, 1), kf[0], atol=1e-5, rtol=1e-5)
