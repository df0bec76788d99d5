"""Sliding-window attention: the torch paths' tables and masks for a layer with a window.

A query at position p attends to keys at positions k with p - window < k <= p (transformers'
`sliding_window_overlay`: the window counts the query itself). `AttentionMetadata.build` makes
the full-attention metadata first; a sliding layer asks it `for_window(w)`, which builds the same
step again with `window=w` and hands the result here, once per step and window:

- decode and short-chunk rows gather only the blocks from the first one any of their queries can
  see (the block table's rows start there, keys beyond the window are masked), so their cost stops
  growing with the sequence;
- prefill chunks with a context gather from that block on as well; a first chunk longer than the
  window gets an explicit causal-and-window mask instead of `is_causal`.

The blocks before that first one may already be back in the pool (engine/sliding_window.py frees
them while the request runs): no path reads them. The native kernel (csrc/cpu_kernels.cpp) gets the
window as an argument and skips those keys itself; bucketed steps (`build_static`) only mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from axonserve.neuron.ops.attention import AttentionMetadata


def first_blocks(ctx: np.ndarray, window: int, block_size: int) -> np.ndarray:
    """Per sequence, the first block any query of the step can see (its first query sits at ctx)."""
    return np.maximum(ctx - window + 1, 0) // block_size


def _trimmed(table: np.ndarray, first: np.ndarray, need: np.ndarray) -> np.ndarray:
    """Rows table[i, first[i]:need[i]], left-aligned, padded with the row's first block (masked: a
    block the request still holds, never one given back)."""
    width = int((need - first).max())
    out = np.repeat(table[np.arange(len(first)), first][:, None], width, axis=1)
    for i in range(len(first)):
        out[i, : need[i] - first[i]] = table[i, first[i] : need[i]]
    return out


def apply_window(
    meta: AttentionMetadata,
    window: int,
    q: np.ndarray,
    ctx: np.ndarray,
    table: np.ndarray,
    block_size: int,
    prefill_seqs: list[int],
    trees: bool,
) -> AttentionMetadata:
    """Restrict a step's metadata (built by AttentionMetadata.build) to a sliding window."""
    if trees:
        raise ValueError("draft trees are not supported with sliding-window attention")
    meta.window = window
    bs = block_size
    seq_lens = ctx + q
    need = (seq_lens + bs - 1) // bs
    first = first_blocks(ctx, window, bs)
    if meta.native is None:
        nd = meta.num_decodes
        if nd:
            tab = _trimmed(table[:nd], first[:nd], need[:nd])
            key = first[:nd, None] * bs + np.arange(tab.shape[1] * bs)[None, :]  # absolute key positions
            mask = (key < seq_lens[:nd, None]) & (key >= seq_lens[:nd, None] - window)
            meta.decode_block_table = torch.from_numpy(tab)
            meta.decode_mask = torch.from_numpy(mask)[:, None, None, :]
        ns, qs = meta.short
        if ns:
            sl = slice(nd, nd + ns)
            tab = _trimmed(table[sl], first[sl], need[sl])
            key = (first[sl, None] * bs + np.arange(tab.shape[1] * bs)[None, :])[:, None, :]
            qpos = ctx[sl, None, None] + np.arange(qs)[None, :, None]
            meta.short_block_table = torch.from_numpy(tab)
            meta.short_mask = torch.from_numpy((key <= qpos) & (key > qpos - window))
    for i, p in zip(prefill_seqs, meta.prefills):
        n = int(q[i])
        if p.context_len == 0:
            if n > window:
                j = torch.arange(n)
                p.mask = (j[None, :] <= j[:, None]) & (j[None, :] > j[:, None] - window)
            continue
        f, c = int(first[i]), p.context_len
        p.block_ids = torch.from_numpy(table[i, f : int(need[i])].copy())
        key = f * bs + torch.arange(int(seq_lens[i]) - f * bs)[None, :]
        qpos = c + torch.arange(n)[:, None]
        p.mask = (key <= qpos) & (key > qpos - window)
    return meta
