"""Scheduler policy for pooling (embed) requests: whole prompts in one step, no KV blocks, no
prefix cache, finished with their vector's delta after that step; wrong-task requests refused."""

from __future__ import annotations

from axonserve.engine.request import Request
from axonserve.engine.scheduler import Scheduler, SchedulerConfig
from axonserve.protocol.messages import PoolingParams, SamplingParams, StepPlan, StepResult


def make(task="embed", budget=32, max_seqs=8, max_len=16, num_blocks=0) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            block_size=4,
            num_kv_blocks=num_blocks,
            vocab_size=100,
            eos_token_ids=frozenset({2}),
            task=task,
        )
    )


def embed_req(rid: str, n: int) -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=1), 16, pooling=PoolingParams())


def pooled(plan: StepPlan) -> StepResult:
    """What the worker answers: one vector for every scheduled (whole) request."""
    for nr, n in zip(plan.new, plan.num_scheduled_tokens):
        assert nr.pooling is not None and nr.num_computed_tokens == 0 and n == len(nr.token_ids)
        assert nr.block_ids == []
    assert plan.cached == []
    return StepResult(plan.step_id, pooled_request_ids=[nr.request_id for nr in plan.new])


def test_pooling_requests_run_whole_in_one_step_without_blocks():
    s = make(budget=32)
    for rid, n in [("a", 10), ("b", 16), ("c", 10), ("d", 3)]:
        assert s.check(embed_req(rid, n)) is None
        s.add(embed_req(rid, n))
    plan = s.schedule()
    # a (10) + b (16) fit the 32-token budget; c (10) does not and is never split: it waits
    # (first come, first served: d waits behind it)
    assert [nr.request_id for nr in plan.new] == ["a", "b"] and plan.num_scheduled_tokens == [10, 16]
    deltas = s.update(pooled(plan))
    assert [(d.request_id, d.finish_reason, d.num_prompt_tokens, d.new_token_ids) for d in deltas] == [
        ("a", "stop", 10, []),
        ("b", "stop", 16, []),
    ]
    assert set(s.requests) == {"c", "d"} and s.running == [] and s.blocks.usage() == 0.0
    plan = s.schedule()
    assert [nr.request_id for nr in plan.new] == ["c", "d"]
    assert sorted(plan.finished_request_ids) == ["a", "b"]  # worker state already gone: harmless
    s.update(pooled(plan))
    assert not s.has_work and s.generation_tokens == 0 and s.prompt_tokens == 39
    assert s.stats()["kv_cache_usage"] == 0.0 and len(s.ttft) == 4


def test_pooling_prompt_limits():
    s = make(max_len=16, budget=20)
    assert s.check(embed_req("full", 16)) is None  # an encoder may use every position
    why = s.check(embed_req("long", 17))
    assert why is not None and "16 tokens" in why and "17 input tokens" in why
    bad = Request("v", [5, 100], SamplingParams(), 16, pooling=PoolingParams())
    assert "vocabulary" in (s.check(bad) or "")
    small = make(max_len=16, budget=8)
    assert "never split" in (small.check(embed_req("x", 9)) or "")


def test_wrong_task_requests_are_refused():
    gen = Request("g", [10, 11, 12], SamplingParams(max_tokens=4), 16)
    assert "does not generate text" in (make("embed").check(gen) or "")
    assert "does not produce embeddings" in (make("generate", num_blocks=16).check(embed_req("e", 3)) or "")


def test_aborted_pooling_request_in_flight_gets_no_second_delta():
    s = make()
    s.add(embed_req("a", 5))
    plan = s.schedule()
    aborted = s.abort(["a"])
    assert [r.request_id for r in aborted] == ["a"]
    assert s.update(pooled(plan)) == []
    assert not s.has_work
