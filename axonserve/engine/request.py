"""Scheduler-side request state.

One rule drives scheduling: each step a request gets tokens until `num_computed_tokens`
catches up with `num_tokens`. A fresh prompt, a prefill chunk, a resumed (preempted)
request and a decode step are all the same case.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from axonserve.protocol.messages import (
    KVBlocks,
    LoraSpec,
    MultiModalInput,
    PoolingParams,
    SamplingParams,
    TokenLogprobs,
)


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class Request:
    __slots__ = (
        "request_id",
        "params",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "block_ids",
        "status",
        "priority",
        "arrival_time",
        "max_total_tokens",
        "num_pending",
        "finish_reason",
        "stop_reason",
        "sent_to_worker",
        "num_blocks_sent",
        "block_hashes",
        "num_cached_blocks",
        "num_released_blocks",
        "num_cached_tokens",
        "extra_keys",
        "prompt_logprobs",
        "prompt_logprobs_sent",
        "t_arrival",
        "t_scheduled",
        "t_first",
        "t_last",
        "pooling",
        "spec_token_ids",
        "spec_parents",
        "verified_depth",
        "num_spec_scheduled",
        "spec",
        "mm",
        "mm_frames",
        "kv_export",
        "kv",
        "kv_frames",
        "lora",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_model_len: int,
        priority: int = 0,
        arrival_time: float | None = None,
        pooling: PoolingParams | None = None,
    ):
        self.request_id = request_id
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.status = Status.WAITING
        self.priority = priority
        self.arrival_time = arrival_time or time.time()
        limit = max_model_len
        if params.max_tokens is not None:
            limit = min(limit, self.num_prompt_tokens + params.max_tokens)
        self.max_total_tokens = limit
        # tokens that steps already sent will sample for it, not back yet (async scheduling): the
        # next plan already counts them as known (the worker feeds its own sampled token back)
        self.num_pending = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.sent_to_worker = False  # the worker holds state for it (cleared on preemption)
        self.num_blocks_sent = 0  # block ids the worker already has
        self.block_hashes: list[bytes] = []  # chained (keyed) hashes of full blocks of token_ids
        self.num_cached_blocks = 0  # leading blocks published to the prefix cache
        # leading blocks given back while it runs, past every layer's sliding window (their
        # block_ids entries are placeholders: engine/sliding_window.py)
        self.num_released_blocks = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.prompt_logprobs: list[TokenLogprobs] = []  # prompt_logprobs: entries for tokens 1..
        self.prompt_logprobs_sent = False
        self.extra_keys: tuple = ()  # e.g. image hashes: part of every block hash
        # monotonic timestamps in the scheduler (for latency metrics)
        self.t_arrival = time.monotonic()
        self.t_scheduled: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        # embed task: the whole prompt runs in one step (no KV blocks, no prefix cache, never
        # chunked), then the request finishes with a pooled vector
        self.pooling = pooling
        # speculative decoding (speculative/scheduler.py): drafts proposed for the next step, how many
        # of them the step in flight verifies, and the request's acceptance history
        self.spec_token_ids: list[int] = []
        self.spec_parents: list[int] | None = None  # a draft tree's parent per draft (None: a chain)
        self.num_spec_scheduled = 0
        self.verified_depth = 0  # the longest path among the drafts in flight (k for a chain)
        self.spec = None
        # images (vision-language models): their MultiModalInput, whose TensorRefs name
        # `mm_frames[field]` (raw buffers the scheduler forwards to the workers as they are)
        self.mm: MultiModalInput | None = None
        self.mm_frames: dict[str, Any] = {}
        # prefill/decode disaggregation: export the prompt KV (prefill engine), or the imported
        # prompt KV (decode engine: its first `kv.num_tokens` tokens are never computed here)
        self.kv_export = False
        self.kv: KVBlocks | None = None
        self.kv_frames: dict[str, Any] = {}
        # multi-LoRA: the adapter it runs with (None: the base model); part of its prefix-cache key
        self.lora: LoraSpec | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_tokens(self, toks: list[int], eos_token_ids: frozenset[int]) -> tuple[int, bool]:
        """Record sampled tokens up to the first that ends the request (EOS or a stop token once
        min_tokens are out, or the length limit) and set its finish state; returns (tokens
        kept, done). One pass over a multi-token result (multi-step or speculative decoding)."""
        p = self.params
        eos = () if p.ignore_eos else eos_token_ids
        keep = min(len(toks), self.max_total_tokens - len(self.token_ids))
        outputs = len(self.token_ids) - self.num_prompt_tokens  # before these
        for j in range(max(0, p.min_tokens - outputs - 1), keep):
            t = toks[j]
            if t in eos or t in p.stop_token_ids:
                self.token_ids += toks[: j + 1]
                self.finish_reason = "stop"
                if t not in eos:
                    self.stop_reason = t
                return j + 1, True
        self.token_ids += toks[:keep]
        if len(self.token_ids) >= self.max_total_tokens:
            self.finish_reason = "length"
            return keep, True
        return keep, False
