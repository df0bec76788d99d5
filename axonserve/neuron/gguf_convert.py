"""Convert a llama-family GGUF file into an HF-style directory (config, safetensors, tokenizer).

Our own reader (gguf.GGUFReader + gguf.quants.dequantize) instead of transformers' GGUF path:
it is much faster (docs/benchmarks.md#fig-neuron-gguf), and the result is a plain directory
every loader understands.
Weights are stored dequantized in float32, so they equal transformers' dequantized reference.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Iterator

import numpy as np
import structlog

log = structlog.get_logger()

CONVERTER_VERSION = 2  # 2: config.json declares the GGUF's precision (torch_dtype)
SUPPORTED_GGUF_ARCHS = ("llama",)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(gguf_name: str) -> str | None:
    """HF checkpoint name for a GGUF tensor name; None for tensors we do not load."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLK.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of Q/K (interleaved -> half-split RoPE)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _is_f32(t: Any) -> bool:
    from gguf import GGMLQuantizationType

    return t.tensor_type == GGMLQuantizationType.F32


def build_config(reader: Any) -> dict[str, Any]:
    """LlamaConfig-compatible config.json contents from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {list(SUPPORTED_GGUF_ARCHS)}")
    p = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    hidden = int(p("embedding_length"))
    heads = int(p("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = p("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(p("feed_forward_length")),
        "num_hidden_layers": int(p("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(p("attention.head_count_kv", heads)),
        "head_dim": int(p("attention.key_length", hidden // heads)),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(p("context_length", 2048)),
        "rms_norm_eps": float(p("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(p("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        # what `--dtype auto` reads: a GGUF of 16-bit or quantized weights is a reduced-precision
        # checkpoint (its converted tensors are float32 only because dequantization writes them so)
        "torch_dtype": "float32" if all(_is_f32(t) for t in reader.tensors) else "bfloat16",
    }
    for key, name in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        v = _field(reader, f"tokenizer.ggml.{name}")
        if v is not None:
            cfg[key] = int(v)
    if "rope_freqs.weight" in names:
        log.warning("gguf.rope_freqs_ignored", why="llama3-style rope_freqs tensor present but not mapped")
    return cfg


def iter_tensors(reader: Any, cfg: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(hf_name, float32 array) for every mapped tensor, Q/K rows un-permuted."""
    from gguf.quants import dequantize

    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if ".q_proj." in name:
            w = unpermute_qk(w, heads)
        elif ".k_proj." in name:
            w = unpermute_qk(w, kv_heads)
        w = np.ascontiguousarray(w)
        yield name, (w if w.flags.writeable else w.copy())  # F32 tensors are read-only memmaps


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer into out_dir."""
    import gguf
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    reader = gguf.GGUFReader(gguf_path)
    cfg = build_config(reader)
    tensors = {name: torch.from_numpy(w) for name, w in iter_tensors(reader, cfg)}
    t1 = time.perf_counter()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    t2 = time.perf_counter()
    if "tokenizer.ggml.tokens" in reader.fields:
        _save_tokenizer(gguf_path, out_dir, _field(reader, "tokenizer.chat_template"))
    else:
        log.warning("gguf.no_tokenizer", src=gguf_path, why="no tokenizer.ggml.* metadata: token ids only")
    log.info(
        "gguf.converted",
        src=gguf_path,
        tensors=len(tensors),
        dequant_s=round(t1 - t0, 2),
        write_s=round(t2 - t1, 2),
        tokenizer_s=round(time.perf_counter() - t2, 2),
    )


def _save_tokenizer(gguf_path: str, out_dir: str, chat_template: str | None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    if chat_template and not getattr(tok, "chat_template", None):
        tok.chat_template = chat_template
    tok.save_pretrained(out_dir)
