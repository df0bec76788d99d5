"""One engine step as the core's loop sees it, and what is checked and published about it.

`Step` is the typed record of a plan on its way: scheduled, sent to the ranks, its result
received and folded into the scheduler's state, its outputs emitted, its stats published.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from axonserve.engine.scheduler import PlanShapes, Scheduler
from axonserve.protocol import DecodeError
from axonserve.protocol.messages import CompileStats, RequestDelta, StepPlan, StepResult, StepStats


@dataclass(slots=True)
class Step:
    plan: StepPlan
    schedule_s: float  # making the plan
    sent_at: float  # perf_counter when the plan had left
    send_s: float  # encoding and sending it
    result: StepResult | None = None
    roundtrip_s: float = 0.0  # plan sent -> result received
    update_s: float = 0.0  # folding the result into the scheduler's state
    deltas: list[RequestDelta] = field(default_factory=list)  # its outputs, not emitted yet
    pooled: dict[str, memoryview] = field(default_factory=dict)  # embed task: vectors by request id
    shapes: PlanShapes = field(default_factory=PlanShapes)  # what the plan asked of the model


def result_problem(plan: StepPlan, r: object) -> str | None:
    """Why `r` is not a well-formed result of `plan` (junk on the result socket), or None."""
    if not isinstance(r, StepResult) or r.step_id != plan.step_id:
        return f"not the result of step {plan.step_id}"
    n = len(r.request_ids)
    counts = r.num_sampled or [1] * n
    if len(counts) != n or min(counts, default=1) < 1 or sum(counts) != len(r.sampled_token_ids):
        return "sampled tokens do not match the request ids"
    if (
        (r.logprobs is not None and len(r.logprobs) != n)
        or len(r.draft_token_ids) != len(r.draft_request_ids)
        or (r.draft_parents and len(r.draft_parents) != len(r.draft_request_ids))
        or len(r.failed_request_ids) != len(r.failed_errors)
    ):
        return "per-request lists of different lengths"
    planned = {x.request_id for x in plan.new} | {x.request_id for x in plan.cached}
    if (
        not planned.issuperset(r.request_ids)
        or not planned.issuperset(r.pooled_request_ids)
        or not planned.issuperset(r.failed_request_ids)
    ):
        return "ids of requests the step did not schedule"
    return None


def pooled_rows(result: StepResult, frames: list) -> dict[str, memoryview]:
    """Zero-copy row views of a result's [N, dim] float32 pooled frame, by request id (the
    scheduler forwards the bytes as they are; it never imports torch)."""
    ref = result.pooled
    if ref is None:
        return {}
    n = len(result.pooled_request_ids)
    if ref.dtype != "float32" or len(ref.shape) != 2 or ref.shape[0] != n or not 0 < ref.index < len(frames):
        raise DecodeError(f"bad pooled tensor {ref} for {n} requests and {len(frames) - 1} extra frames")
    frame = frames[ref.index]
    buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")
    row = ref.shape[1] * 4
    if len(buf) != n * row:
        raise DecodeError(f"pooled frame has {len(buf)} bytes, expected {n * row}")
    return {rid: buf[i * row : (i + 1) * row] for i, rid in enumerate(result.pooled_request_ids)}


# A StepStats event covers every step of up to this long (and an idle engine's last steps at
# once): Prometheus scrapes every few seconds, so 50 ms of lag is invisible on a dashboard, while
# one event per 1-3 ms step cost the metrics actor and the scheduler ~0.5 ms of CPU a step
STATS_INTERVAL_S = 0.05
# ...and at most this many steps, or scheduled sequences or finished requests (bounds the event's
# size: fast steps of a large batch; the metrics actor refuses more than MAX_EVENT_STEPS steps or
# MAX_EVENT_REQUESTS requests in an event, and frames over its size limit)
STATS_MAX_STEPS = 512
STATS_MAX_SEQS = 1 << 16


class StepStatsPublisher:
    """Per-step stats for the metrics actor, coalesced: a step only appends its timeline and
    shapes here (microseconds); `flush` (every STATS_INTERVAL_S, when the engine goes idle, before
    it stops) sends one StepStats for all of them, reading gauges as they are and counters as
    deltas of the scheduler's running totals since the last flush, so no count or observation
    is lost or changed by the coalescing."""

    def __init__(self, sched: Scheduler, publish: Callable[[Any], None], log: Any):
        self.sched, self.publish, self.log = sched, publish, log
        self.last: tuple[int, ...] = (0,) * 8
        self.last_per_pos: list[int] = []
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.due = now + STATS_INTERVAL_S
        self.times: list[tuple[int, float, float, float, float, float, float, float]] = []
        self.forwards = 0
        self.prefill_q: list[int] = []
        self.prefill_kv: list[int] = []
        self.prefill_seqs: list[int] = []
        self.decode_q: list[int] = []
        self.decode_kv: list[int] = []
        self.decode_seqs: list[int] = []

    def __call__(self, step: Step, dropped: int) -> None:
        """Fold one finished step in (and flush when the interval is up or the batch is full)."""
        plan, result, shapes = step.plan, step.result, step.shapes
        assert result is not None
        rt, fwd, smp = step.roundtrip_s, result.forward_s, result.sample_s
        tokens = sum(plan.num_scheduled_tokens)
        if self.log.is_enabled_for(logging.DEBUG):
            self.log.debug(
                "step",
                step_id=plan.step_id,
                seqs=len(plan.num_scheduled_tokens),
                tokens=tokens,
                new=len(plan.new),
                schedule_ms=round(step.schedule_s * 1e3, 2),
                roundtrip_ms=round(rt * 1e3, 2),
                forward_ms=round(fwd * 1e3, 2),
                sample_ms=round(smp * 1e3, 2),
                update_ms=round(step.update_s * 1e3, 2),
            )
        ret = max(0.0, rt - step.send_s - fwd - smp)
        self.times.append((tokens, step.schedule_s, step.send_s, fwd, smp, ret, step.update_s, rt))
        self.forwards += plan.num_forwards
        self.prefill_q += shapes.prefill_q
        self.prefill_kv += shapes.prefill_kv
        self.prefill_seqs.append(len(shapes.prefill_kv))
        self.decode_q += shapes.decode_q
        self.decode_kv += shapes.decode_kv
        self.decode_seqs.append(len(shapes.decode_kv))
        if result.compile_s or result.compile_cache_hits:
            self.publish(CompileStats(seconds=result.compile_s, cache_hits=result.compile_cache_hits))
        seqs = len(self.prefill_kv) + len(self.decode_kv)  # one KV length per sequence and step
        full = len(self.times) >= STATS_MAX_STEPS or max(seqs, len(self.sched.finished_stats)) >= STATS_MAX_SEQS
        if full or time.monotonic() >= self.due:
            self.flush(dropped)

    def flush(self, dropped: int) -> None:
        """Send what has gathered since the last flush (nothing: no event)."""
        s = self.sched
        spec = s.spec.counters() if s.spec else (0, 0, 0, [])
        cur = (s.prompt_tokens, s.generation_tokens, s.num_preemptions, s.prefix_queries, s.prefix_hits, *spec[:3])
        if not (self.times or s.finished_stats or s.ttft or s.itl) and cur == self.last:
            return
        d = [a - b for a, b in zip(cur, self.last)]
        per_pos = [a - b for a, b in zip(spec[3], self.last_per_pos)]
        self.last, self.last_per_pos = cur, spec[3]
        tokens, sched_s, send_s, fwd, smp, ret, upd, rt = (
            (list(c) for c in zip(*self.times)) if self.times else ([],) * 8
        )
        self.publish(
            StepStats(
                num_running=len(s.running),
                num_waiting=len(s.waiting),
                kv_cache_usage=s.blocks.usage(),
                prompt_tokens=d[0],
                generation_tokens=d[1],
                num_preemptions=d[2],
                prefix_cache_queries=d[3],
                prefix_cache_hits=d[4],
                num_forwards=self.forwards,
                dropped=dropped,
                ttft_s=s.ttft,
                itl_s=s.itl,
                spec_drafts=d[5],
                spec_draft_tokens=d[6],
                spec_accepted_tokens=d[7],
                spec_accepted_per_pos=per_pos if any(per_pos) else [],
                num_tokens=tokens,
                schedule_s=sched_s,
                send_s=send_s,
                forward_s=fwd,
                sample_s=smp,
                return_s=ret,
                update_s=upd,
                roundtrip_s=rt,
                prefill_query_lens=self.prefill_q,
                prefill_kv_lens=self.prefill_kv,
                prefill_seqs=self.prefill_seqs if self.prefill_kv else [],
                decode_query_lens=self.decode_q if max(self.decode_q, default=1) > 1 else [],
                decode_kv_lens=self.decode_kv,
                decode_seqs=self.decode_seqs if self.decode_kv else [],
                finished=s.finished_stats,
            )
        )
        s.ttft, s.itl, s.finished_stats = [], [], []
        self._reset(time.monotonic())
