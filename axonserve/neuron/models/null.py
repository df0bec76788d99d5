"""A model that computes nothing, for measuring the engine around the forward pass.

`axonserve bench step` serves it to time what every step pays besides the model: scheduling,
plan encode and broadcast, the worker's bookkeeping and attention metadata, sampling over a
small vocabulary, the result's return and the outputs to the client. Its greedy token is
always 0 (requests use ignore_eos).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from axonserve.neuron.config import ModelConfig


class NullForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.weight = nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False)  # the one checkpoint tensor

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.weight.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return {name for name, _ in weights}
