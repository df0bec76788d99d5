"""Linear layers that know how they would be sharded across tensor-parallel ranks.

Column-parallel layers split output rows, row-parallel layers split input columns and
all-reduce their output. Each parameter carries a `weight_loader` that narrows the full
checkpoint tensor to this rank's shard, so checkpoint loading is the same for any TP size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from axonserve.neuron.parallel import TPInfo, tp_reduce

if TYPE_CHECKING:
    from axonserve.lora.layers import LoraSlots
    from axonserve.neuron.layers.quant import QuantizedWeight


def linear(
    x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None = None, q: QuantizedWeight | None = None
) -> torch.Tensor:
    """F.linear, except a single bf16 row goes through mv: CPU bf16 gemm reads weights at ~half
    the bandwidth of gemv there, and a 1-token decode step is pure weight bandwidth. With a
    quantized weight `q` (layers/quant.py) its packed kernel runs instead."""
    if q is not None:
        y = q.matmul(x)
        return y if b is None else y + b
    if x.shape[0] == 1 and x.dim() == 2 and x.dtype == torch.bfloat16:
        y = torch.mv(w, x[0]).unsqueeze(0)
        return y if b is None else y + b
    return F.linear(x, w, b)


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over ranks (output stays sharded)."""

    quantizable = True  # --quantization packs its weight into `qweight` after loading
    qweight: QuantizedWeight | None = None
    lora: LoraSlots | None = None  # --enable-lora: adapter slots added to the output (axonserve/lora)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        assert out_features % TPInfo.size == 0, f"{out_features} rows do not split over {TPInfo.size} ranks"
        self.in_features, self.out_features = in_features, out_features // TPInfo.size
        self.weight = _param((self.out_features, in_features), dtype, self.weight_loader)
        self.bias = _param((self.out_features,), dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor, shard: str | int | None = None) -> None:
        n = param.shape[0]
        param.data.copy_(w.narrow(0, TPInfo.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.qweight)
        return y if self.lora is None else self.lora.add(x, y)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate+up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, dtype: torch.dtype = torch.float32):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, dtype)

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor, shard: str | int | None = None) -> None:
        assert isinstance(shard, int)
        size = self.out_sizes[shard] // TPInfo.size
        offset = sum(self.out_sizes[:shard]) // TPInfo.size
        param.data.narrow(0, offset, size).copy_(w.narrow(0, TPInfo.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V in one matmul; heads split over ranks (K/V heads replicated if fewer than ranks)."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        tp = TPInfo.size
        if num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads):
            raise ValueError(
                f"{num_heads} query / {num_kv_heads} KV heads do not split over {tp} tensor-parallel ranks "
                "(KV heads must divide evenly or be replicated evenly)"
            )
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden, out, bias, dtype)

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor, shard: str | int | None = None) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard == "q":
            offset, size, rank = 0, q, TPInfo.rank
        else:
            offset, size, rank = (q if shard == "k" else q + kv), kv, TPInfo.rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(w.narrow(0, rank * size, size))


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over ranks; partial sums are all-reduced."""

    quantizable = True
    qweight: QuantizedWeight | None = None
    lora: LoraSlots | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        assert in_features % TPInfo.size == 0, f"{in_features} columns do not split over {TPInfo.size} ranks"
        self.in_features, self.out_features = in_features // TPInfo.size, out_features
        self.weight = _param((out_features, self.in_features), dtype, self.weight_loader)
        self.bias = _param((out_features,), dtype, self._bias_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor, shard: str | int | None = None) -> None:
        n = param.shape[1]
        param.data.copy_(w.narrow(1, TPInfo.rank * n, n))

    def _bias_loader(self, param: nn.Parameter, w: torch.Tensor, shard: str | int | None = None) -> None:
        param.data.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias if TPInfo.rank == 0 else None, self.qweight)
        if self.lora is not None:  # this rank's partial, before the reduction: the sum is exact
            y = self.lora.add(x, y)
        return tp_reduce(y)  # all-reduce (reduce-scatter along tokens when sequence-parallel)


def default_weight_loader(param: nn.Parameter, w: torch.Tensor, shard: str | int | None = None) -> None:
    assert param.shape == w.shape, f"shape mismatch {tuple(param.shape)} vs {tuple(w.shape)}"
    param.data.copy_(w)
