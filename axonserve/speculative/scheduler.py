"""Speculative decoding, scheduler side: who speculates, the n-gram proposer, the counters.

Each step a decoding request may carry k draft tokens, a chain or an EAGLE-2 tree (each draft
with its parent: speculative/tree.py); the scheduler schedules 1 + k tokens (the one rule still holds:
computed tokens catch up with known tokens, drafts counted as known), the worker verifies them
in one forward (a tree with tree attention) and rejection-samples (neuron/sampler.py), moves an
accepted tree path's KV into consecutive slots, and `Scheduler.update` takes the accepted
drafts plus one sampled token, moving the computed count back over the rejected ones (their KV
slots are simply overwritten later).

A request speculates only when sampling at one position does not depend on the tokens
sampled before it in the same step (min_tokens is applied per position by the verifier):
no penalties, no logprobs, no grammar. Drafts shrink as more requests draft (max_verify_rows:
each verification row adds to the forward, so 8 drafts for each of 8 requests cost more than
they save; docs/benchmarks.md#fig-config), speculation turns itself off above a batch size, and
it pauses, with exponential back-off, for a request whose drafts keep failing.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from axonserve.config import SpeculativeConfig
from axonserve.engine.request import Request

_EMA = 0.3  # weight of the newest step in a request's acceptance-rate average
_PAUSE = 8  # first back-off, in steps; doubles on every relapse up to _MAX_PAUSE
_MAX_PAUSE = 256


class ReqSpec:
    """One request's acceptance history."""

    __slots__ = ("rate", "pause", "backoff")

    def __init__(self) -> None:
        self.rate = 1.0  # moving average of accepted / drafted
        self.pause = 0  # steps left without drafting
        self.backoff = _PAUSE


def ngram_propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: find the most recent earlier occurrence of the longest suffix of
    `tokens` (n_max down to n_min tokens) and propose the up to k tokens that followed it."""
    size = len(tokens)
    if size < n_min + 1:
        return []
    arr = np.fromiter(tokens, dtype=np.int64, count=size)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        windows = sliding_window_view(arr[: size - 1], n)  # window i = arr[i:i+n], i + n <= size - 1
        hits = np.flatnonzero((windows == arr[size - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


class SpecDecoding:
    """Scheduler-side speculation policy and vLLM's spec_decode counters."""

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg  # validated with its EngineConfig
        self.k = cfg.num_speculative_tokens
        # counters (vllm:spec_decode_*): steps that verified drafts, drafted, accepted, per position
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k

    @staticmethod
    def eligible(req: Request) -> bool:
        p = req.params
        return (
            req.pooling is None
            and p.logprobs is None
            and p.structured_outputs is None
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and p.repetition_penalty == 1.0
        )

    def active(self, running: list[Request]) -> bool:
        """Speculation is on: at most disable_by_batch_size requests decode (0: no limit)."""
        limit = self.cfg.disable_by_batch_size
        return not limit or sum(r.num_tokens - r.num_computed_tokens <= 1 for r in running) <= limit

    def candidates(self, running: list[Request]) -> list[tuple[Request, int]]:
        """(request, how many drafts it may take) for this step's proposals; empty when the
        decoding batch is past disable_by_batch_size."""
        if not self.active(running):
            return []
        return self.pick([r for r in running if r.num_tokens - r.num_computed_tokens == 1])

    def pick(self, reqs: list[Request]) -> list[tuple[Request, int]]:
        """Those of `reqs` that draft next (eligible, not paused), with their draft count: k, fewer
        near a request's end, and fewer as more requests draft (max_verify_rows)."""
        out = []
        for r in reqs:
            if r.spec is None:
                r.spec = ReqSpec()
            if r.spec.pause:
                r.spec.pause -= 1
                continue
            k = min(self.k, r.max_total_tokens - r.num_tokens - 1)  # never draft past the end
            if k > 0 and self.eligible(r):
                out.append((r, k))
        rows = self.cfg.max_verify_rows
        if rows and out:
            cap = rows // len(out) - 1  # each verifies its drafts and the last known token
            out = [(r, min(k, cap)) for r, k in out] if cap > 0 else []
        return out

    def ngram(self, reqs: list[tuple[Request, int]]) -> None:
        c = self.cfg
        for r, k in reqs:
            r.spec_token_ids = ngram_propose(r.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)

    def record(self, req: Request, drafted: int, accepted: int, depth: int) -> None:
        """A verified step of `req`: `drafted` drafts (a tree's nodes), the longest path `depth`
        of them; update the counters and its back-off state (its rate is accepted / depth)."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        s = req.spec
        if s is None:
            return
        s.rate = (1 - _EMA) * s.rate + _EMA * accepted / max(depth, 1)
        if s.rate < self.cfg.min_acceptance_rate:
            s.pause, s.backoff = s.backoff, min(2 * s.backoff, _MAX_PAUSE)
            s.rate = 1.0  # a fresh start after the pause
        elif accepted:
            s.backoff = _PAUSE

    def counters(self) -> tuple[int, int, int, list[int]]:
        return self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos)
