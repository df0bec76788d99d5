"""What the device layer needs from a model directory's config.json, without importing torch.

Both transformers 4 (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`) layouts are read.
Facts an architecture implies without writing them down (Qwen2's Q/K/V biases, Qwen3's q/k
norms) are set by the model classes, not here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger()

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _ids(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def checkpoint_quantization(path: str, requested: str = "") -> str:
    """The weight quantization to run a checkpoint with: an FP8 checkpoint (config.json
    `quantization_config.quant_method` "fp8", neuron/layers/fp8.py) implies "fp8" and refuses any
    other method; a checkpoint quantized any other way (GPTQ, AWQ, compressed-tensors, ...) is
    refused; an unquantized one keeps `requested`."""
    try:
        full = _read_json(os.path.join(path, "config.json"))
    except (OSError, ValueError):
        return requested  # no readable config.json: the loader reports it
    qcfg = full.get("quantization_config") or (full.get("text_config") or {}).get("quantization_config")
    if not qcfg:
        return requested
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if method != "fp8":
        raise ValueError(
            f"the checkpoint is quantized with {method!r}, which is not supported (supported: FP8 checkpoints, "
            "quant_method fp8; or an unquantized checkpoint with --quantization)"
        )
    if requested not in ("", "fp8"):
        raise ValueError(f"--quantization {requested} does not apply to an FP8 checkpoint (it is fp8 already)")
    block = qcfg.get("weight_block_size")
    if block is not None and not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(f"FP8 checkpoint: weight_block_size must be null or [rows, columns], got {block!r}")
    return "fp8"


def fp8_checkpoint_config(path: str) -> dict[str, Any] | None:
    """config.json's quantization_config when it describes an FP8 checkpoint, else None."""
    full = _read_json(os.path.join(path, "config.json"))
    qcfg = full.get("quantization_config") or (full.get("text_config") or {}).get("quantization_config")
    return qcfg if isinstance(qcfg, dict) and qcfg.get("quant_method") == "fp8" else None


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
    attention_bias: bool = False  # q/k/v/o biases (Llama's attention_bias)
    mlp_bias: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    qkv_bias: bool = False  # q/k/v biases (Qwen2 has them without an o_proj bias)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    hidden_act: str = "silu"
    # per decoder layer: its sliding window in tokens (a query at p sees keys > p - window), None: full
    layer_windows: list[int | None] = field(default_factory=list)
    # mixture of experts (Qwen3-MoE); num_experts == 0: dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # every step-th layer is sparse...
    mlp_only_layers: list[int] = field(default_factory=list)  # ...except these, which stay dense

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        full = _read_json(os.path.join(path, "config.json"))
        # vision-language models (LLaVA): the decoder's fields live in text_config; `raw` keeps all
        cfg = {**full["text_config"], "architectures": full.get("architectures")} if "text_config" in full else full
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
            raw=full,
            qkv_bias=bool(cfg.get("attention_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            layer_windows=layer_windows(cfg),
            num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []],
        )

    def is_moe_layer(self, i: int) -> bool:
        """transformers' Qwen3-MoE rule for which decoder layers hold a sparse MoE block."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def max_model_len_for(self, requested: int | None) -> int:
        """The longest sequence to serve: `requested`, else the model's maximum (sliding-window
        layers attend within their window at any length: neuron/ops/attention.py)."""
        return requested or self.max_position_embeddings

    @property
    def sliding_window(self) -> int | None:
        """The largest window of any sliding layer (None: no layer slides)."""
        return max((w for w in self.layer_windows if w), default=None)

    @property
    def kv_window(self) -> int | None:
        """The window past which a request's KV can be freed: every layer's largest window when every
        layer slides; None when any layer attends to the whole sequence."""
        ws = self.layer_windows
        return max(ws) if ws and all(ws) else None  # type: ignore[type-var]

    def kv_bytes_per_token(self, dtype: str = "float32", tp_size: int = 1, kv_cache_dtype: str = "auto") -> int:
        """K and V bytes one token occupies across all layers (on one rank); an int8 or fp8 cache
        holds a float32 scale per head beside the 1-byte codes."""
        kv_heads = max(1, self.num_kv_heads // tp_size)
        coded = kv_cache_dtype not in ("auto", "")
        per_head = self.head_dim + 4 if coded else self.head_dim * _DTYPE_BYTES[dtype]
        return 2 * self.num_layers * kv_heads * per_head


def layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window, as transformers 5 reads the config: Mistral slides on every layer
    when `sliding_window` is set; Qwen2/Qwen3(-MoE) only with `use_sliding_window` (default off),
    on the layers `layer_types` marks "sliding_attention", else on layers i >= `max_window_layers`
    (configuration_qwen2.py); a window counts the query itself (masking_utils: kv > q - window)."""
    n = int(cfg["num_hidden_layers"])
    w = cfg.get("sliding_window")
    qwen = str(cfg.get("model_type", "")).startswith("qwen")
    if not w or not cfg.get("use_sliding_window", not qwen):
        return [None] * n
    if cfg.get("layer_types"):
        return [int(w) if t == "sliding_attention" else None for t in cfg["layer_types"][:n]]
    if qwen or "max_window_layers" in cfg:
        first = int(cfg.get("max_window_layers", 28))  # (Qwen2Config's default)
        return [int(w) if i >= first else None for i in range(n)]
    return [int(w)] * n


def _arch_from_model_type(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
    }.get(model_type, model_type)
