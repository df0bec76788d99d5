"""Sampling as fixed-shape tensor ops: every per-request parameter is a tensor, so no value recompiles.

A graph exists per (batch bucket, variant): `greedy` (argmax), `random` (temperature only, the
OpenAI default) and `filtered` (temperature, min_p, top-k, top-p, as the CPU sampler orders them:
neuron/sampler.py). A row with temperature 0 takes the argmax in every variant. Raw logprobs (the
sampled token's, its rank and the top MAX_LOGPROBS) are computed in every variant, so a request
asking for them changes nothing compiled; they leave the device only when asked for.

Randomness is counter-based: a row's uniform number is a hash of (seed, position) computed with
integer tensor ops, so a seeded request draws the same tokens on any device, in any batch, and after
a restart; unseeded requests get a seed from the runner's generator when they arrive. The hash keeps
every intermediate below 2**63 (32-bit lanes, 16-bit multiplies): no integer overflow on any backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from axonserve.protocol.messages import SamplingParams

GREEDY = SamplingParams(temperature=0.0)  # padding rows and rows not sampled this step
MAX_LOGPROBS = 20  # SamplingParams.logprobs' upper bound
VARIANTS = ("greedy", "random", "filtered")
_M32 = 0xFFFFFFFF


def variant(params: Sequence) -> str:
    """The cheapest graph that serves every row's SamplingParams."""
    if all(p.greedy for p in params):
        return "greedy"
    if all(p.greedy or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0) for p in params):
        return "random"
    return "filtered"


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) without a product above 2**48."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser: every input bit flips each output bit with probability ~1/2."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def seed_words(seed: int) -> tuple[int, int]:
    """A seed (any Python int; SamplingParams allows negative ones) as two 32-bit words, split on the
    host: XLA shifts negative int64 values differently from the CPU."""
    s = seed % (1 << 64)
    return s >> 32, s & _M32


def uniforms(seed_hi: torch.Tensor, seed_lo: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1), one per row, a function of (seed, position) only (int64 tensors holding
    32-bit words: `seed_words`, and positions below 2**32)."""
    h = _fmix32(position ^ 0x9E3779B9)
    h = _fmix32(seed_hi ^ h)
    h = _fmix32(seed_lo ^ h)
    return ((h >> 8).to(torch.float32) + 0.5) / float(1 << 24)


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
        ints[:, i] = (p.top_k if 0 < p.top_k < vocab else vocab, *seed_words(s), pos & _M32)
    return floats, ints
