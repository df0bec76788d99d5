"""The Llama decoder stack as one native call (csrc/cpu_kernels.cpp `DecoderStack`).

A decode step of a small model on CPU spends a fixed cost per layer in the interpreter and torch's
dispatch (~15 module calls, views and allocations), a sizeable share of a 30-layer SmolLM2 step at
any batch size next to its weight streaming (docs/benchmarks.md#fig-neuron-fused). The native
stack runs the same kernels in the same order (bit-identical outputs) from C++ with the GIL
released. It takes the steps whose every row attends through the native paged-attention kernel
(decodes, verifications, chunks under NATIVE_MAX_QUERY tokens, and prefill chunks of any length
where the kernel runs them on AMX tiles: attention.takes_chunks) on dense Llama-family models on
one rank; anything else (MoE, Qwen3's per-head norms, tensor parallelism, snapshot hooks, long
prefill chunks without AMX) runs the Python modules. AXONSERVE_FUSED=0 turns it off.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from axonserve.neuron.layers.quant import INT4_GROUP, PackedWeight, PanelWeight, QuantizedWeight
from axonserve.neuron.ops.attention import AttentionMetadata
from axonserve.neuron.parallel import TPInfo

if TYPE_CHECKING:
    from axonserve.neuron.models.llama import LlamaModel

NONE = torch.empty(0)  # an absent tensor argument (the native side tests numel)
_KINDS = {"dense": 0, "packed": 1, "int8": 2, "int4": 3, "fp8": 4, "panel": 5, "dot": 6}


def enabled() -> bool:
    return os.environ.get("AXONSERVE_FUSED", "1") not in ("0", "false", "no")


def takes(meta: AttentionMetadata, x: torch.Tensor) -> bool:
    """Whether a step's rows all go through the native attention kernel (the stack's only path)."""
    return meta.native is not None and not meta.prefills and meta.native_idx is None and x.dim() == 2


def cache_key(kv_caches: list[tuple[torch.Tensor, ...]]) -> tuple[int, ...]:
    """Which caches a stack was built over: their addresses, which no other tensor can take while
    the stack holds them (a list's id could come back for another list)."""
    return (len(kv_caches), kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr()) if kv_caches else (0,)


def build(model: LlamaModel, kv_caches: list[tuple[torch.Tensor, ...]], native: Any) -> Any | None:
    """A native DecoderStack over the model's weights and these caches ((K, V) per layer, or an int8
    / fp8 cache's (K codes, V codes, K scales, V scales)), or None where the model has a part only the
    Python modules run."""
    from axonserve.neuron.models.llama import LlamaMLP

    if TPInfo.size != 1 or not hasattr(native, "DecoderStack") or len(kv_caches) != len(model.layers):
        return None
    if getattr(model, "has_lora", False):  # adapter slots on the layers (axonserve/lora): the modules run them
        return None
    first = model.layers[0].self_attn
    stack = native.DecoderStack(
        first.num_heads,
        first.num_kv_heads,
        first.head_dim,
        model.norm.eps,
        first.scale,
        model.norm.weight,
        model.rotary.cos,
        model.rotary.sin,
    )
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (
            not isinstance(mlp, LlamaMLP)
            or attn.q_norm is not None
            or layer._forward_hooks
            or layer.input_layernorm.eps != model.norm.eps
            or layer.post_attention_layernorm.eps != model.norm.eps
        ):
            return None
        parts = [
            linear_spec(m.weight, m.bias, m.qweight)
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ]
        if not add_layer(stack, layer.input_layernorm.weight, layer.post_attention_layernorm.weight, parts):
            return None
    k, v, *scales = (list(c) for c in zip(*kv_caches))
    stack.set_caches(k, v, *(scales or ([], [])))
    windows = [layer.self_attn.window or 0 for layer in model.layers]
    if any(windows):  # sliding-window layers (ops/window.py)
        stack.set_windows(windows)
    return stack


T = torch.Tensor
LinearSpec = tuple[int, T, T, T, int, int, T, T, T]
NO_CODES = (NONE, NONE)


def linear_spec(weight: torch.Tensor | None, bias: torch.Tensor | None, q: Any = None) -> LinearSpec | None:
    """(kind, weight, aux, bias, skinny rows, int4 group, skinny scales, codes, code scales) as the
    native StackLinear takes them; None for a format it does not know. An int8 weight with
    an AMX copy is "packed": that copy (and its scales) up to its rows, the dequantized oneDNN copy
    above. A bf16 one with block codes (PackedWeight.codes) runs them for steps of up to code_rows() rows."""
    b = bias.detach() if bias is not None else NONE
    if q is None:
        return (_KINDS["dense"], weight.detach(), NONE, b, 0, 0, NONE, *NO_CODES) if weight is not None else None
    if isinstance(q, PackedWeight):
        if not q.onednn:  # kept dense (a CPU without oneDNN bf16)
            return _KINDS["dense"], q.data, NONE, b, 0, 0, NONE, *NO_CODES
        codes = (q.codes, q.code_scales) if q.codes is not None else NO_CODES
        return _KINDS["packed"], q.data, q.skinny if q.skinny is not None else NONE, b, q.skinny_rows, 0, NONE, *codes
    if isinstance(q, PanelWeight):  # (block codes: d in aux, m in scales)
        if q.int8_activations:
            return _KINDS["dot"], q.data, q.d, b, 0, 0, q.m, *NO_CODES
        d, m = (q.d, q.m) if q.d is not None else (NONE, NONE)
        return _KINDS["panel"], q.data, d, b, 0, 0, m, *NO_CODES
    if isinstance(q, QuantizedWeight):
        if q.skinny is not None:
            return _KINDS["packed"], q.data, q.skinny, b, q.skinny_rows, 0, q.skinny_scales, *NO_CODES
        return _KINDS[q.method], q.data, q.scales, b, 0, INT4_GROUP, NONE, *NO_CODES
    return None


def add_layer(stack: Any, in_norm: torch.Tensor, post_norm: torch.Tensor, parts: list[LinearSpec | None]) -> bool:
    """Append a layer with linears (qkv, o, gate_up, down); False (nothing added) if one has no spec."""
    if any(p is None for p in parts):
        return False
    columns = [list(c) for c in zip(*parts)]  # type: ignore[arg-type]
    stack.add_layer(in_norm.detach(), post_norm.detach(), *columns)
    return True
