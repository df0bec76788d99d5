"""Qwen2, Qwen3 and Qwen3-MoE: the Llama-family decoder with the switches their configs imply."""

from __future__ import annotations

from typing import Any, ClassVar

from axonserve.neuron.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Biases on q/k/v (not on o_proj); config.json does not say so."""

    arch_config: ClassVar[dict[str, Any]] = {"qkv_bias": True, "attention_bias": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Per-head RMSNorm on q and k before RoPE; biases only if config.json's attention_bias."""

    arch_config: ClassVar[dict[str, Any]] = {"qk_norm": True}


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 with sparse MoE blocks (ModelConfig.is_moe_layer picks the layers)."""
