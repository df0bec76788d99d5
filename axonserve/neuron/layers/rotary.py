"""Rotary position embedding (half-split layout), default and llama3 frequency scaling.

cos/sin are tabulated once for every position up to max_position; per step they are
gathered by position once and shared by all layers. The table is computed with the same
float32 operations as transformers, so values are bit-identical.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling or {})
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    raise ValueError(f"rope type {rope_type!r} is not supported; supported: default, linear, llama3")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None, dtype: torch.dtype
    ):
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        half = head_dim // 2
        sin[:, :half] = -sin[:, :half]  # sign of rotate_half folded in: rotate_half(x) * sin == roll(x) * sin_signed
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin, shape [T, 1, head_dim] for broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; sin comes signed from RotaryEmbedding (4 ops instead of 7)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
