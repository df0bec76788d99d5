"""Metrics actor end to end: stats events from the scheduler and every actor become
Prometheus metrics with vLLM's names, and a flood of events never stalls the step loop."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import zmq
import zmq.asyncio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from axonserve.actors.metrics import ITL_BUCKETS, STEP_PHASES, EngineMetrics
from axonserve.actors.supervisor import Supervisor
from axonserve.config import EngineConfig
from axonserve.frontends.client import AsyncEngineClient
from axonserve.protocol import Codec
from axonserve.protocol.messages import (
    BucketInfo,
    CompileStats,
    GetMetrics,
    MetricsText,
    RequestStats,
    SamplingParams,
    StepStats,
)


async def fetch_metrics(address: str) -> dict[str, float]:
    """sample name + sorted labels -> value, from the metrics actor over the bus."""
    ctx = zmq.asyncio.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(address)
    try:
        await s.send_multipart(Codec.encode(GetMetrics()))
        msg, _ = Codec(MetricsText).decode(await asyncio.wait_for(s.recv_multipart(), 10))
    finally:
        ctx.destroy(linger=0)
    return parse(msg.text)


def parse(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            # (engine="0": the one engine of these tests; data parallel runs are in test_data_parallel.py)
            labels = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()) if k not in ("model_name", "engine"))
            out[f"{smp.name}{{{labels}}}"] = smp.value
    return out


@pytest.mark.timeout(180)
async def test_engine_metrics_have_vllm_names_and_true_counts(tiny_llama_dir):
    sup = Supervisor(
        EngineConfig(
            model=tiny_llama_dir, num_kv_blocks=128, block_size=4, served_model_name="tiny", log_level="warning"
        ),
        frontend=False,
    )
    await sup.start()
    client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
    try:
        prefix = list(range(100, 124))  # 6 full blocks shared by every request

        async def one(i: int, n: int) -> int:
            got = 0
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            async for out in client.generate(prefix + [200 + i], params):
                got += len(out.token_ids)
            return got

        first = await one(0, 5)
        rest = await asyncio.gather(*(one(i, 3 + i) for i in range(1, 6)))
        total = first + sum(rest)
        await asyncio.sleep(0.5)  # events are asynchronous by design
        m = await fetch_metrics(sup.addresses.metrics)
    finally:
        client.close()
        await sup.stop("test done")
    assert m["vllm:generation_tokens_total{}"] == total == 5 + sum(3 + i for i in range(1, 6))
    assert m["vllm:prompt_tokens_total{}"] == 6 * 25
    assert m["vllm:request_success_total{finished_reason=length}"] == 6
    assert m["vllm:prefix_cache_hits_total{}"] >= 5 * 24
    assert m["vllm:prefix_cache_queries_total{}"] == 6 * 25
    assert m["vllm:time_to_first_token_seconds_count{}"] == 6
    assert m["vllm:inter_token_latency_seconds_count{}"] == total - 6
    assert m["vllm:e2e_request_latency_seconds_count{}"] == 6
    assert m["vllm:num_requests_running{}"] == 0
    for actor in ("scheduler", "worker-0", "metrics"):
        assert m[f"axonserve:actor_last_seen_timestamp_seconds{{actor={actor}}}"] > 0
    assert m["axonserve:step_phase_seconds_count{phase=forward}"] > 0


def test_metric_families_fold_events():
    em = EngineMetrics("m")
    em.apply(
        StepStats(
            num_running=3, num_waiting=1, kv_cache_usage=0.5, generation_tokens=7, ttft_s=[0.1], itl_s=[0.01, 0.02]
        )
    )
    m = parse(em.render())
    assert m["vllm:num_requests_running{}"] == 3 and m["vllm:kv_cache_usage_perc{}"] == 0.5
    assert m["vllm:generation_tokens_total{}"] == 7
    assert m["vllm:inter_token_latency_seconds_count{}"] == 2


def test_xla_compile_metrics():
    """Counters at 0 before any compile; each CompileStats adds its compiles, their times and
    cache hits; impossible values are refused (the actor drops the event)."""
    em = EngineMetrics("m")
    m = parse(em.render())
    assert m["axonserve:xla_compiles_total{}"] == 0 and m["axonserve:xla_compile_cache_hits_total{}"] == 0
    assert m["axonserve:xla_compile_seconds_count{}"] == 0
    em.apply(CompileStats(seconds=[0.04, 2.0, 300.0], cache_hits=5))  # start-up
    em.apply(CompileStats(seconds=[1.5]))  # a step that met a new shape
    em.apply(CompileStats(cache_hits=2))
    m = parse(em.render())
    assert m["axonserve:xla_compiles_total{}"] == 4
    assert m["axonserve:xla_compile_cache_hits_total{}"] == 7
    assert m["axonserve:xla_compile_seconds_count{}"] == 4
    assert m["axonserve:xla_compile_seconds_sum{}"] == pytest.approx(303.54)
    assert m["axonserve:xla_compile_seconds_bucket{le=0.05}"] == 1
    assert m["axonserve:xla_compile_seconds_bucket{le=2.5}"] == 3
    assert m["axonserve:xla_compile_seconds_bucket{le=600.0}"] == 4
    for bad in (CompileStats(seconds=[-1.0]), CompileStats(seconds=[float("nan")]), CompileStats(cache_hits=-1)):
        with pytest.raises(ValueError):
            em.apply(bad)
    assert parse(em.render())["axonserve:xla_compiles_total{}"] == 4


def test_shape_histograms_and_bucket_info():
    em = EngineMetrics("m")
    em.apply(
        StepStats(
            num_running=3,
            num_waiting=0,
            kv_cache_usage=0.1,
            prefill_query_lens=[20, 300],
            prefill_kv_lens=[36, 300],
        )
    )
    em.apply(StepStats(num_running=3, num_waiting=0, kv_cache_usage=0.1, decode_kv_lens=[50, 60, 70]))
    em.apply(BucketInfo(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512, block_size=16, decode_len=[512]))
    m = parse(em.render())
    assert m["axonserve:step_query_tokens_bucket{le=32.0,phase=prefill}"] == 1
    assert m["axonserve:step_query_tokens_sum{phase=prefill}"] == 320
    assert m["axonserve:step_query_tokens_sum{phase=decode}"] == 3  # one token each
    assert m["axonserve:step_kv_tokens_bucket{le=48.0,phase=prefill}"] == 1
    assert m["axonserve:step_batch_size_bucket{le=2.0,phase=prefill}"] == 1
    assert m["axonserve:step_batch_size_bucket{le=2.0,phase=decode}"] == 0
    assert m["axonserve:step_batch_size_bucket{le=3.0,phase=decode}"] == 1
    # the step's longest, once per row: both prefill rows at 300, the three decode rows at 70
    assert m["axonserve:step_max_query_tokens_bucket{le=288.0,phase=prefill}"] == 0
    assert m["axonserve:step_max_query_tokens_bucket{le=304.0,phase=prefill}"] == 2
    assert m["axonserve:step_max_kv_tokens_sum{phase=decode}"] == 210
    assert m["axonserve:step_max_kv_tokens_count{phase=decode}"] == 3
    info = [k for k in m if k.startswith("axonserve:buckets_info")]
    assert info == [
        "axonserve:buckets_info{block_size=16,context_batch=,context_len=,decode_batch=,decode_len=512,"
        "max_model_len=512,max_num_batched_tokens=512,max_num_seqs=8}"
    ]
    with pytest.raises(ValueError):
        em.apply(StepStats(num_running=0, num_waiting=0, kv_cache_usage=0, prefill_query_lens=[1], prefill_kv_lens=[]))
    with pytest.raises(ValueError):
        em.apply(StepStats(num_running=0, num_waiting=0, kv_cache_usage=0, decode_kv_lens=[-3]))


async def test_publish_never_blocks_and_counts_drops(tmp_path):
    """With no metrics actor reading, publishing 50k events returns at once and counts drops."""
    import time

    from axonserve.actors.runtime import Actor
    from axonserve.config import ActorSpec, Addresses

    spec = ActorSpec(kind="x", name="x", config=EngineConfig(model="none"), addresses=Addresses.in_dir(str(tmp_path)))
    actor = Actor(spec)
    ev = StepStats(num_running=1, num_waiting=0, kv_cache_usage=0.0)
    t0 = time.perf_counter()
    for _ in range(50_000):
        actor.publish(ev)
    assert time.perf_counter() - t0 < 5.0  # bounded by encoding, never by a reader
    assert actor.stats_dropped >= 50_000 - 10_000  # beyond the high-water mark: dropped
    actor.close()


# --------------------------------------------------------------------------- coalesced step stats


def _steps(seed: int, n: int) -> list[StepStats]:
    """n one-step StepStats events of mixed traffic: prefill chunks, decodes (some with several
    query tokens), latencies on bucket edges, a spec decoding delta, finished requests."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pk = [rng.randint(1, 3000) for _ in range(rng.choice((0, 0, 1, 3)))]
        dk = [rng.randint(1, 5000) for _ in range(rng.choice((0, 1, 7, 32)))]
        multi = rng.random() < 0.3
        out.append(
            StepStats(
                num_running=rng.randint(0, 64),
                num_waiting=rng.randint(0, 9),
                kv_cache_usage=rng.random(),
                prompt_tokens=sum(pk),
                generation_tokens=len(dk),
                num_preemptions=rng.randint(0, 1),
                prefix_cache_queries=rng.randint(0, 100),
                prefix_cache_hits=rng.randint(0, 50),
                num_forwards=rng.randint(1, 4),
                dropped=i,
                ttft_s=[rng.choice((0.01, 0.1, rng.random())) for _ in pk],
                itl_s=[rng.choice((0.025, 0.05, rng.random() / 10)) for _ in dk],
                spec_drafts=i % 2,
                spec_draft_tokens=3 * (i % 2),
                spec_accepted_tokens=i % 2,
                spec_accepted_per_pos=[i % 2, 0, 0],
                num_tokens=[sum(pk) + len(dk)],
                **{f"{p}_s": [rng.choice((1e-4, 2.5e-3, rng.random() / 100))] for p in STEP_PHASES},
                prefill_query_lens=[min(k, rng.randint(1, 512)) for k in pk],
                prefill_kv_lens=pk,
                prefill_seqs=[len(pk)],
                decode_query_lens=[rng.randint(1, 4) for _ in dk] if multi else [],
                decode_kv_lens=dk,
                decode_seqs=[len(dk)],
                finished=[RequestStats("length", rng.random() * 3, rng.random(), 30, 7, decode_s=0.5)] * (i % 3 == 0),
            )
        )
    return out


