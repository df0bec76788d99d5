"""Static-shape buckets (the Neuron bucketing mode), shared by the scheduler and the runner.

A compiled Neuron graph has fixed shapes, so every step is padded up to a bucket, as in
vllm-neuron / NxD Inference:

* token generation (decode): ``(batch, kv_len)`` from ``decode_batch`` × ``decode_len``;
* context encoding (prefill chunks): ``(batch, query_len, kv_len)`` from ``context_batch`` ×
  ``context_len`` × ``decode_len``. ``decode_len`` is the KV (sequence) length the attention
  gathers and masks, for both phases, so it must reach ``max_model_len``.

Empty lists mean "automatic": powers of two up to a cap derived from the engine limits
(like NxDI's auto buckets), the cap itself always included. KV-length buckets are rounded up
to whole KV blocks. Both sides resolve the same config with the same inputs, so the scheduler
and every worker agree on the set without sending it around.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_CONTEXT_LEN = 16  # smallest automatic query-length bucket
MIN_KV_LEN = 128  # smallest automatic KV-length bucket (NxDI's minimum)
MAX_AUTO_CONTEXT_BATCH = 8


def pow2_upto(cap: int, start: int = 1) -> list[int]:
    """start, 2*start, 4*start, ... below cap, then cap itself (cap >= 1)."""
    out, b = [], max(1, min(start, cap))
    while b < cap:
        out.append(b)
        b *= 2
    out.append(cap)
    return out


def pick(buckets, n: int) -> int:
    """Smallest bucket >= n (buckets sorted ascending)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def parse_buckets(text: str | None) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (CLI form); '' or None -> [] (automatic)."""
    if not text:
        return []
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"bucket list {text!r} must be comma-separated integers") from None
    if any(v < 1 for v in vals):
        raise ValueError(f"bucket list {text!r}: buckets must be >= 1")
    return vals


@dataclass(frozen=True)
class BucketConfig:
    context_batch: tuple[int, ...]
    context_len: tuple[int, ...]
    decode_batch: tuple[int, ...]
    decode_len: tuple[int, ...]  # KV lengths, multiples of the block size

    @property
    def max_context_batch(self) -> int:
        return self.context_batch[-1]

    @property
    def max_context_len(self) -> int:
        return self.context_len[-1]

    @property
    def max_decode_batch(self) -> int:
        return self.decode_batch[-1]

    @property
    def max_kv_len(self) -> int:
        return self.decode_len[-1]

    def decode_shape(self, batch: int, kv_len: int) -> tuple[str, int, int, int]:
        return ("decode", pick(self.decode_batch, batch), 1, pick(self.decode_len, kv_len))

    def prefill_shape(self, batch: int, query_len: int, kv_len: int) -> tuple[str, int, int, int]:
        return (
            "prefill",
            pick(self.context_batch, batch),
            pick(self.context_len, query_len),
            pick(self.decode_len, kv_len),
        )

    def contains(self, shape) -> bool:
        phase, b, q, s = shape
        if phase == "decode":
            return b in self.decode_batch and q == 1 and s in self.decode_len
        return phase == "prefill" and b in self.context_batch and q in self.context_len and s in self.decode_len

    @classmethod
    def resolve(
        cls,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        context_batch: list[int] | tuple[int, ...] = (),
        context_len: list[int] | tuple[int, ...] = (),
        decode_batch: list[int] | tuple[int, ...] = (),
        decode_len: list[int] | tuple[int, ...] = (),
    ) -> "BucketConfig":
        def norm(vals, auto: list[int], name: str) -> tuple[int, ...]:
            out = sorted(set(vals or auto))
            if not out or out[0] < 1:
                raise ValueError(f"{name} buckets must be positive integers, got {list(vals)}")
            return tuple(out)

        seqs = max(1, max_num_seqs)
        ctx_cap = max(1, min(max_num_batched_tokens, max_model_len))

        def blocks(n: int) -> int:
            return -(-n // block_size) * block_size

        kv_auto = pow2_upto(max_model_len, MIN_KV_LEN)
        return cls(
            context_batch=norm(context_batch, pow2_upto(min(seqs, MAX_AUTO_CONTEXT_BATCH)), "context batch"),
            context_len=norm(context_len, pow2_upto(ctx_cap, MIN_CONTEXT_LEN), "context length"),
            decode_batch=norm(decode_batch, pow2_upto(seqs), "decode batch"),
            decode_len=norm([blocks(v) for v in decode_len], [blocks(v) for v in kv_auto], "decode length"),
        )

    @classmethod
    def from_engine_config(cls, config, max_model_len: int) -> "BucketConfig":
        """The buckets of an EngineConfig with bucketing on (max_model_len: the runner's)."""
        return cls.resolve(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, 1),
            max_model_len=max_model_len,
            block_size=config.block_size,
            context_batch=config.context_batch_buckets,
            context_len=config.context_len_buckets,
            decode_batch=config.decode_batch_buckets,
            decode_len=config.decode_len_buckets,
        )

    def as_dict(self) -> dict[str, list[int]]:
        return dict(
            context_batch=list(self.context_batch),
            context_len=list(self.context_len),
            decode_batch=list(self.decode_batch),
            decode_len=list(self.decode_len),
        )
