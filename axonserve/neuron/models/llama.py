"""Llama-family decoder in plain PyTorch over a flat, paged token batch.

One implementation serves every architecture that is Llama plus switches read from ModelConfig:
Q/K/V biases (Qwen2), per-head q/k RMSNorm before RoPE (Qwen3), sparse MoE blocks on some
layers (Qwen3-MoE). Architecture classes only set what their config.json leaves unsaid
(`arch_config`) and how their checkpoint names map onto our fused parameters.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from axonserve.neuron import sequence_parallel
from axonserve.neuron.config import ModelConfig
from axonserve.neuron.layers.activation import silu_and_mul
from axonserve.neuron.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from axonserve.neuron.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from axonserve.neuron.layers.moe import SparseMoeBlock
from axonserve.neuron.layers.norm import RMSNorm
from axonserve.neuron.layers.rotary import RotaryEmbedding, apply_rotary
from axonserve.neuron.models import fused
from axonserve.neuron.ops.attention import AttentionMetadata, paged_attention

KVCache = tuple[torch.Tensor, ...]  # (K, V), or with an int8 cache (K codes, V codes, K scales, V scales)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias or cfg.attention_bias, dtype
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_bias, dtype)
        # Qwen3: RMSNorm over each head's dims (weights shared by all heads, so any head shard works)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window: int | None = None  # sliding window (set by the decoder layer; ops/window.py)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """With native kernels (meta.native) cos/sin are the whole [positions, D] tables."""
        t, d, hq, hkv = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        if self.window is not None:
            meta = meta.for_window(self.window)
        qkv = self.qkv_proj(x).view(t, hq + 2 * hkv, d)
        qk = qkv[:, : hq + hkv]  # Q and K heads are adjacent: rotate both at once
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq : hq + hkv])), dim=1)  # type: ignore[misc]
        if meta.native is not None:  # rotate in place and write K/V into the cache in one pass
            if self.q_norm is not None:
                qkv[:, : hq + hkv] = qk
            qkv = qkv.contiguous()
            meta.native.rotary_kv_write(
                qkv, hq, hkv, cos, sin, meta.positions, kv_cache[0], kv_cache[1], meta.slot_mapping, *kv_cache[2:]
            )
            o = paged_attention(
                qkv[:, :hq],
                qkv[:, hq : hq + hkv],
                qkv[:, hq + hkv :],
                kv_cache[0],
                kv_cache[1],
                meta,
                self.scale,
                False,
                *kv_cache[2:],
            )
        else:
            qk = apply_rotary(qk, cos, sin)
            o = paged_attention(
                qk[:, :hq],
                qk[:, hq:],
                qkv[:, hq + hkv :],
                kv_cache[0],
                kv_cache[1],
                meta,
                self.scale,
                True,
                *kv_cache[2:],
            )
        return self.o_proj(o.view(t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, dtype)
        self.self_attn.window = cfg.layer_windows[index] if index < len(cfg.layer_windows) else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp: nn.Module
        if cfg.is_moe_layer(index):
            self.mlp = SparseMoeBlock(
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.norm_topk_prob,
                dtype,
            )
        else:
            self.mlp = LlamaMLP(cfg, dtype)

    def forward(self, x, cos, sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        n = self.post_attention_layernorm(x, residual=h)  # h += x (the new residual), n = norm(h)
        return h + self.mlp(n)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, dtype, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, dtype
        )
        self._stack: tuple[Any, Any] | None = None  # (key of the caches it was built for, native stack or None)

    def forward(
        self,
        input_ids,
        positions,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs_embeds: the embedded batch when a caller replaced some rows (LLaVA's images)."""
        if sequence_parallel.takes(positions.shape[0]):  # a long prefill over TP ranks, tokens sharded
            return sequence_parallel.forward(self, input_ids, positions, kv_caches, meta, inputs_embeds)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if fused.takes(meta, x) and fused.enabled():
            key = fused.cache_key(kv_caches)
            if self._stack is None or self._stack[0] != key:
                self._stack = (key, fused.build(self, kv_caches, meta.native))
            if self._stack[1] is not None:
                return self._stack[1].forward(
                    x,
                    meta.positions,
                    meta.slot_mapping,
                    meta.native_block_table,
                    meta.native_row_seq,
                    meta.native_row_kv_len,
                    meta.native_row_extra,
                )
        # the native rotary kernel indexes the tables by position itself
        cos, sin = (self.rotary.cos, self.rotary.sin) if meta.native is not None else self.rotary(positions)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta)
        return self.norm(x)


# per-expert checkpoint tensors -> our fused expert parameters (see layers/moe.py)
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


class LlamaForCausalLM(nn.Module):
    arch_config: ClassVar[dict[str, Any]] = {}  # ModelConfig fields the architecture implies
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    stacked: ClassVar[dict[str, tuple[str, str | int]]] = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }
    # load_weights loads a weight's float32 twin too, and param_name maps checkpoint names (loader.fit_twins)
    fills_code_twins: ClassVar[bool] = True

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        cfg = dataclasses.replace(cfg, **self.arch_config)
        if cfg.hidden_act != "silu":
            raise ValueError(f"{cfg.architecture}: activation {cfg.hidden_act!r} is not supported; supported: silu")
        self.config = cfg
        self.model = LlamaModel(cfg, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Final-norm hidden states [T, H] for a flat token batch."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V] logits for the N sampling positions only."""
        return self.lm_head.compute(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into our (fused) parameters; returns loaded param names."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, w in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name, shard = self.param_name(name)
            if name not in params:
                raise KeyError(f"checkpoint tensor {name} has no parameter in {type(self).__name__}")
            p = params[name]
            load = getattr(p, "weight_loader", default_weight_loader)
            load(p, w.to(p.dtype), shard)
            if getattr(p, "exact", None) is not None:  # its float32 twin (loader.code_twins)
                load(p.exact, w.float(), shard)
            loaded.add(name)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        return loaded

    def param_name(self, name: str) -> tuple[str, Any]:
        """Our parameter for a checkpoint tensor name, and which shard of it the tensor fills."""
        m = _EXPERT.search(name)
        if m:
            e, proj = int(m[1]), m[2]
            if proj == "down":
                return name[: m.start()] + ".experts.down_proj", e
            return name[: m.start()] + ".experts.gate_up_proj", (e, 0 if proj == "gate" else 1)
        for frag, (target, shard_id) in self.stacked.items():
            if frag in name:
                return name.replace(frag, target), shard_id
        return name, None


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's tensors and math; its sliding window comes from ModelConfig.layer_windows."""
