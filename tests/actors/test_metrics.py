"""Metrics actor end to end: stats events from the scheduler and every actor become
Prometheus metrics with vLLM's names, and a flood of events never stalls the step loop."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from axonserve.actors.metrics import EngineMetrics
from axonserve.actors.supervisor import Supervisor
from axonserve.config import EngineConfig
from axonserve.frontends.client import AsyncEngineClient
from axonserve.protocol import Codec
from axonserve.protocol.messages import (
    BucketInfo,
    CompileStats,
    GetMetrics,
    MetricsText,
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
