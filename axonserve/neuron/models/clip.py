"""CLIP vision transformer (the LLaVA vision tower) in plain PyTorch.

Only what LLaVA reads is computed: the hidden states of the layers up to the deepest
`vision_feature_layer`; the post-layernorm (pooled output only) is loaded but unused.
Images are whole and few per step, so this runs as one dense batch, no paging.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    try:
        return _ACTS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(_ACTS)}") from None


class CLIPEmbeddings(nn.Module):
    def __init__(self, hidden: int, channels: int, image_size: int, patch: int, dtype: torch.dtype):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(hidden, dtype=dtype))
        self.patch_embedding = nn.Conv2d(channels, hidden, patch, stride=patch, bias=False, dtype=dtype)
        self.num_positions = (image_size // patch) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, hidden, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.k_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.v_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.out_proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        o = F.scaled_dot_product_attention(q, k, v)  # bidirectional: every patch sees every patch
        return self.out_proj(o.transpose(1, 2).reshape(b, t, -1))


class CLIPMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str, dtype: torch.dtype):
        super().__init__()
        self.act = activation(act)
        self.fc1 = nn.Linear(hidden, inter, dtype=dtype)
        self.fc2 = nn.Linear(inter, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, c: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        h, eps = c["hidden_size"], c.get("layer_norm_eps", 1e-5)
        self.layer_norm1 = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.self_attn = CLIPAttention(h, c["num_attention_heads"], dtype)
        self.layer_norm2 = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.mlp = CLIPMLP(h, c["intermediate_size"], c.get("hidden_act", "quick_gelu"), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, c: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(c, dtype) for _ in range(c["num_hidden_layers"]))


class CLIPVisionTower(nn.Module):
    """Checkpoint names as transformers' `CLIPVisionModel.vision_model` (LLaVA's `vision_tower`)."""

    def __init__(self, c: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        if c.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"vision tower {c.get('model_type')!r} is not supported; supported: clip_vision_model")
        h = c["hidden_size"]
        self.image_size, self.patch_size = c["image_size"], c["patch_size"]
        self.embeddings = CLIPEmbeddings(h, c.get("num_channels", 3), self.image_size, self.patch_size, dtype)
        self.pre_layrnorm = nn.LayerNorm(h, eps=c.get("layer_norm_eps", 1e-5), dtype=dtype)
        self.encoder = CLIPEncoder(c, dtype)
        self.post_layernorm = nn.LayerNorm(h, eps=c.get("layer_norm_eps", 1e-5), dtype=dtype)

    @property
    def num_layers(self) -> int:
        return len(self.encoder.layers)

    def hidden_states(self, pixels: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """transformers' `hidden_states[i]` for each i in `layers` (0: the embeddings,
        negative: from the end), running no layer deeper than needed."""
        n = self.num_layers
        want = [i % (n + 1) for i in layers]
        x = self.pre_layrnorm(self.embeddings(pixels))
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers[: max(want)], start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in want]
