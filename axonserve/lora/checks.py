"""Start-up checks of the LoRA settings of an EngineConfig (no torch: the launcher runs them).

What the LoRA path does not run is refused here, at start-up, rather than failing steps later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from axonserve.config import EngineConfig

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values
MAX_LORAS_LIMIT = 64  # adapter slots per rank (each holds a padded copy of every LoRA layer)


def check_engine_config(cfg: EngineConfig) -> None:
    """Raise ValueError for LoRA settings that are invalid or that the engine cannot serve."""
    for name, low in (("max_loras", 1), ("max_lora_rank", 1), ("max_cpu_loras", 0)):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    if cfg.max_loras > MAX_LORAS_LIMIT:
        raise ValueError(f"max_loras must be <= {MAX_LORAS_LIMIT}, got {cfg.max_loras}")
    if cfg.max_lora_rank not in MAX_LORA_RANKS:
        raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}, got {cfg.max_lora_rank}")
    if cfg.max_cpu_loras and cfg.max_cpu_loras < cfg.max_loras:
        raise ValueError(f"max_cpu_loras ({cfg.max_cpu_loras}) must be >= max_loras ({cfg.max_loras}) or 0")
    if not cfg.enable_lora:
        if cfg.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        if cfg.allow_runtime_lora_updating:
            raise ValueError("runtime LoRA updating needs --enable-lora")
        return
    clash = [
        name
        for name, on in (
            ("--device xla", cfg.device == "xla"),
            ("bucketing", cfg.bucketing),
            ("speculative decoding", cfg.speculative is not None),
            ("prefill/decode disaggregation", cfg.role != "both"),
            ("expert parallelism", cfg.enable_expert_parallel),
            ("weight quantization", bool(cfg.quantization)),
            ("sequence parallelism", cfg.sequence_parallel),
            ("the embed task", cfg.task == "embed"),
            ("encoder workers", cfg.encoder_workers > 0),
        )
        if on
    ]
    if clash:
        raise ValueError(f"LoRA adapters (--enable-lora) are not supported with {clash[0]}")
