"""RMSNorm with transformers' rounding: normalise in float32, cast back, then scale by the weight.

Uses the native fused kernel when built (ops/native.py), else torch's fused rms_norm (same float32 math)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axonserve.neuron.ops import native


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """norm(x) * weight; with `residual`: residual += x in place (rounded to its dtype), then
    norm(residual) -- one fused pass with the native kernels, which the decoder's residual adds use.
    Not differentiable on the native path (inference only)."""
    k = native.for_dtype(x.dtype) if x.dim() == 2 and x.is_contiguous() else None
    if k is not None:
        out = torch.empty_like(x)
        k.rms_norm(out, x, residual, weight, eps)
        return out
    if residual is not None:
        x = residual.add_(x)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
