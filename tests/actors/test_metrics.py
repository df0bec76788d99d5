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
from axonserve.protocol.messages import GetMetrics, MetricsText, SamplingParams, StepStats


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
            labels = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()) if k != "model_name")
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
