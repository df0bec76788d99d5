"""BERT encoder (BertModel) for the embed task, in plain PyTorch over a flat token batch.

Every sequence of a step is a whole prompt: attention is bidirectional within each sequence
and nothing is cached, so there is no KV cache and no chunking. Post-LN layers, absolute
position and token-type embeddings (segment 0), GELU. `pool` turns each sequence's hidden
states into one vector as the model's sentence-transformers config says (see pooling.py).
Linear layers are the tensor-parallel ones, so TP ranks split heads and MLP columns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from axonserve.neuron.config import ModelConfig
from axonserve.neuron.layers.embedding import VocabParallelEmbedding
from axonserve.neuron.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from axonserve.neuron.pooling import PoolingConfig, pool

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass
class EncoderBatch:
    """Layout of B whole sequences in the flat batch, built once per step for all layers.

    Attention runs on a padded [B, L] view: flat token j of sequence i sits at padded row
    i * L + j (`pad_rows`), padded keys are masked. When every sequence has the same length
    the flat batch already is that view: no index, no mask."""

    seq_lens: list[int]
    max_len: int
    positions: torch.Tensor  # [T] long: 0.. within each sequence
    pad_rows: torch.Tensor | None = None  # [T] long
    mask: torch.Tensor | None = None  # [B, 1, 1, L] bool, True = real key

    @classmethod
    def build(cls, seq_lens: list[int]) -> EncoderBatch:
        lens = np.asarray(seq_lens, dtype=np.int64)
        starts = np.cumsum(lens) - lens
        offs = np.arange(int(lens.sum())) - np.repeat(starts, lens)  # position within its sequence
        b = cls(list(seq_lens), int(lens.max()), torch.from_numpy(offs))
        if (lens != b.max_len).any():
            b.pad_rows = torch.from_numpy(np.repeat(np.arange(len(lens)) * b.max_len, lens) + offs)
            b.mask = torch.from_numpy(np.arange(b.max_len)[None, :] < lens[:, None])[:, None, None, :]
        return b


def encoder_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: EncoderBatch, scale: float
) -> torch.Tensor:
    """Bidirectional attention within each sequence. q, k, v: [T, heads, D] -> [T, heads, D]."""
    nb, nl, (_, h, d) = len(batch.seq_lens), batch.max_len, q.shape

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, h, d] -> [B, h, L, d]
        if batch.pad_rows is not None:
            x = x.new_zeros(nb * nl, h, d).index_copy_(0, batch.pad_rows, x)
        return x.view(nb, nl, h, d).transpose(1, 2)

    o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=batch.mask, scale=scale)
    o = o.transpose(1, 2).reshape(nb * nl, h, d)
    return o if batch.pad_rows is None else o.index_select(0, batch.pad_rows)


def _layer_norm(cfg: ModelConfig, dtype: torch.dtype) -> nn.LayerNorm:
    ln = nn.LayerNorm(cfg.hidden_size, eps=float(cfg.raw.get("layer_norm_eps", 1e-12)), dtype=dtype)
    ln.requires_grad_(False)
    return ln


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, raw = cfg.hidden_size, cfg.raw
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, h, dtype)
        self.position_embeddings = nn.Embedding(int(raw.get("max_position_embeddings", 512)), h, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(int(raw.get("type_vocab_size", 2)), h, dtype=dtype)
        self.LayerNorm = _layer_norm(cfg, dtype)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])  # one segment: type id 0


class BertSelfOutput(nn.Module):
    """Projection + residual + post-LayerNorm (HF's BertSelfOutput / BertOutput)."""

    def __init__(self, cfg: ModelConfig, in_features: int, dtype: torch.dtype):
        super().__init__()
        self.dense = RowParallelLinear(in_features, cfg.hidden_size, True, dtype)
        self.LayerNorm = _layer_norm(cfg, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_heads, True, dtype)
        self.output = BertSelfOutput(cfg, cfg.num_heads * cfg.head_dim, dtype)
        self.num_heads, self.head_dim = self.qkv_proj.num_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v = self.qkv_proj(x).view(t, 3 * h, d).split(h, dim=1)
        o = encoder_attention(q, k, v, batch, self.scale)
        return self.output(o.reshape(t, h * d), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.dense = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, dtype)
        act = cfg.raw.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"BERT hidden_act {act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.attention = BertAttention(cfg, dtype)
        self.intermediate = BertIntermediate(cfg, dtype)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size, dtype)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, dtype) for _ in range(cfg.num_layers))


class BertModel(nn.Module):
    """Encoder-only: `forward` gives the last hidden states, `pool` one vector per sequence."""

    is_pooling_model = True
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    stacked: ClassVar[dict[str, tuple[str, str]]] = {
        ".attention.self.query.": (".attention.qkv_proj.", "q"),
        ".attention.self.key.": (".attention.qkv_proj.", "k"),
        ".attention.self.value.": (".attention.qkv_proj.", "v"),
    }
    # checkpoint tensors we do not use: BERT's tanh pooler and MLM/NSP heads (sentence
    # embeddings pool the last hidden states), the position-id buffer
    skipped = ("pooler.", "cls.", "embeddings.position_ids")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        pos_type = cfg.raw.get("position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ValueError(f"BERT position_embedding_type {pos_type!r} is not supported (only absolute)")
        self.config = cfg
        self.max_positions = int(cfg.raw.get("max_position_embeddings", 512))
        self.pooling = PoolingConfig.from_dir(cfg.path, default_type="cls")  # vLLM's BERT default
        self.embeddings = BertEmbeddings(cfg, dtype)
        self.encoder = BertEncoder(cfg, dtype)

    def forward(self, input_ids: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        """Last hidden states [T, H] of B whole sequences laid out as `batch` says."""
        x = self.embeddings(input_ids, batch.positions)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def pool(self, hidden: torch.Tensor, seq_lens: list[int], normalize: list[bool | None]) -> torch.Tensor:
        """[B, H] float32, one vector per sequence; normalize[i] None: the model's default."""
        p = self.pooling
        return pool(hidden, seq_lens, p.pooling_type, [p.normalize if n is None else n for n in normalize])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF BertModel names, optionally under `bert.`) into ours."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            name = name.removeprefix("bert.")
            if name.startswith(self.skipped):
                continue
            shard = None
            for frag, (fused, shard_id) in self.stacked.items():
                if frag in name:
                    name, shard = name.replace(frag, fused), shard_id
                    break
            if name not in params:
                raise KeyError(f"checkpoint tensor {name} has no parameter in {type(self).__name__}")
            p = params[name]
            getattr(p, "weight_loader", default_weight_loader)(p, w.to(p.dtype), shard)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        return loaded