def _coalesce(steps: list[StepStats]) -> StepStats:
    """The steps as the scheduler's publisher sends them: one event, counters summed, gauges
    the last's, per-step lists concatenated (decode queries of one token each listed out once
    any step has several)."""
    last = steps[-1]
    cat = lambda f: [x for s in steps for x in getattr(s, f)]  # noqa: E731
    counters = [f for f in StepStats.__struct_fields__ if isinstance(getattr(last, f), int) and f != "dropped"]
    counters = [f for f in counters if f not in ("num_running", "num_waiting", "engine")]
    multi = any(s.decode_query_lens for s in steps)
    return StepStats(
        last.num_running,
        last.num_waiting,
        last.kv_cache_usage,
        dropped=last.dropped,
        **{f: sum(getattr(s, f) for s in steps) for f in counters},
        **{f: cat(f) for f in ("ttft_s", "itl_s", "num_tokens", "prefill_query_lens", "prefill_kv_lens")},
        **{f: cat(f) for f in ("prefill_seqs", "decode_kv_lens", "decode_seqs", "finished")},
        **{f"{p}_s": cat(f"{p}_s") for p in STEP_PHASES},
        spec_accepted_per_pos=[sum(x) for x in zip(*(s.spec_accepted_per_pos for s in steps))],
        decode_query_lens=[q for s in steps for q in (s.decode_query_lens or [1] * len(s.decode_kv_lens))]
        if multi
        else [],
    )


