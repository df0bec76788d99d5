"""Sampling as fixed-shape tensor ops: every per-request parameter is a tensor, so no value recompiles.

A graph exists per (batch bucket, variant): `greedy` (argmax), `random` (temperature only, the
OpenAI default) and `filtered` (temperature, min_p, top-k, top-p, as the CPU sampler orders them:
neuron/sampler.py). A row with temperature 0 takes the argmax in every variant. Raw logprobs (the
sampled token's, its rank and the top MAX_LOGPROBS) are computed in every variant, so a request
asking for them changes nothing compiled; they leave the device only when asked for.

Randomness is counter-based (neuron/counter_rng.py, shared with the CPU sampler): a row's uniform
number is a hash of (seed, position) computed with integer tensor ops, so a seeded request draws the
same tokens on any device, in any batch, and after a preemption or a restart; unseeded requests get
a seed from the runner's generator when they arrive.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from axonserve.neuron.counter_rng import M32, seed_words, uniforms
from axonserve.protocol.messages import SamplingParams

GREEDY = SamplingParams(temperature=0.0)  # padding rows and rows not sampled this step
MAX_LOGPROBS = 20  # SamplingParams.logprobs' upper bound
VARIANTS = ("greedy", "random", "filtered")


def variant(params: Sequence) -> str:
    """The cheapest graph that serves every row's SamplingParams."""
    if all(p.greedy for p in params):
        return "greedy"
    if all(p.greedy or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0) for p in params):
        return "random"
    return "filtered"


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first index whose running sum reaches u x the row's total (a zero-probability
    entry is never drawn: its running sum equals its predecessor's)."""
    cdf = probs.cumsum(dim=-1)
    target = u[:, None] * cdf[:, -1:]
    return (cdf < target).sum(dim=-1).clamp(max=probs.shape[-1] - 1)


def sample(
    logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V]; floats [3, B] (temperature, top_p, min_p); ints [4, B] (top_k: V when off,
    the seed's high and low words, position). Returns (ids [B], sampled logprob [B], its rank [B],
    top logprobs [B, K], their ids [B, K]), all on the logits' device."""
    x = logits.float()
    greedy_ids = x.argmax(dim=-1)
    if kind == "greedy":
        ids = greedy_ids
    else:
        temp, top_p, min_p = floats[0], floats[1], floats[2]
        top_k = ints[0]
        is_greedy = temp <= 0
        scaled = x / torch.where(is_greedy, torch.ones_like(temp), temp)[:, None]
        u = uniforms(ints[1], ints[2], ints[3])
        if kind == "random":
            drawn = _draw(scaled.softmax(dim=-1), u)
        else:
            probs = scaled.softmax(dim=-1)
            scaled = scaled.masked_fill(probs < (min_p[:, None] * probs.amax(dim=-1, keepdim=True)), float("-inf"))
            sorted_l, order = scaled.sort(dim=-1, descending=True)
            pos = torch.arange(x.shape[-1], device=x.device)[None, :]
            kmask = pos >= top_k[:, None]
            p = sorted_l.masked_fill(kmask, float("-inf")).softmax(dim=-1)
            mask = (kmask | ((p.cumsum(dim=-1) - p) > top_p[:, None])) & (pos > 0)
            j = _draw(sorted_l.masked_fill(mask, float("-inf")).softmax(dim=-1), u)
            drawn = order.gather(1, j[:, None])[:, 0]
        ids = torch.where(is_greedy, greedy_ids, drawn)
    raw = x.log_softmax(dim=-1)
    chosen = raw.gather(1, ids[:, None])
    rank = (raw > chosen).sum(dim=-1) + 1
    top_lp, top_ids = raw.topk(min(MAX_LOGPROBS, x.shape[-1]), dim=-1)
    return ids, chosen[:, 0], rank, top_lp, top_ids


def row_params(params: Sequence, seeds: Sequence[int], positions: Sequence[int], batch: int, vocab: int):
    """Host arrays for `sample` ([3, batch] float32, [4, batch] int64), padding rows greedy."""
    floats = np.zeros((3, batch), dtype=np.float32)
    floats[1] = 1.0
    ints = np.zeros((4, batch), dtype=np.int64)
    ints[0] = vocab
    for i, (p, s, pos) in enumerate(zip(params, seeds, positions)):
        floats[:, i] = (0.0 if p.greedy else p.temperature, p.top_p, p.min_p)
        ints[:, i] = (p.top_k if 0 < p.top_k < vocab else vocab, *seed_words(s), pos & M32)
    return floats, ints
