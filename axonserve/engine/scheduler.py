"""Continuous-batching scheduler policy (pure Python, no I/O).

Over 500 lines: one policy (token budget, preemption, chunked prefill, buckets, multi-step,
speculative rows) whose parts decide together in `schedule()`; its state machine is `request.py`.

Each step: running requests first (decode-first, so streams keep flowing), then waiting
ones while the token budget, the sequence cap and free KV blocks allow. A waiting request
first takes every cached leading block (prefix caching). A prompt larger than the remaining
budget is split (chunked prefill) or, with chunking off, waits for a step with room. When
blocks run out, the lowest-priority running request is preempted (blocks freed, recomputed
later — cheaply, since its blocks stay in the prefix cache until reused).
The plan sent to workers is a diff: new requests in full, known ones only their new blocks.

Bucketing mode (`SchedulerConfig.buckets` set: Neuron static shapes, see `buckets.py`): a step
is either token generation — only requests with exactly one token left to compute, at most
the largest decode batch bucket — or context encoding — only prefill chunks (partially
prefilled running requests first, then admissions), at most the largest context batch
bucket, each chunk at most the largest context-length bucket, all within the token budget.
Never mixed. Fairness rule: decode steps are preferred, but while prefill work is pending
the two kinds alternate (a prefill step follows every decode step), so neither starves.
When more decodes are ready than the largest decode bucket holds, the ones served go to the
back of the running list (round robin).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from axonserve.config import EngineConfig, SpeculativeConfig
from axonserve.engine.block_manager import BlockManager
from axonserve.engine.buckets import BucketConfig
from axonserve.engine.request import Request, Status
from axonserve.engine.sliding_window import blocks_held
from axonserve.lora.adapter import lora_key
from axonserve.protocol.codec import TensorRef
from axonserve.protocol.messages import (
    CachedRequestData,
    NewRequestData,
    ParamError,
    RequestDelta,
    RequestStats,
    StepPlan,
    StepResult,
)
from axonserve.speculative.scheduler import SpecDecoding
from axonserve.speculative.tree import tree_depths


@dataclass(slots=True)
class PlanShapes:
    """What one plan asks of the model, per scheduled sequence: tokens this step (query) and
    computed + scheduled tokens (KV), by phase. Published with the step's stats so the metrics
    actor can histogram the traffic for `axonserve buckets plan`."""

    prefill_q: list[int] = field(default_factory=list)
    prefill_kv: list[int] = field(default_factory=list)
    decode_q: list[int] = field(default_factory=list)
    decode_kv: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority (lower value runs first, as in vLLM)
    buckets: BucketConfig | None = None  # bucketing mode (static shapes) when set
    task: str = "generate"  # embed: every request is a pooling request (no KV blocks)
    speculative: SpeculativeConfig | None = None  # drafts verified in the step (speculative/scheduler.py)
    # plans may be made before the last one's result is back (see `schedule`); the actor sets it
    async_scheduling: bool = False
    num_scheduler_steps: int = 1  # multi-step decoding (see `_multi_steps`)
    # every layer slides within at most this many tokens: blocks past it are given back while a
    # request runs (engine/sliding_window.py); None: full attention somewhere, nothing is
    kv_window: int | None = None
    max_loras: int = 0  # LoRA adapters one step may hold (0: LoRA off, adapter requests are refused)

    @classmethod
    def from_engine(
        cls,
        cfg: EngineConfig,
        *,
        max_model_len: int,
        num_kv_blocks: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        kv_window: int | None = None,
        buckets: BucketConfig | None = None,
    ) -> SchedulerConfig:
        """The policy an EngineConfig asks for, sized by what the workers report (KV blocks,
        vocabulary, EOS ids, sliding window): the one mapping, for the scheduler actor and the
        in-process benchmarks alike."""
        embed = cfg.task == "embed"  # an encoder: no KV pool, every prompt runs whole in one step
        return cls(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, max_model_len if embed else 1),
            max_model_len=max_model_len,
            block_size=cfg.block_size,
            num_kv_blocks=num_kv_blocks,
            vocab_size=vocab_size,
            eos_token_ids=eos_token_ids,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            policy=cfg.scheduling_policy,
            buckets=buckets,
            task=cfg.task,
            speculative=cfg.speculative,
            async_scheduling=(
                cfg.async_scheduling and cfg.speculative is None and buckets is None and cfg.role == "both"
            ),
            num_scheduler_steps=cfg.num_scheduler_steps,
            kv_window=kv_window,
            max_loras=cfg.max_loras if cfg.enable_lora else 0,
        )


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.blocks = BlockManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching, window=cfg.kv_window)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by _order_key
        self.running: list[Request] = []
        self._to_drop: list[str] = []  # worker state to discard at the next step
        # per plan sent and not yet answered, oldest first: its (request, tokens) scheduled, and
        # which of them sample how many tokens
        self._in_flight: collections.deque[tuple[list[tuple[Request, int]], list[tuple[Request, int]]]] = (
            collections.deque()
        )
        self._step_id = self._step_base = 0
        self.num_forwards = 0  # model forwards of the plans made (multi-step plans run several)
        self.num_sp_forwards = 0  # of those, forwards the ranks ran sequence-parallel
        self._seq = itertools.count()
        self._order: dict[str, tuple] = {}
        self.num_preemptions = 0
        self.prefix_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_hits = 0  # of which found cached
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # latency observations since the caller last drained them (for the stats bus)
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.finished_stats: list[RequestStats] = []
        # bucketing mode
        self._last_phase = ""  # "decode" | "prefill": kind of the last bucketed step
        self.shapes: set[tuple] = set()  # distinct (phase, batch, query_len, kv_len) the workers ran
        self.spec = SpecDecoding(cfg.speculative) if cfg.speculative else None
        self.want_features = bool(cfg.speculative and cfg.speculative.method == "eagle")
        self.plan_frames: list[Any] = []  # the last plan's extra frames (new requests' images)
        self.plan_shapes = PlanShapes()  # the last plan's shapes (for the stats)

    def _order_key(self, req: Request) -> tuple:
        return self._order[req.request_id]

    # ------------------------------------------------------------------ intake

    def check(self, req: Request) -> str | None:
        """Why this request can never run, or None."""
        n, cfg = req.num_prompt_tokens, self.cfg
        if n == 0:
            return "prompt is empty"
        if req.request_id in self.requests:
            return f"duplicate request id {req.request_id!r}"
        if (req.pooling is not None) != (cfg.task == "embed"):
            if cfg.task == "embed":
                return "this model serves the embed task: it does not generate text; request embeddings"
            return f"this model serves the {cfg.task} task: it does not produce embeddings"
        if req.pooling is not None:
            return self._check_pooling(req)
        if req.lora is not None and not cfg.max_loras:
            return "LoRA adapters are not enabled on this server (start it with --enable-lora)"
        if n >= cfg.max_model_len:
            return (
                f"This model's maximum context length is {cfg.max_model_len} tokens. "
                f"However, your request has {n} input tokens."
            )
        if any(t < 0 or t >= cfg.vocab_size for t in req.token_ids):
            return f"prompt contains token ids outside the vocabulary [0, {cfg.vocab_size})"
        try:
            req.params.check_vocab(cfg.vocab_size)
        except ParamError as e:
            return str(e)
        if not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
            return (
                f"prompt has {n} tokens, more than max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}) with chunked prefill disabled"
            )
        if cfg.buckets and not cfg.enable_chunked_prefill and n > cfg.buckets.max_context_len:
            return (
                f"prompt has {n} tokens, more than the largest context-length bucket "
                f"({cfg.buckets.max_context_len}) with chunked prefill disabled"
            )
        if req.num_output_tokens and req.num_tokens >= req.max_total_tokens:
            return "a resumed request has nothing left to generate"
        chunk = cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else req.num_tokens + 1
        need = blocks_held(req.num_tokens + 1, chunk, cfg.kv_window, cfg.block_size)
        if need > cfg.num_kv_blocks:
            return f"prompt needs {need} KV blocks but the pool holds {cfg.num_kv_blocks}"
        return None

    def _check_pooling(self, req: Request) -> str | None:
        """A pooling request runs whole in one step and needs no KV blocks."""
        n, cfg = req.num_prompt_tokens, self.cfg
        if n > cfg.max_model_len:
            return (
                f"This model's maximum context length is {cfg.max_model_len} tokens. "
                f"However, your request has {n} input tokens."
            )
        if any(t < 0 or t >= cfg.vocab_size for t in req.token_ids):
            return f"prompt contains token ids outside the vocabulary [0, {cfg.vocab_size})"
        if n > cfg.max_num_batched_tokens:
            return (
                f"prompt has {n} tokens, more than max_num_batched_tokens ({cfg.max_num_batched_tokens}); "
                "a pooling prompt is never split"
            )
        return None

    def add(self, req: Request) -> None:
        if req.lora is not None:  # two adapters never share KV, nor an adapter and the base model
            req.extra_keys = (*req.extra_keys, lora_key(req.lora))
        self.requests[req.request_id] = req
        prio = req.priority if self.cfg.policy == "priority" else 0
        self._order[req.request_id] = (prio, next(self._seq))
        bisect.insort(self.waiting, req, key=self._order_key)
        self.prompt_tokens += req.num_prompt_tokens

    def abort(self, request_ids: list[str]) -> list[Request]:
        """Finish the named requests now (idempotent); returns the ones that were live."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.finish_reason = "abort"
            self._finish(req)
            done.append(req)
        return done

    def abort_all(self, reason: str = "abort") -> list[Request]:
        reqs = list(self.requests.values())
        for req in reqs:
            req.finish_reason = reason
            self._finish(req)
        return reqs

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------ step

    def schedule(self) -> StepPlan | None:
        """The next plan. With async scheduling it may be made while earlier plans are still running:
        everything they schedule counts as computed (the ranks run plans in order, so no later plan
        can read KV before they write it) and each token they will sample counts as known
        (`num_pending`); only the token ids are missing, and the worker has those. A request whose
        pending token ends it by length is not scheduled again; one that ends by EOS or a stop
        token costs one discarded row in the plan after (a multi-step plan after: up to N)."""
        if self.cfg.buckets is not None:
            return self._schedule_bucketed(self.cfg.buckets)
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        steps = self._multi_steps()

        for req in list(self.running):
            if req.status != Status.RUNNING:  # preempted earlier in this loop
                continue
            known = req.num_tokens + req.num_pending
            if req.num_pending and known >= req.max_total_tokens:  # its pending token is its last
                continue
            n = min(known - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            if steps > 1:  # multi-step: its next tokens, never past its last
                k = min(steps - 1, req.max_total_tokens - known - 1, budget - 1)
            else:
                k = min(len(req.spec_token_ids), budget - 1) if n == 1 else 0  # drafts ride along
            n += k
            before = self.num_preemptions
            running, freed = self._grow(req, n, scheduled)
            budget += freed
            preempted = preempted or self.num_preemptions > before
            if not running:
                continue
            req.num_spec_scheduled = k if steps == 1 else 0
            scheduled.append((req, n))
            budget -= n
            if budget == 0:
                break

        for req, n in scheduled:  # (after the loop: a victim it preempted is out of `scheduled`)
            self._publish(req, n)
        if not preempted:
            self._admit(scheduled, budget)

        if not scheduled and not self._to_drop:
            return None
        return self._make_plan(scheduled, multi_step=steps > 1)

    def _multi_steps(self) -> int:
        """Forwards the next plan may run: `num_scheduler_steps` when every running request is a
        decode (with async scheduling, counting the tokens in flight as known), none wants
        per-token logprobs or a grammar (both are answered one token per step), and no waiting
        request could take a seat (it would wait up to N-1 forwards for its prefill); else 1.
        Fewer when the token budget cannot give every running request as many (the first in
        line must not take the whole budget). With speculative decoding, only while speculation is
        off (more decoding requests than disable_by_batch_size): below that, drafts verified in
        one forward beat N plain ones; above it, N forwards per plan save the step overheads."""
        cfg = self.cfg
        seat_free = self.waiting and len(self.running) < cfg.max_num_seqs
        if cfg.num_scheduler_steps == 1 or not self.running or seat_free:
            return 1
        if self.spec is not None and self.spec.active(self.running):
            return 1
        for r in self.running:
            p = r.params
            if (
                r.num_tokens + r.num_pending - r.num_computed_tokens != 1
                or p.logprobs is not None
                or p.structured_outputs is not None
            ):
                return 1
        return max(1, min(cfg.num_scheduler_steps, cfg.max_num_batched_tokens // len(self.running)))

    # ------------------------------------------------------------------ bucketing mode

    def _schedule_bucketed(self, b: BucketConfig) -> StepPlan | None:
        """A pure decode or a pure prefill step (see the module docstring)."""

        def remaining(r: Request) -> int:
            return r.num_tokens - r.num_computed_tokens

        decodes = any(remaining(r) == 1 for r in self.running)
        prefills = any(remaining(r) > 1 for r in self.running) or (
            bool(self.waiting) and len(self.running) < self.cfg.max_num_seqs
        )
        if prefills and (not decodes or self._last_phase == "decode"):
            order = ("prefill", "decode")
        else:
            order = ("decode", "prefill")
        preempted = False
        for phase in order:
            if phase == "decode":
                scheduled, p = self._bucketed_decode(b)
            else:
                scheduled, p = self._bucketed_prefill(b, admit=not preempted)
            preempted |= p
            if scheduled:
                self._last_phase = phase
                return self._make_plan(scheduled)
        if self._to_drop:
            return self._make_plan([])
        return None

    def _grow(self, req: Request, n: int, scheduled: list[tuple[Request, int]]) -> tuple[bool, int]:
        """Make room for n more tokens of a running request, preempting others as needed.
        Returns (req still running, tokens given back by victims taken out of `scheduled`)."""
        freed = 0
        while not self.blocks.ensure(req, req.num_computed_tokens + n):
            victim = self._pick_victim()
            for i, (r, rn) in enumerate(scheduled):
                if r is victim:
                    del scheduled[i]
                    freed += rn
                    break
            self._preempt(victim)
            if victim is req:
                break
        return req.status == Status.RUNNING, freed

    def _bucketed_decode(self, b: BucketConfig) -> tuple[list[tuple[Request, int]], bool]:
        scheduled: list[tuple[Request, int]] = []
        n_before = self.num_preemptions
        budget = self.cfg.max_num_batched_tokens
        for req in list(self.running):
            if len(scheduled) >= b.max_decode_batch or budget <= 0:
                break
            if req.status != Status.RUNNING or req.num_tokens - req.num_computed_tokens != 1:
                continue
            ok, freed = self._grow(req, 1, scheduled)
            budget += freed
            if ok:
                scheduled.append((req, 1))
                budget -= 1
        # round robin when the decode bucket cannot hold every ready request
        served = {id(r) for r, _ in scheduled}
        self.running = [r for r in self.running if id(r) not in served] + [r for r, _ in scheduled]
        return scheduled, self.num_preemptions != n_before

    def _bucketed_prefill(self, b: BucketConfig, admit: bool) -> tuple[list[tuple[Request, int]], bool]:
        cfg = self.cfg
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        budget = cfg.max_num_batched_tokens
        cap_b, cap_q = min(b.max_context_batch, cfg.max_num_seqs), b.max_context_len
        for req in list(self.running):  # partially prefilled first
            if len(scheduled) >= cap_b or budget <= 0:
                break
            if req.status != Status.RUNNING or req.num_tokens - req.num_computed_tokens <= 1:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget, cap_q)
            n_before = self.num_preemptions
            ok, freed = self._grow(req, n, scheduled)
            preempted |= self.num_preemptions != n_before
            budget += freed
            if ok:
                scheduled.append((req, n))
                budget -= n

        for req, n in scheduled:
            self._publish(req, n)
        if admit and not preempted:
            self._admit(scheduled, budget, cap_q, cap_b)
        return scheduled, preempted

    def _admit(
        self, scheduled: list[tuple[Request, int]], budget: int, max_chunk: int | None = None, cap_b: int | None = None
    ) -> None:
        """Admit waiting requests in order while the budget, seats and KV blocks allow. A prefix
        that a request admitted before it computes in this plan is already in the prefix cache
        (`_publish`): a burst of prompts sharing a system prompt computes it once, in one plan."""
        cfg = self.cfg
        at = 0
        while at < len(self.waiting) and budget > 0 and (cap_b is None or len(scheduled) < cap_b):
            at = self._next_admissible(at) if cfg.max_loras else at
            if at is None or len(self.running) >= cfg.max_num_seqs or self.waiting[at].num_pending:
                break  # (a request preempted with a token in flight resumes once that token is back)
            n = self._admit_head(budget, max_chunk, at=at)
            if not n:
                break
            scheduled.append((self.running[-1], n))
            budget -= n
            self._publish(self.running[-1], n)

    def _next_admissible(self, start: int = 0) -> int | None:
        """LoRA: the first waiting request from `start` whose adapter keeps the running set within
        `max_loras` distinct adapters (vLLM skips the others, which wait); None: none can run now.
        With nothing running every request is admissible, so this never deadlocks."""
        loaded = {lora_key(r.lora) for r in self.running if r.lora is not None}
        for i in range(start, len(self.waiting)):
            req = self.waiting[i]
            if req.lora is None or len(loaded) < self.cfg.max_loras or lora_key(req.lora) in loaded:
                return i
        return None

    def _publish(self, req: Request, n: int) -> None:
        """Put the full blocks `req` computes in its next n tokens into the prefix cache now, at
        scheduling: a request admitted after it in this plan or a later one reuses them instead
        of computing them again. Safe because plans run in order and, within a forward, every
        layer writes the whole batch's K/V before any row attends (a row may read a block another
        row of the same plan fills). Not for what may not be computed: a LoRA request's rows are
        skipped when its adapter fails to load (it publishes after its step, `update`), pooling
        requests keep no KV, and a P/D request's KV is imported, not computed."""
        if req.lora is None and req.pooling is None and req.kv is None:
            self.blocks.cache_computed(req, req.num_computed_tokens + n)

    def _admit_head(self, budget: int, max_chunk: int | None = None, at: int = 0) -> int:
        """Move the head of the waiting queue to running with its cached prefix attached and
        KV blocks for its next chunk; returns that chunk's size, or 0 (nothing taken) when it
        must wait. With chunking off a prompt waits for a step with room, unless no step could
        ever hold it (a preempted request grown past the limit): then it is recomputed in chunks."""
        cfg, req = self.cfg, self.waiting[at]
        if req.pooling is not None:
            return self._admit_pooling(req, budget if max_chunk is None else min(budget, max_chunk))
        first_time = req.status == Status.WAITING
        # prompt_logprobs needs logits at every prompt position: nothing may come from the cache
        # (P/D decode: the prompt's KV comes with the plan and is imported, not looked up)
        if req.kv is not None:
            hit = req.kv.num_tokens
        else:
            hit = 0 if req.params.prompt_logprobs is not None else self.blocks.match_prefix(req)
        req.num_computed_tokens = hit
        n = req.num_tokens - hit
        limit = budget if max_chunk is None else min(budget, max_chunk)
        ever = cfg.max_num_batched_tokens if max_chunk is None else min(cfg.max_num_batched_tokens, max_chunk)
        if (not cfg.enable_chunked_prefill and limit < n <= ever) or not self.blocks.ensure(req, hit + min(n, limit)):
            self.blocks.free(req)
            req.num_computed_tokens = 0
            return 0
        if first_time:
            if req.kv is None:  # (P/D: the prefill engine's count, set on arrival)
                req.num_cached_tokens = hit
            req.t_scheduled = time.monotonic()
        if cfg.enable_prefix_caching and req.kv is None:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += hit
        self.waiting.pop(at)
        req.status = Status.RUNNING
        self.running.append(req)
        return min(n, limit)

    def _admit_pooling(self, req: Request, budget: int) -> int:
        """Admit the head pooling request only when its whole prompt fits this step."""
        n = req.num_tokens
        if n > budget:
            return 0
        req.t_scheduled = time.monotonic()
        self.waiting.pop(0)
        req.status = Status.RUNNING
        self.running.append(req)
        return n

    def _make_plan(self, scheduled: list[tuple[Request, int]], multi_step: bool = False) -> StepPlan:
        new, cached, new_n, cached_n = [], [], [], []
        drafts: dict[str, list[int]] = {}
        parents: dict[str, list[int]] = {}
        self.plan_frames = []
        self.plan_shapes = shapes = PlanShapes()
        for req, n in scheduled:
            # a decode computes the one known token not yet computed (plus drafts or multi-step
            # tokens); anything more is a prefill chunk (a prompt, or a recompute after preemption)
            if req.num_tokens + req.num_pending - req.num_computed_tokens == 1 and req.pooling is None:
                shapes.decode_q.append(n)
                shapes.decode_kv.append(req.num_computed_tokens + n)
            else:
                shapes.prefill_q.append(n)
                shapes.prefill_kv.append(req.num_computed_tokens + n)
            if req.num_spec_scheduled:
                drafts[req.request_id] = req.spec_token_ids[: req.num_spec_scheduled]
                req.verified_depth = req.num_spec_scheduled
                if req.spec_parents is not None:  # a prefix of a tree (parents first) is a tree
                    parents[req.request_id] = tree = req.spec_parents[: req.num_spec_scheduled]
                    req.verified_depth = max(tree_depths(tree))
            req.spec_token_ids, req.spec_parents = [], None
            if not req.sent_to_worker:
                new.append(
                    NewRequestData(
                        request_id=req.request_id,
                        token_ids=list(req.token_ids),
                        num_prompt_tokens=req.num_prompt_tokens,
                        block_ids=list(req.block_ids),
                        num_computed_tokens=req.num_computed_tokens,
                        params=req.params,
                        pooling=req.pooling,
                        mm=self._with_frames(req.mm, req.mm_frames) if req.mm is not None else None,
                        kv_export=req.kv_export,
                        kv=self._with_frames(req.kv, req.kv_frames) if req.kv is not None else None,
                        lora=req.lora,
                    )
                )
                new_n.append(n)
                req.sent_to_worker = True
            else:
                cached.append(CachedRequestData(req.request_id, req.block_ids[req.num_blocks_sent :]))
                cached_n.append(n)
            req.num_blocks_sent = len(req.block_ids)
            req.num_computed_tokens += n
        # (request, tokens it samples): one, or a multi-step plan's n
        sampling = [
            (r, n if multi_step else 1)
            for r, n in scheduled
            if r.pooling is None and r.num_computed_tokens >= r.num_tokens + r.num_pending
        ]
        for r, m in sampling:
            r.num_pending += m
        self._in_flight.append((list(scheduled), sampling))
        self._step_id += 1
        # EAGLE drafts on worker rank 0 in the step itself, for requests that sample at its end;
        # above disable_by_batch_size the head is skipped (it would only take cores from the step)
        eagle = self.want_features and self.spec is not None and self.spec.active(self.running)
        num_drafts = (
            {
                r.request_id: k
                for r, k in self.spec.pick([r for r, _ in scheduled if r.num_computed_tokens >= r.num_tokens])
            }
            if eagle
            else {}
        )
        plan = StepPlan(
            step_id=self._step_id,
            new=new,
            cached=cached,
            num_scheduled_tokens=new_n + cached_n,
            finished_request_ids=self._to_drop,
            draft_token_ids=drafts,
            draft_parents=parents,
            want_features=eagle,
            num_drafts=num_drafts,
            multi_step=multi_step,
        )
        self.num_forwards += plan.num_forwards
        self._to_drop = []
        return plan

    def _with_frames(self, msg: Any, frames: dict[str, Any]) -> Any:
        """`msg` (images, KV) with the TensorRefs of its fields renumbered onto this plan's extra
        frames, where `frames[field]` (a buffer, or a list for a list of refs) is appended."""
        refs: dict[str, Any] = {}
        for name, bufs in frames.items():
            old = getattr(msg, name)
            new = []
            for buf, ref in zip(bufs, old) if isinstance(old, list) else [(bufs, old)]:
                self.plan_frames.append(buf)
                new.append(TensorRef(len(self.plan_frames), ref.dtype, ref.shape))
            refs[name] = new if isinstance(old, list) else new[0]
        return msgspec.structs.replace(msg, **refs)

    def update(self, result: StepResult) -> list[RequestDelta]:
        """Apply sampled tokens; return the deltas to send (finished ones included)."""
        self.num_sp_forwards += result.sp_forwards
        if result.new_shapes:
            self.shapes.update(tuple(x) for x in result.new_shapes)
        for pl in result.prompt_logprobs:
            req = self.requests.get(pl.request_id)
            if req is None or req.prompt_logprobs_sent:
                continue
            have = len(req.prompt_logprobs) + 1  # index of the next prompt token without one
            if pl.start <= have:  # a recompute after preemption may repeat some
                req.prompt_logprobs.extend(pl.logprobs[have - pl.start :])
        deltas = []
        now = time.monotonic()
        lps = result.logprobs
        counts = result.num_sampled or itertools.repeat(1)
        eagle = dict(zip(result.draft_request_ids, result.draft_token_ids))
        trees = dict(zip(result.draft_request_ids, result.draft_parents))
        scheduled, sampling = self._in_flight.popleft() if self._in_flight else ([], [])
        ahead: dict[int, int] = {}  # request -> its tokens in plans still in flight (not computed yet)
        for later, _ in self._in_flight:
            for r, n in later:
                ahead[id(r)] = ahead.get(id(r), 0) + n
        for req, m in sampling:
            req.num_pending -= m
        at, several = 0, False
        for i, (rid, m) in enumerate(zip(result.request_ids, counts)):
            toks = result.sampled_token_ids[at : at + m]
            at += m
            req = self.requests.get(rid)
            if req is None or req.status == Status.FINISHED:  # aborted or finished meanwhile
                continue
            # not running: preempted by a plan made after this one (async scheduling); its token
            # still counts (it resumes with it), its blocks are gone
            running = req.status == Status.RUNNING
            k, req.num_spec_scheduled = req.num_spec_scheduled, 0
            several = several or m != 1
            if k:  # m - 1 drafts accepted: the rejected ones' positions are not computed
                req.num_computed_tokens -= k - (m - 1)
                if self.spec is not None:
                    self.spec.record(req, k, m - 1, req.verified_depth)
            if running:  # verified KV only (not a later plan's); before a finish frees the blocks
                self.blocks.cache_computed(req, req.num_computed_tokens - ahead.get(id(req), 0))
            kept, done = req.append_tokens(toks, self.cfg.eos_token_ids)
            new = toks[:kept]
            self.generation_tokens += len(new)
            if req.t_first is None:
                req.t_first = now
                self.ttft.append(now - req.t_arrival)
            else:
                self.itl.append(now - (req.t_last or now))
            req.t_last = now
            delta = RequestDelta(
                request_id=rid,
                new_token_ids=new,
                logprobs=[lps[i]] if lps is not None and lps[i] is not None else None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
            )
            if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                delta.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
            if done:
                delta.finish_reason, delta.stop_reason = req.finish_reason, req.stop_reason
                self._finish(req)
            elif rid in eagle and running:
                self.take_drafts(req, eagle[rid], trees.get(rid))
            deltas.append(delta)
        for rid, why in zip(result.failed_request_ids, result.failed_errors):  # (its LoRA adapter)
            req = self.requests.get(rid)
            if req is None or req.status == Status.FINISHED:
                continue
            req.finish_reason = "error"
            deltas.append(
                RequestDelta(
                    rid, finish_reason="error", error=why, error_code=400, num_prompt_tokens=req.num_prompt_tokens
                )
            )
            self._finish(req)
        for rid in result.pooled_request_ids:  # their vectors travel as frames (scheduler_actor)
            req = self.requests.get(rid)
            if req is None or req.status != Status.RUNNING:  # aborted meanwhile
                continue
            req.t_first = now
            self.ttft.append(now - req.t_arrival)
            req.finish_reason = "stop"
            deltas.append(RequestDelta(rid, finish_reason="stop", num_prompt_tokens=req.num_prompt_tokens))
            self._finish(req)
        # prefill chunks that sampled nothing, and requests with several tokens back (verified drafts,
        # multi-step: computed positions whose tokens are known only now); when every request
        # sampled one token, the calls above published all there is (`sampling` is in `scheduled`)
        if several or len(sampling) < len(scheduled):
            for req, _ in scheduled:
                if req.status == Status.RUNNING and req.pooling is None and not req.num_spec_scheduled:
                    self.blocks.cache_computed(req, req.num_computed_tokens - ahead.get(id(req), 0))
        return deltas

    def take_drafts(self, req: Request, drafts: list[int], parents: list[int] | None = None) -> None:
        """Proposed tokens for req's next step (a tree when parents are given): never past its
        last token, only valid ids and trees."""
        room = req.max_total_tokens - req.num_tokens - 1
        if room <= 0 or not all(0 <= t < self.cfg.vocab_size for t in drafts):
            return
        if parents is not None and (len(parents) != len(drafts) or any(not -1 <= p < j for j, p in enumerate(parents))):
            return
        req.spec_token_ids = drafts[:room]
        req.spec_parents = None if parents is None else parents[:room]

    def step_base(self, base: int) -> None:
        """Number plans from `base` (a replacement scheduler: apart from its predecessor's)."""
        self._step_id = self._step_base = base

    def workers_lost(self) -> list[Request]:
        """The worker ranks were replaced: their KV and request state are gone. Every running
        request goes back to the queue (preempted: it is recomputed from its tokens, outputs kept),
        plans in flight are forgotten (their tokens never arrive) and the prefix cache is emptied
        (its blocks' KV is gone). Returns the requests that were running."""
        running = list(self.running)
        for req in running:
            self._preempt(req)
        for req in self.requests.values():
            req.num_pending, req.num_spec_scheduled, req.sent_to_worker = 0, 0, False
        self._in_flight.clear()
        self._to_drop.clear()
        self.blocks.drop_cached()
        return running

    # ------------------------------------------------------------------ internals

    def _pick_victim(self) -> Request:
        """Lowest priority (largest key: priority value, then latest arrival)."""
        return max(self.running, key=self._order_key)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req)
        if req.sent_to_worker:
            self._to_drop.append(req.request_id)
            req.sent_to_worker = False
        req.num_computed_tokens = 0
        req.spec_token_ids, req.spec_parents, req.num_spec_scheduled = [], None, 0
        req.status = Status.PREEMPTED
        bisect.insort(self.waiting, req, key=self._order_key)  # ahead of later arrivals
        self.num_preemptions += 1

    def _finish(self, req: Request) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status in (Status.WAITING, Status.PREEMPTED):
            self.waiting.remove(req)
        if req.sent_to_worker:
            self._to_drop.append(req.request_id)
        self.blocks.free(req)
        req.status = Status.FINISHED
        self.requests.pop(req.request_id, None)
        now = time.monotonic()
        start = req.t_scheduled or now
        self.finished_stats.append(
            RequestStats(
                finish_reason=req.finish_reason or "abort",
                e2e_s=now - req.t_arrival,
                queue_s=start - req.t_arrival,
                prompt_tokens=req.num_prompt_tokens,
                generation_tokens=req.num_output_tokens,
                cached_tokens=req.num_cached_tokens,
                prefill_s=(req.t_first or now) - start,
                decode_s=now - (req.t_first or now),
                max_tokens=req.params.max_tokens or 0,
            )
        )
        self._order.pop(req.request_id, None)

    def stats(self) -> dict[str, int | float | list]:
        return dict(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.blocks.usage(),
            prefix_cache_queries=self.prefix_queries,
            prefix_cache_hits=self.prefix_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self._step_id - self._step_base,
            num_forwards=self.num_forwards,
            sequence_parallel_forwards=self.num_sp_forwards,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_shapes=len(self.shapes),
            shapes=sorted(self.shapes),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, int | list[int]]:
        if self.spec is None:
            return {}
        drafts, drafted, accepted, per_pos = self.spec.counters()
        return dict(
            spec_drafts=drafts, spec_draft_tokens=drafted, spec_accepted_tokens=accepted, spec_accepted_per_pos=per_pos
        )
