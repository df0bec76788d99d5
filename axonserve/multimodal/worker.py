"""Worker side of multimodal prompts: image features per request, merged into the batch.

A request's `MultiModalInput` arrives with its first plan (again after a preemption) holding
either the features (an encoder actor made them) or the pixels, which are encoded here, in
process, through a small cache keyed by image hash. Each step then only looks up which rows
of the flat batch are placeholder positions of the chunk being computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from axonserve.protocol import tensor_from_frame
from axonserve.protocol.messages import MultiModalInput


@dataclass
class RequestImages:
    positions: torch.Tensor  # [K] prompt positions of the placeholder tokens, ascending
    embeds: torch.Tensor  # [K, hidden] the features those positions take


def placeholder_positions(mm: MultiModalInput) -> torch.Tensor:
    return (
        torch.cat([torch.arange(o, o + n) for o, n in zip(mm.offsets, mm.lengths)])
        if mm.offsets
        else torch.empty(0, dtype=torch.long)
    )


class ImageEncoderCache:
    """Features by image hash (LRU within a byte budget), so a repeated image is encoded once
    per worker."""

    def __init__(self, model: Any, dtype: torch.dtype, capacity_bytes: int = 256 * 2**20):
        self.model, self.dtype, self.capacity = model, dtype, capacity_bytes
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.size = self.hits = self.encoded = 0

    def encode(self, hashes: list[str], pixels: torch.Tensor) -> torch.Tensor:
        """[images, tokens, hidden] for the images, encoding only the ones not cached."""
        first = {h: i for i, h in reversed(list(enumerate(hashes)))}  # an image twice: encoded once
        miss = [i for h, i in first.items() if h not in self.cache]
        if miss:
            feats = self.model.encode_images(pixels[miss].to(self.dtype))
            for i, f in zip(miss, feats):
                self.cache[hashes[i]] = f
                self.size += f.nbytes
            self.encoded += len(miss)
        self.hits += len(hashes) - len(miss)
        out = []
        for h in hashes:
            self.cache.move_to_end(h)
            out.append(self.cache[h])
        while self.size > self.capacity and self.cache:
            self.size -= self.cache.popitem(last=False)[1].nbytes
        return torch.stack(out)

    def request_images(self, mm: MultiModalInput, frames: Sequence[Any]) -> RequestImages:
        """The request's placeholder positions and their features (from the frames, or encoded)."""
        pos = placeholder_positions(mm)
        if mm.embeddings is not None:
            embeds = tensor_from_frame(mm.embeddings, frames).to(self.dtype)
        elif mm.pixel_values is not None:
            embeds = self.encode(mm.hashes, tensor_from_frame(mm.pixel_values, frames)).flatten(0, 1)
        else:
            raise ValueError("multimodal input carries neither pixels nor features")
        if embeds.shape[0] != pos.numel():
            raise ValueError(f"{pos.numel()} image placeholder tokens but features for {embeds.shape[0]}")
        return RequestImages(pos, embeds)


def batch_rows(chunks: list[tuple[RequestImages | None, int, int, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows of the flat batch that take image features, and those features, for chunks
    (images, first position computed, tokens, the chunk's first row); None when none do."""
    rows, embeds = [], []
    for images, c, n, row0 in chunks:
        if images is None:
            continue
        sel = (images.positions >= c) & (images.positions < c + n)
        if bool(sel.any()):
            rows.append(images.positions[sel] - c + row0)
            embeds.append(images.embeds[sel])
    if not rows:
        return None
    return torch.cat(rows), torch.cat(embeds)
