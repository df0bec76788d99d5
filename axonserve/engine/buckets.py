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
import json
from dataclasses import dataclass

MIN_CONTEXT_LEN = 16  # smallest automatic query-length bucket
MIN_KV_LEN = 128  # smallest automatic KV-length bucket (NxDI's minimum)
MAX_AUTO_CONTEXT_BATCH = 8
DIMENSIONS = ("context_batch", "context_len", "decode_batch", "decode_len")
# a bucket file (`--buckets FILE`) is operator input: bounded before it costs anything
MAX_BUCKET_FILE_BYTES = 64 * 1024
MAX_BUCKETS_PER_LIST = 64
MAX_BUCKET_VALUE = 1 << 24


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
        q = pick(self.context_len, query_len)
        return ("prefill", pick(self.context_batch, batch), q, self._prefill_kv(q, pick(self.decode_len, kv_len)))

    def _prefill_kv(self, q: int, s: int) -> int:
        """A context-encoding step's KV bucket holds at least its query bucket (when a KV bucket can):
        the padded queries then never outnumber the keys, and every shape has q <= kv but for query
        buckets above every KV bucket."""
        return s if s >= q or q > self.max_kv_len else pick(self.decode_len, q)

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


def bucket_shapes(b: BucketConfig, max_model_len: int) -> list[tuple[str, int, int, int]]:
    """Every shape a bucketed step can take for sequences up to max_model_len tokens, as a compiled
    backend builds one graph for each: token generation (batch, 1, kv) for every decode batch and
    reachable KV bucket, and context encoding (batch, query, kv) for every (query bucket, KV bucket)
    some chunk of q <= kv <= max_model_len tokens lands in (`BucketConfig.prefill_shape`)."""
    kvs = [s for i, s in enumerate(b.decode_len) if (b.decode_len[i - 1] if i else 0) < max_model_len]
    shapes = [("decode", n, 1, s) for n in b.decode_batch for s in kvs]
    pairs: list[tuple[int, int]] = []
    for i, q in enumerate(b.context_len):
        q_lo = (b.context_len[i - 1] if i else 0) + 1  # the shortest chunk this query bucket takes
        for j, s in enumerate(kvs):
            kv_lo = (kvs[j - 1] if j else 0) + 1
            if max(q_lo, kv_lo) <= min(s, max_model_len):  # some q <= kv lands in (q, s)
                pair = (q, b._prefill_kv(q, s))
                if pair not in pairs:
                    pairs.append(pair)
    shapes += [("prefill", n, q, s) for n in b.context_batch for q, s in pairs]
    return shapes


def check_bucket_lists(data: object, what: str = "bucket file") -> dict[str, list[int]]:
    """The bucket lists in `data` (a JSON object with some of DIMENSIONS), or ValueError: each a
    non-empty list of at most MAX_BUCKETS_PER_LIST integers in [1, MAX_BUCKET_VALUE], no other
    keys. A missing list stays automatic."""
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{what}: expected a JSON object with some of {', '.join(DIMENSIONS)}")
    unknown = sorted(set(data) - set(DIMENSIONS))
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown[:5]} (allowed: {', '.join(DIMENSIONS)})")
    out = {}
    for key, vals in data.items():
        if not isinstance(vals, list) or not 1 <= len(vals) <= MAX_BUCKETS_PER_LIST:
            raise ValueError(f"{what}: {key} must be a list of 1 to {MAX_BUCKETS_PER_LIST} integers")
        if not all(type(v) is int and 1 <= v <= MAX_BUCKET_VALUE for v in vals):
            raise ValueError(f"{what}: {key} values must be integers in [1, {MAX_BUCKET_VALUE}]")
        out[key] = sorted(set(vals))
    return out


def read_json_file(path: str, limit: int, what: str):
    """A JSON document from a file of at most `limit` bytes (hostile input: bounded before parsing)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise ValueError(f"{what}: {e.strerror or e}") from None
    if len(raw) > limit:
        raise ValueError(f"{what}: larger than {limit} bytes")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{what}: not JSON ({e})") from None


def read_bucket_file(path: str) -> dict[str, list[int]]:
    """A JSON bucket file (as `axonserve buckets plan --out` writes), checked: see check_bucket_lists."""
    what = f"bucket file {path}"
    return check_bucket_lists(read_json_file(path, MAX_BUCKET_FILE_BYTES, what), what)


def write_bucket_file(path: str, b: BucketConfig) -> None:
    with open(path, "w") as f:
        json.dump(b.as_dict(), f, indent=1)
        f.write("\n")
