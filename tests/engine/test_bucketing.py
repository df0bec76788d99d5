"""Neuron bucketing mode end to end on CPU: every step padded to a static bucket shape.

Greedy outputs must equal transformers' (and so the normal mode's) for mixed lengths,
staggered arrivals, prefix hits, chunked prefill and a tiny KV pool (preemption); the
shapes the workers ran must all be configured buckets, and their number is reported.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import hf_greedy

from axonserve.actors.supervisor import Supervisor
from axonserve.config import EngineConfig
from axonserve.engine.buckets import BucketConfig
from axonserve.frontends.client import AsyncEngineClient
from axonserve.protocol.messages import SamplingParams

N_NEW = 10
BUCKETS = dict(
    context_batch_buckets=[1, 2, 4],
    context_len_buckets=[8, 16, 32],
    decode_batch_buckets=[1, 2, 4, 8],
    decode_len_buckets=[32, 64, 128],
)


def workload() -> list[list[int]]:
    """Mixed lengths (1..61 tokens), a shared 2-block+ prefix, one repeated prompt."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 49152) for _ in range(21)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(k)] for k in (1, 9, 40)]
    prompts += [[rng.randrange(3, 49152) for _ in range(k)] for k in (1, 2, 33, 7, 16, 5)]
    prompts.append(list(prompts[1]))  # fully cached but for the last token
    return prompts


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return [hf_greedy(model, p, N_NEW) for p in workload()]


def test_runner_in_process_matches_reference_and_stays_in_buckets(tiny_llama_dir, reference):
    """The real Scheduler driving a real ModelRunner in one process (no bus): fast parity."""
    from axonserve.engine.request import Request
    from axonserve.engine.scheduler import Scheduler, SchedulerConfig
    from axonserve.neuron.model_runner import ModelRunner

    cfg = EngineConfig(
        model=tiny_llama_dir,
        block_size=4,
        num_kv_blocks=24,
        threads=1,
        bucketing=True,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        **BUCKETS,
    )
    runner = ModelRunner(cfg)
    assert runner.max_model_len == 128  # capped at the largest KV-length bucket
    b = BucketConfig.from_engine_config(cfg, runner.max_model_len)
    assert b == runner.buckets
    s = Scheduler(
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=24,
            max_model_len=runner.max_model_len,
            block_size=4,
            num_kv_blocks=runner.num_kv_blocks,
            vocab_size=runner.vocab_size,
            eos_token_ids=frozenset(runner.eos_token_ids),
            buckets=b,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, min_tokens=N_NEW)
    pending = list(enumerate(workload()))
    outs: dict[str, list[int]] = {}
    step = 0
    while pending or s.has_work:
        while pending and pending[0][0] <= step // 3:  # a new arrival every 3 steps
            i, p = pending.pop(0)
            r = Request(f"r{i}", p, params, runner.max_model_len)
            assert s.check(r) is None
            s.add(r)
        plan = s.schedule()
        step += 1
        if plan is None:
            continue
        res = runner.execute(plan)
        assert res.error is None, res.error
        for d in s.update(res):
            outs.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert [outs[f"r{i}"] for i in range(len(reference))] == reference
    assert s.num_preemptions > 0  # 24 blocks of 4 cannot hold every sequence at once
    assert s.shapes == runner.shapes and all(b.contains(x) for x in s.shapes), s.shapes
    assert {x[0] for x in s.shapes} == {"decode", "prefill"}


CASES = {
    "staggered": dict(num_kv_blocks=400, max_num_batched_tokens=32),
    "tiny_pool": dict(num_kv_blocks=24, max_num_batched_tokens=16),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
async def test_engine_outputs_identical_with_bucketing(tiny_llama_dir, reference, case):
    kw = dict(block_size=4, max_num_seqs=8, bucketing=True, log_level="warning") | BUCKETS | CASES[case]
    config = EngineConfig(model=tiny_llama_dir, **kw)
    sup = Supervisor(config, frontend=False)
    await sup.start()
    client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
    try:
        prompts = workload()
        params = SamplingParams(temperature=0.0, max_tokens=N_NEW, min_tokens=N_NEW)
        stagger = 0.0 if case == "tiny_pool" else 0.02

        async def one(i: int, ids: list[int]) -> list[int]:
            await asyncio.sleep(stagger * i)
            toks: list[int] = []
            async for out in client.generate(ids, params):
                assert out.error is None, out.error
                toks += out.token_ids
            return toks

        got = [await one(0, prompts[0])]  # warms the prefix cache
        got += await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts[1:]))), 90)
        stats = await client.get_stats()
    finally:
        client.close()
        await sup.stop("test done")
    assert got == reference
    b = BucketConfig.from_engine_config(config, 128)
    shapes = {tuple(x) for x in stats.shapes}
    assert stats.num_shapes == len(shapes) > 0
    assert all(b.contains(x) for x in shapes), (shapes, b)
    assert {x[0] for x in shapes} == {"decode", "prefill"}
    assert stats.prefix_cache_hits >= 20, stats
    if case == "tiny_pool":
        assert stats.num_preemptions > 0, stats
