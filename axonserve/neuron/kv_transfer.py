"""Prefill/decode disaggregation, worker side: a request's prompt KV out of and into the
paged cache, one frame per block ([layers, 2 (K, V), block_size, kv_heads, head_dim]).

Export reads the prefill worker's blocks right after the step that computed the prompt (the
step that samples the first token); import writes the decode worker's freshly allocated
blocks before the request's first forward there. Slots are addressed by position, so the
two sides may use different block sizes and block ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from axonserve.protocol import tensor_from_frame, tensor_ref
from axonserve.protocol.messages import KVBlocks

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def export_kv(
    caches: KVCaches, block_ids: list[int], block_size: int, num_tokens: int, request_id: str, frames: list[Any]
) -> KVBlocks:
    """The first `num_tokens` positions' K/V, appended to `frames` block by block."""
    refs = []
    for bid in block_ids[: -(-num_tokens // block_size)]:
        block = torch.stack([torch.stack((k[bid], v[bid])) for k, v in caches])
        frames.append(block)
        refs.append(tensor_ref(len(frames), block))
    return KVBlocks(num_tokens, refs, request_id)


def import_kv(caches: KVCaches, block_ids: list[int], block_size: int, kv: KVBlocks, frames: Sequence[Any]) -> None:
    """Write the transferred K/V of positions 0..num_tokens-1 into this request's blocks."""
    n = kv.num_tokens
    if n > len(block_ids) * block_size:
        raise ValueError(f"{n} KV positions do not fit {len(block_ids)} blocks of {block_size}")
    blocks = [tensor_from_frame(ref, frames) for ref in kv.blocks]
    if not blocks:
        return
    src = torch.cat(blocks, dim=2)[:, :, :n]  # [layers, 2, n, kv_heads, head_dim]
    if src.shape[0] != len(caches) or src.shape[2] != n or src.shape[3:] != caches[0][0].shape[2:]:
        raise ValueError(f"transferred KV of shape {tuple(src.shape)} does not match this model's cache")
    pos = torch.arange(n)
    slots = torch.tensor(block_ids)[pos // block_size] * block_size + pos % block_size
    for (k, v), layer in zip(caches, src):
        k.view(-1, *k.shape[2:]).index_copy_(0, slots, layer[0].to(k.dtype))
        v.view(-1, *v.shape[2:]).index_copy_(0, slots, layer[1].to(v.dtype))
