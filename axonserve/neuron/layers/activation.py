"""SwiGLU's SiLU(gate) * up over a fused [..., 2 * inter] gate/up projection.

Uses the native fused kernel when built (ops/native.py: one pass, transformers' rounding), else torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from axonserve.neuron.ops import native


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * inter] -> [..., inter]."""
    k = native.for_dtype(gate_up.dtype)
    if k is not None:
        flat = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
        return k.silu_and_mul(flat).view(*gate_up.shape[:-1], -1)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
