"""Scheduler features end to end (real processes): prefix caching, chunked prefill, preemption,
batch size 1, async scheduling, multi-step decoding — alone and together — never change greedy
outputs (transformers reference)."""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import hf_greedy

from axonserve.actors.supervisor import Supervisor
from axonserve.config import EngineConfig
from axonserve.frontends.client import AsyncEngineClient
from axonserve.protocol.messages import SamplingParams

N_NEW = 10


def workload() -> list[list[int]]:
    """Mixed lengths; several share a 2-block+ system prefix, one repeats a whole prompt."""
    rng = random.Random(1)
    shared = [rng.randrange(3, 49152) for _ in range(37)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(k)] for k in (1, 6, 19, 3)]
    prompts += [[rng.randrange(3, 49152) for _ in range(k)] for k in (2, 45, 11)]
    prompts.append(list(prompts[1]))  # identical prompt: fully cached but for the last token
    return prompts


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return [hf_greedy(model, p, N_NEW) for p in workload()]


CASES = {
    "all_on": dict(max_num_batched_tokens=32),
    "prefix_off_chunk_off": dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=128),
    "chunk_only": dict(enable_prefix_caching=False, max_num_batched_tokens=8),
    "batch1_prefix": dict(max_num_seqs=1),  # the vllm-neuron "prefix caching at bs=1" defect
    "tiny_pool_preemption": dict(num_kv_blocks=20, max_num_batched_tokens=16),
    "priority_tiny_pool": dict(num_kv_blocks=20, scheduling_policy="priority"),
    # plans made a step ahead: preemptions of requests whose step is still running
    "async_tiny_pool_preemption": dict(num_kv_blocks=20, max_num_batched_tokens=16, async_scheduling=True),
    "async_all_on": dict(max_num_batched_tokens=32, async_scheduling=True),
    # multi-step decoding: plans of up to 4 forwards, preemptions between them
    "multistep_all_on": dict(max_num_batched_tokens=32, num_scheduler_steps=4),
    "multistep_tiny_pool_preemption": dict(num_kv_blocks=20, max_num_batched_tokens=16, num_scheduler_steps=4),
    "multistep_async_tiny_pool": dict(
        num_kv_blocks=20, max_num_batched_tokens=16, num_scheduler_steps=4, async_scheduling=True
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
async def test_outputs_identical_under_each_feature(tiny_llama_dir, reference, case):
    kw = dict(num_kv_blocks=400, block_size=4, log_level="warning") | CASES[case]
    sup = Supervisor(EngineConfig(model=tiny_llama_dir, **kw), frontend=False)
    await sup.start()
    client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
    try:
        prompts = workload()
        params = SamplingParams(temperature=0.0, max_tokens=N_NEW, min_tokens=N_NEW)

        stagger = 0.0 if "tiny_pool" in case else 0.03  # all at once: decodes outgrow the pool

        async def one(i: int, ids: list[int]) -> list[int]:
            await asyncio.sleep(stagger * i)
            toks: list[int] = []
            async for out in client.generate(ids, params):
                assert out.error is None, out.error
                toks += out.token_ids
            return toks

        # sequential first request warms the cache so later ones hit it
        got = [await one(0, prompts[0])]
        got += await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts[1:]))), 240)
        stats = await client.get_stats()
    finally:
        client.close()
        await sup.stop("test done")
    assert got == reference
    if kw.get("enable_prefix_caching", True):
        assert stats.prefix_cache_hits >= 36, stats  # the shared prefix blocks, at least
    else:
        assert stats.prefix_cache_hits == 0
    if "tiny_pool" in case:
        assert stats.num_preemptions > 0, stats
    if "multistep" in case:
        assert stats.num_forwards > stats.num_steps, stats  # some plans ran several forwards


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_a_burst_on_an_uncached_prefix_shares_it_within_a_plan(tiny_llama_dir, reference, async_scheduling):
    """Every prompt at once on a cold cache: the prompts after the first of the shared prefix reuse
    its blocks from the plan that computes them (engine/scheduler.py `_publish`: the forward writes
    every row's K/V before any row attends), and greedy outputs stay transformers'."""
    kw = dict(num_kv_blocks=400, block_size=4, max_num_batched_tokens=512, log_level="warning")
    sup = Supervisor(EngineConfig(model=tiny_llama_dir, async_scheduling=async_scheduling, **kw), frontend=False)
    await sup.start()
    client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=N_NEW, min_tokens=N_NEW)
        outs = [client.generate(ids, params) for ids in workload()]

        async def collect(stream) -> list[int]:
            toks: list[int] = []
            async for out in stream:
                assert out.error is None, out.error
                toks += out.token_ids
            return toks

        got = await asyncio.wait_for(asyncio.gather(*(collect(o) for o in outs)), 240)
        stats = await client.get_stats()
    finally:
        client.close()
        await sup.stop("test done")
    assert got == reference
    assert stats.prefix_cache_hits >= 3 * 36, stats  # the three followers' shared blocks, at least


