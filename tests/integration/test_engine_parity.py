"""Greedy output of the whole engine (supervisor, scheduler and worker processes, ZMQ client)
equals transformers' `generate` token for token, for prompts of mixed lengths that arrive at
different times and share steps (small blocks and a small token budget force chunked
prefill, block-boundary crossings and mixed prefill+decode steps)."""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import hf_greedy

from axonserve.actors.supervisor import Supervisor
from axonserve.config import EngineConfig
from axonserve.frontends.client import AsyncEngineClient
from axonserve.protocol.messages import SamplingParams


async def run_staggered(
    config: EngineConfig, prompts: list[list[int]], n: int, stats: list | None = None
) -> list[list[int]]:
    """Each prompt's n greedy tokens; `stats` (if given) gets the engine's EngineStats after."""
    sup = Supervisor(config, frontend=False)
    await sup.start()
    client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)

        async def one(i: int, ids: list[int]) -> list[int]:
            await asyncio.sleep(0.05 * i)  # arrive while earlier requests are decoding
            toks: list[int] = []
            async for out in client.generate(ids, params):
                assert out.error is None, out.error
                toks.extend(out.token_ids)
            return toks

        got = await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), 240)
        if stats is not None:
            stats.append(await client.get_stats())
        return got
    finally:
        client.close()
        await sup.stop("test done")


@pytest.mark.timeout(300)
async def test_tiny_llama_greedy_matches_transformers(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(length)] for length in (1, 5, 17, 40, 9, 63)]
    config = EngineConfig(
        model=tiny_llama_dir,
        block_size=4,
        num_kv_blocks=200,
        max_num_batched_tokens=24,  # forces chunked prefill for the longer prompts
        log_level="warning",
    )
    got = await run_staggered(config, prompts, n=12)
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    want = [hf_greedy(ref_model, p, 12) for p in prompts]
    assert got == want


@pytest.mark.timeout(600)
async def test_smollm2_gguf_greedy_matches_transformers(smollm2_dir, hf_smollm2):
    model, tok = hf_smollm2
    chats = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in one sentence what a CPU cache is.",
    ]
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True) for c in chats]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    prompts.append(tok.encode("The quick brown fox"))
    config = EngineConfig(
        model=smollm2_dir, block_size=16, num_kv_blocks=256, max_num_batched_tokens=64, log_level="warning"
    )
    got = await run_staggered(config, prompts, n=20)
    want = [hf_greedy(model, p, 20) for p in prompts]
    assert got == want