def _exposition(em: EngineMetrics) -> list[str]:
    """The rendered text but creation times and the count of events (which coalescing changes)."""
    lines = em.render().splitlines()
    return [ln for ln in lines if "_created" not in ln and not ln.startswith("axonserve:stats_events_total")]


def test_coalesced_steps_fold_exactly_like_one_by_one():
    """A burst of steps in one coalesced StepStats gives the very exposition (every counter,
    gauge, bucket, count and sum, to the last bit) that one event per step gives."""
    steps = _steps(0, 200)
    one_by_one, coalesced = EngineMetrics("m"), EngineMetrics("m")
    for ev in steps:
        one_by_one.apply(ev)
    for chunk in (steps[:1], steps[1:37], steps[37:]):
        coalesced.apply(_coalesce(chunk))
    assert _exposition(coalesced) == _exposition(one_by_one)
    m = parse(coalesced.render())
    assert m["axonserve:step_phase_seconds_count{phase=forward}"] == 200
    assert m["vllm:inter_token_latency_seconds_count{}"] == sum(len(s.itl_s) for s in steps)
    assert m["vllm:request_success_total{finished_reason=length}"] == 67
    assert m["axonserve:stats_events_total{}"] == 3


def test_observe_many_is_observe():
    """The bulk observe (numpy buckets, in-order sum) renders like prometheus' own observe, on
    bucket edges too (`le` is inclusive)."""
    from prometheus_client import CollectorRegistry, Histogram

    from axonserve.actors.metrics import observe_many

    values = [0.0, 0.01, 0.0100001, 0.025, 0.3, 0.1 + 0.2, 80.0, 81.0, 1e9, 0.049999, 0.05]
    texts = []
    for bulk in (False, True):
        r = CollectorRegistry()
        h = Histogram("x_seconds", "x", ["a"], buckets=ITL_BUCKETS, registry=r).labels("1")
        if bulk:
            observe_many([h], np.asarray(h._upper_bounds), np.asarray([values]))
        else:
            for v in values:
                h.observe(v)
        texts.append([ln for ln in generate_latest(r).decode().splitlines() if "_created" not in ln])
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_tokens=[1, 2], forward_s=[0.1]),  # per-step lists of different lengths
        dict(decode_kv_lens=[5, 6, 7], decode_seqs=[1, 1]),  # steps' sequences do not add up
        dict(decode_kv_lens=[5, 6], decode_seqs=[3, -1]),
        dict(prefill_query_lens=[1], prefill_kv_lens=[2**40], prefill_seqs=[1]),
        dict(itl_s=[0.1, float("nan")]),
        dict(ttft_s=[-1.0]),
        dict(num_tokens=[1], **{f"{p}_s": [float("inf")] for p in STEP_PHASES}),
        dict(num_tokens=[-1], **{f"{p}_s": [0.0] for p in STEP_PHASES}),
        dict(num_tokens=[1] * 5000, **{f"{p}_s": [0.0] * 5000 for p in STEP_PHASES}),  # too many steps
        dict(decode_kv_lens=[1] * 5000, decode_seqs=[1] * 5000),
        dict(generation_tokens=-3),
        dict(spec_drafts=1, spec_accepted_per_pos=[1] * 1000),
        dict(finished=[RequestStats("x" * 100, 1.0, 0.0, 1, 1)]),  # a label too long
        dict(finished=[RequestStats("stop", float("nan"), 0.0, 1, 1)]),
        dict(engine=10**6),
    ],
)
def test_impossible_step_stats_change_nothing(bad):
    """A malformed or impossible StepStats is refused whole (the actor drops it, counted)."""
    em = EngineMetrics("m")
    em.apply(_coalesce(_steps(1, 5)))
    before = _exposition(em)
    ok = dict(generation_tokens=1, ttft_s=[0.1], decode_kv_lens=[3], prefill_query_lens=[2], prefill_kv_lens=[2])
    with pytest.raises(ValueError):
        em.apply(StepStats(1, 0, 0.5, **{**ok, **bad}))
    assert _exposition(em) == before