@pytest.mark.timeout(300)
async def test_decodes_progress_during_a_long_chunked_prefill(tiny_llama_dir):
    """A 1,800-token prompt prefills in 64-token chunks while a running stream keeps decoding."""
    sup = Supervisor(
        EngineConfig(
            model=tiny_llama_dir, num_kv_blocks=600, block_size=4, max_num_batched_tokens=64, log_level="warning"
        ),
        frontend=False,
    )
    await sup.start()
    client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
    try:
        events: list[str] = []
        long_prompt = [random.Random(2).randrange(3, 49152) for _ in range(1800)]
        started = asyncio.Event()

        async def streamer():
            p = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
            async for _out in client.generate([5, 6, 7], p):
                events.append("a")
                if len(events) == 3:
                    started.set()

        async def long_one():
            await started.wait()
            events.append("B-submitted")
            async for _out in client.generate(long_prompt, SamplingParams(temperature=0, max_tokens=2)):
                events.append("B")

        await asyncio.wait_for(asyncio.gather(streamer(), long_one()), 240)
    finally:
        client.close()
        await sup.stop("test done")
    during = events[events.index("B-submitted") : events.index("B")]
    # 1800/64 ≈ 29 prefill steps, each also decoding the running stream (decode first)
    assert during.count("a") >= 20, during.count("a")


@pytest.mark.timeout(300)
async def test_multi_step_sampling_equals_single_step(tiny_llama_dir):
    """Seeded sampling with penalties and min_tokens (the sampler's general path, which reads each
    request's tokens so far) gives the same tokens whether a plan runs 1 or 6 forwards: the
    worker feeds every sampled token back before the next forward."""
    params = [
        SamplingParams(
            temperature=0.9,
            top_p=0.9,
            seed=7 + i,
            max_tokens=24,
            min_tokens=20,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.3,
        )
        for i in range(3)
    ]
    params.append(SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.5))
    prompts = [[5 + i, 17, 900 + i, 33] for i in range(4)]
    got = {}
    for steps in (1, 6):
        sup = Supervisor(
            EngineConfig(
                model=tiny_llama_dir, num_kv_blocks=200, block_size=4, log_level="warning", num_scheduler_steps=steps
            ),
            frontend=False,
        )
        await sup.start()
        client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
        try:

            async def one(ids: list[int], p: SamplingParams, client=client) -> list[int]:
                toks: list[int] = []
                async for out in client.generate(ids, p):
                    assert out.error is None, out.error
                    toks += out.token_ids
                return toks

            got[steps] = await asyncio.wait_for(asyncio.gather(*(one(x, p) for x, p in zip(prompts, params))), 120)
            stats = await client.get_stats()
        finally:
            client.close()
            await sup.stop("test done")
        assert (stats.num_forwards > stats.num_steps) == (steps > 1), stats
    assert got[6] == got[1]
    assert all(len(t) >= 20 for t in got[1])
