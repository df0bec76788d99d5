"""FP8: vLLM's `--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2`, `--quantization fp8` and FP8 checkpoints.

All three store 8-bit float codes times a float32 scale, as the int8 formats do, and dequantize
where the values are read (csrc/cpu_kernels.cpp converts the codes in registers by bit shifts):
- KV cache: one scale per (token, KV head) row, s = max|x| / the format's largest finite value
  (e4m3: 448, 3 mantissa bits; e5m2: 57344, 2 bits), codes x / s rounded to nearest even. Half
  the bytes of a bf16 cache, like int8; e4m3 keeps more precision, e5m2 more range.
- Weights: float8_e4m3fn codes with one scale per output row, quantized after tensor-parallel
  sharding (layers/quant.py QuantizedWeight). Up to 256 rows (decode batches, short chunks) the
  matmul streams the 1-byte codes (native `skinny_fp8`); larger ones dequantize the weight and run
  torch's matmul.
- Checkpoints already in FP8 (config.json `quantization_config.quant_method == "fp8"`, the layout
  llm-compressor / vLLM write: `*.weight` float8_e4m3fn with `*.weight_scale` per tensor or per
  output channel, or `*.weight_scale_inv` per [128, 128] block): the codes are dequantized as they
  stream in (so fused q/k/v and gate/up with different per-tensor scales need nothing special) and
  the model is quantized again per output row (`--quantization fp8` implied). Per-channel scales of
  max|w| / 448 give back the checkpoint's codes exactly; per-tensor and block scales cost one more
  rounding. Static activation scales (`input_scale`) are read and ignored: we run weight-only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import structlog
import torch

log = structlog.get_logger()

KV_CODE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
WEIGHT_DTYPE = torch.float8_e4m3fn


def kv_code_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The code dtype of an FP8 KV cache setting, None for any other."""
    return KV_CODE_DTYPES.get(kv_cache_dtype)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, min_scale: float = 1e-30) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] rows -> (codes [..., D] in `dtype`, float32 scales [...]): s = max|x| / fmax (at
    least min_scale), codes x / s clamped to +-fmax; the native rotary_kv_write computes the same bits."""
    fmax = FP8_MAX[dtype]
    xf = x.float()
    s = (xf.abs().amax(-1) / fmax).clamp_min(min_scale)
    return (xf / s[..., None]).clamp(-fmax, fmax).to(dtype), s


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as uint8 (same bytes) for the copies torch has no FP8 kernel for (index_copy_)."""
    return t.view(torch.uint8) if t.dtype in FP8_MAX else t


# ------------------------------------------------------------------ weights


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8_e4m3fn codes [N, K], float32 scales [N]), one scale per output row."""
    codes, s = quantize_rows(w, WEIGHT_DTYPE, min_scale=1e-12)
    return codes.contiguous(), s.contiguous()


def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes x their row's scale, rounded once to `dtype` (what the large-batch path multiplies)."""
    return (codes.float() * scales[:, None]).to(dtype)


def matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x @ (codes * scales[:, None])^T: the native kernel (skinny up to FP8_SKINNY_ROWS = 256 rows,
    else dequantized), or the same dequantized matmul in torch where it is not built."""
    from axonserve.neuron.ops import native

    k = native.for_dtype(x.dtype)
    if k is not None and hasattr(k, "fp8_linear") and x.dim() == 2:
        return k.fp8_linear(x.contiguous(), codes, scales)
    return torch.nn.functional.linear(x, dequantize_weight(codes, scales, x.dtype))


# ------------------------------------------------------------------ FP8 checkpoints


def checkpoint_weights(
    weights: Iterable[tuple[str, torch.Tensor]], qcfg: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every FP8 weight dequantized to float32 (code x its scale).
    A weight and its scale may come in either order: whichever comes first waits for the other."""
    block = qcfg.get("weight_block_size")
    codes: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    for name, t in weights:
        if name.endswith((".input_scale", ".k_scale", ".v_scale", ".kv_scale")):
            ignored.append(name)  # static activation / KV scales: weight-only here
            continue
        for suffix in (".weight_scale_inv", ".weight_scale"):
            if name.endswith(suffix):
                key = name[: -len(suffix)] + ".weight"
                if key in codes:
                    yield key, _dequantize(key, codes.pop(key), t, block)
                else:
                    scales[key] = t
                break
        else:
            if t.dtype in FP8_MAX:
                if name in scales:
                    yield name, _dequantize(name, t, scales.pop(name), block)
                else:
                    codes[name] = t
            else:
                yield name, t
    if codes or scales:
        unmatched = sorted({*codes, *scales})[:4]
        raise ValueError(f"FP8 checkpoint: weights without scales or scales without weights: {unmatched}")
    if ignored:
        log.info("fp8.checkpoint_scales_ignored", count=len(ignored), first=ignored[0], reason="weight-only FP8")


def _dequantize(name: str, codes: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    """Per-tensor ([] / [1]), per-output-channel ([N] / [N, 1]) or per-block ([ceil(N/bn), ceil(K/bk)]) scales."""
    if codes.dim() != 2:
        raise ValueError(f"FP8 checkpoint tensor {name}: expected a 2-D weight, got shape {tuple(codes.shape)}")
    n, k = codes.shape
    w, s = codes.float(), scale.float()
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == n and (s.dim() == 1 or s.shape[-1] == 1):
        return w * s.reshape(n, 1)
    if block is not None and len(block) == 2:
        bn, bk = int(block[0]), int(block[1])
        if s.dim() == 2 and s.shape == (-(-n // bn), -(-k // bk)):
            return w * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    raise ValueError(
        f"FP8 checkpoint tensor {name}: scale of shape {tuple(s.shape)} fits neither per-tensor, "
        f"per-channel nor weight_block_size {block} for a weight of shape {(n, k)}"
    )