@pytest.mark.timeout(180)
async def test_stats_of_an_idle_engine_last_steps_are_not_held(tiny_llama_dir):
    """The scheduler coalesces step stats; when the engine goes idle right after a request's last
    step they go out at once: a scrape soon after the request ends sees every token of it (the
    interval flush would never come: no step follows)."""
    sup = Supervisor(
        EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, block_size=4, served_model_name="t", log_level="warning"),
        frontend=False,
    )
    await sup.start()
    client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
    try:
        for n, rounds in ((4, 1), (9, 2)):  # the second: straight after the first's flush
            got = 0
            async for out in client.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
                got += len(out.token_ids)
            assert got == n
            deadline = asyncio.get_running_loop().time() + 5
            while True:
                m = await fetch_metrics(sup.addresses.metrics)
                if m.get("vllm:request_success_total{finished_reason=length}") == rounds:
                    break
                assert asyncio.get_running_loop().time() < deadline, f"request {rounds} not in /metrics in 5 s"
                await asyncio.sleep(0.02)
        assert m["vllm:generation_tokens_total{}"] == 4 + 9
        assert m["vllm:time_to_first_token_seconds_count{}"] == 2
        assert m["vllm:inter_token_latency_seconds_count{}"] == 3 + 8
        assert m["vllm:num_requests_running{}"] == 0
        steps = m["axonserve:step_phase_seconds_count{phase=roundtrip}"]
        assert steps == m["vllm:iteration_tokens_total_count{}"] >= 2 + 9 - 1
    finally:
        client.close()
        await sup.stop("test done")
