"""Counter-based randomness: a seeded request's uniform number at a position is a hash of (seed,
position) and nothing else, so its tokens do not depend on the batch it shares, on how often it was
preempted and recomputed, on a worker restart or on the device (the CPU sampler, neuron/sampler.py,
and the XLA sampling graphs, xla/sampling.py, hash the same way).

Integer tensor ops only, every intermediate below 2**63 (32-bit lanes in int64 tensors, 16-bit
multiplies), so the hash compiles on any XLA backend and never overflows. torch only: no torch_xla.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

M32 = 0xFFFFFFFF


def _mul32(x: Any, c: int) -> Any:
    """(x * c) mod 2**32 for x in [0, 2**32) without a product above 2**48."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & M32


def _fmix32(x: Any) -> Any:
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
    return s >> 32, s & M32


def hash32(seed_hi: Any, seed_lo: Any, position: Any) -> Any:
    """int64 in [0, 2**32), one per row, a function of (seed, position) only (int64 tensors holding
    32-bit words: `seed_words`, and positions below 2**32; or one row as Python ints)."""
    h = _fmix32(position ^ 0x9E3779B9)
    h = _fmix32(seed_hi ^ h)
    return _fmix32(seed_lo ^ h)


def uniforms(seed_hi: torch.Tensor, seed_lo: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1], one per row: the hash's top 24 bits (what the XLA sampling graphs use;
    float32 rounding can make the largest value exactly 1.0, which their inverse CDF handles)."""
    return ((hash32(seed_hi, seed_lo, position) >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def uniforms64(seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """float64 [rows] strictly inside (0, 1): all 32 hash bits, (h + 0.5) / 2**32 (exact in float64),
    for the CPU sampler. Within 2**-24 of `uniforms` for the same (seed, position), so both devices
    draw the same token unless u falls that close to a boundary of the distribution's CDF. Hashed on
    Python ints (~3 us a row; torch's per-op overhead on tiny tensors cost ~250 us a step)."""
    out = []
    for seed, pos in zip(seeds, positions):
        hi, lo = seed_words(seed)
        out.append((hash32(hi, lo, pos & M32) + 0.5) / float(1 << 32))
    return torch.tensor(out, dtype=torch.float64)
