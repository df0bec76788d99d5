"""What the device layer needs from a model directory's config.json, without importing torch.

Both transformers 4 (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`) layouts are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _ids(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


@dataclass
class ModelConfig:
    path: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None: plain RoPE; else incl. "rope_type"
    tie_word_embeddings: bool
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        cfg = _read_json(os.path.join(path, "config.json"))
        gen_path = os.path.join(path, "generation_config.json")
        gen = _read_json(gen_path) if os.path.exists(gen_path) else {}
        archs = cfg.get("architectures") or []
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if not rope and cfg.get("rope_scaling"):
            rope = dict(cfg["rope_scaling"])
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        eos = list(dict.fromkeys(_ids(cfg.get("eos_token_id")) + _ids(gen.get("eos_token_id"))))
        return cls(
            path=path,
            architecture=archs[0] if archs else _arch_from_model_type(cfg.get("model_type", "")),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            raw=cfg,
        )

    def kv_bytes_per_token(self, dtype: str = "float32", tp_size: int = 1) -> int:
        """K and V bytes one token occupies across all layers (on one rank)."""
        kv_heads = max(1, self.num_kv_heads // tp_size)
        return 2 * self.num_layers * kv_heads * self.head_dim * _DTYPE_BYTES[dtype]


def _arch_from_model_type(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}.get(model_type, model_type)
