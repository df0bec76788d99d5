"""Token embedding and LM head, vocab rows split over tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axonserve.neuron.layers.linear import linear
from axonserve.neuron.parallel import TPInfo, tp_all_gather_last, tp_reduce


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard = (vocab_size + TPInfo.size - 1) // TPInfo.size
        self.start = TPInfo.rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor, shard: str | int | None = None) -> None:
        n = min(self.shard, self.vocab_size - self.start)
        param.data.zero_()
        param.data[:n].copy_(w.narrow(0, self.start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if TPInfo.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        valid = (local >= 0) & (local < self.shard)
        y = F.embedding(local.clamp(0, self.shard - 1), self.weight) * valid.unsqueeze(-1)
        return tp_reduce(y)  # all-reduce (reduce-scatter along tokens when sequence-parallel)


class ParallelLMHead(VocabParallelEmbedding):
    """Each rank scores its vocab rows; the slices are gathered into full [N, V] logits."""

    quantizable = True  # --quantization: a packed copy (a tied table stays for the lookups)
    qweight = None

    def compute(self, hidden: torch.Tensor) -> torch.Tensor:
        return tp_all_gather_last(linear(hidden, self.weight, q=self.qweight))[:, : self.vocab_size]
