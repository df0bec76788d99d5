"""What the ranks are started with, and what vLLM is told about their KV cache.

vLLM sizes the KV pool itself: it asks for one KV spec per layer and the bytes available per
worker, divides, and hands back `num_blocks` in `initialize_from_config`. So the spec here is
computed from axonserve's own `ModelConfig` (the numbers its runner allocates with: per-rank
KV heads under tensor parallelism, our dtype), and the ranks are started only then, with
exactly vLLM's block count (`EngineConfig.num_kv_blocks`): one allocation, equal on both sides.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from axonserve.config import EngineConfig
from axonserve.frontends.vllm_plugin.version import check_vllm_version
from axonserve.neuron.config import ModelConfig

check_vllm_version()

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheSpec

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
KV_LAYOUT = "LBNHC"  # per layer [blocks, block tokens, heads, head dim], K and V apart
DEFAULT_KV_FRACTION = 0.1  # of MemAvailable, axonserve's own default, when vLLM sets no size


def check_supported(vc: VllmConfig) -> None:
    """Features whose work vLLM would leave to its own workers, which this bridge replaces."""
    pc = vc.parallel_config
    blockers = {
        "speculative decoding": vc.speculative_config is not None,
        "LoRA": vc.lora_config is not None,
        "pipeline parallelism": pc.pipeline_parallel_size > 1,
        "KV transfer connectors": vc.kv_transfer_config is not None,
        "encoder cache connectors": vc.ec_transfer_config is not None,
        "custom logits processors": bool(getattr(vc.model_config, "logits_processors", None)),
        "pooling models": vc.model_config.runner_type != "generate",
        "multimodal models": vc.model_config.is_multimodal_model,
        # the ranks' cache holds the model's dtype; vLLM's fp8 pages would be sized for another
        f"--kv-cache-dtype {vc.cache_config.cache_dtype}": vc.cache_config.cache_dtype not in ("auto", None),
    }
    bad = [what for what, on in blockers.items() if on]
    if bad:
        raise NotImplementedError(f"axonserve's vLLM executor does not support {', '.join(bad)}")


def model_dir(vc: VllmConfig) -> str:
    path = vc.model_config.model
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"axonserve's ranks load a local HF directory (config.json + safetensors); got {path!r}")
    return path


def engine_config(vc: VllmConfig, block_size: int, num_kv_blocks: int | None = None) -> EngineConfig:
    """The ranks' configuration: vLLM's model, dtype, length limit, seed and TP size."""
    mc = vc.model_config
    if mc.dtype not in DTYPES:
        raise NotImplementedError(f"axonserve's ranks run {sorted(DTYPES.values())}, not {mc.dtype}")
    return EngineConfig(
        model=model_dir(vc),
        task="generate",
        max_model_len=mc.max_model_len,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        dtype=DTYPES[mc.dtype],
        num_workers=vc.parallel_config.tensor_parallel_size,
        seed=mc.seed if mc.seed is not None else 0,
        profile_dir=vc.profiler_config.torch_profiler_dir if vc.profiler_config.profiler == "torch" else "",
    )


def block_bytes(cfg: EngineConfig) -> int:
    """One KV block on one rank, all layers (what `ModelRunner` allocates per block)."""
    mc = ModelConfig.from_dir(cfg.model)
    return cfg.block_size * mc.kv_bytes_per_token(cfg.dtype, cfg.num_workers)


def kv_cache_spec(cfg: EngineConfig) -> dict[str, KVCacheSpec]:
    """One full-attention spec per decoder layer, as one rank holds it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    mc = ModelConfig.from_dir(cfg.model)
    dtype = next(d for d, name in DTYPES.items() if name == cfg.dtype)
    spec = FullAttentionSpec(
        block_size=cfg.block_size,
        num_kv_heads=max(1, mc.num_kv_heads // cfg.num_workers),
        head_size=mc.head_dim,
        dtype=dtype,
    )
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(mc.num_layers)}


def available_kv_bytes(vc: VllmConfig, cfg: EngineConfig) -> int:
    """vLLM's explicit size (--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE) when given, else
    axonserve's default share of the memory available now."""
    explicit = vc.cache_config.kv_cache_memory_bytes
    if explicit:
        return int(explicit)
    from axonserve.neuron.model_runner import mem_available_bytes

    return int(DEFAULT_KV_FRACTION * mem_available_bytes())
