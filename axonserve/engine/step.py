"""One engine step as the core's loop sees it, and what is checked and published about it.

`Step` is the typed record of a plan on its way: scheduled, sent to the ranks, its result
received and folded into the scheduler's state, its outputs emitted, its stats published.
"""

from __future__ import annotations

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


class StepStatsPublisher:
    """Per-step stats for the metrics actor: gauges as they are, counters as deltas since the
    last step (the scheduler keeps running totals)."""

    def __init__(self, sched: Scheduler, publish: Callable[[Any], None], log: Any):
        self.sched, self.publish, self.log = sched, publish, log
        self.last: tuple[int, ...] = (0,) * 8
        self.last_per_pos: list[int] = []

    def __call__(self, step: Step, dropped: int) -> None:
        s, plan, result = self.sched, step.plan, step.result
        assert result is not None
        spec = s.spec.counters() if s.spec else (0, 0, 0, [])
        cur = (s.prompt_tokens, s.generation_tokens, s.num_preemptions, s.prefix_queries, s.prefix_hits, *spec[:3])
        d = [a - b for a, b in zip(cur, self.last)]
        per_pos = [a - b for a, b in zip(spec[3], self.last_per_pos)]
        self.last, self.last_per_pos = cur, spec[3]
        rt = step.roundtrip_s
        shapes = step.shapes
        self.log.debug(
            "step",
            step_id=plan.step_id,
            seqs=len(plan.num_scheduled_tokens),
            tokens=sum(plan.num_scheduled_tokens),
            new=len(plan.new),
            schedule_ms=round(step.schedule_s * 1e3, 2),
            roundtrip_ms=round(rt * 1e3, 2),
            forward_ms=round(result.forward_s * 1e3, 2),
            sample_ms=round(result.sample_s * 1e3, 2),
            update_ms=round(step.update_s * 1e3, 2),
        )
        self.publish(
            StepStats(
                num_running=len(s.running),
                num_waiting=len(s.waiting),
                kv_cache_usage=s.blocks.usage(),
                num_seqs=len(plan.num_scheduled_tokens),
                num_tokens=sum(plan.num_scheduled_tokens),
                prompt_tokens=d[0],
                generation_tokens=d[1],
                num_preemptions=d[2],
                prefix_cache_queries=d[3],
                prefix_cache_hits=d[4],
                schedule_s=step.schedule_s,
                roundtrip_s=rt,
                forward_s=result.forward_s,
                sample_s=result.sample_s,
                update_s=step.update_s,
                ttft_s=s.ttft,
                itl_s=s.itl,
                dropped=dropped,
                send_s=step.send_s,
                return_s=max(0.0, rt - step.send_s - result.forward_s - result.sample_s),
                spec_drafts=d[5],
                spec_draft_tokens=d[6],
                spec_accepted_tokens=d[7],
                spec_accepted_per_pos=per_pos if any(per_pos) else [],
                num_forwards=plan.num_forwards,
                prefill_query_lens=shapes.prefill_q,
                prefill_kv_lens=shapes.prefill_kv,
                decode_query_lens=shapes.decode_q if max(shapes.decode_q, default=1) > 1 else [],
                decode_kv_lens=shapes.decode_kv,
            )
        )
        if result.compile_s or result.compile_cache_hits:
            self.publish(CompileStats(seconds=result.compile_s, cache_hits=result.compile_cache_hits))
        s.ttft, s.itl = [], []
        for ev in s.finished_stats:
            self.publish(ev)
        s.finished_stats = []
