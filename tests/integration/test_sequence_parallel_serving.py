"""Sequence parallelism through the whole engine (supervisor, scheduler, two gloo worker
ranks): a 2,048-token prompt's greedy tokens equal transformers' with and without
`sequence_parallel`, prefilled in one step or in chunks (some below the threshold), and the
engine's counters show the sequence-parallel forwards ran (and none with it off)."""

from __future__ import annotations

import random

import pytest
from conftest import hf_greedy, make_tiny_llama

from axonserve.config import EngineConfig

from .test_engine_parity import run_staggered

N = 8


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory, smollm2_dir) -> str:
    """The tiny test decoder (4 query / 2 KV heads: they split over 2 ranks) with room for 2,048 + N."""
    return make_tiny_llama(str(tmp_path_factory.mktemp("long-llama")), smollm2_dir, max_position_embeddings=2112)


@pytest.fixture(scope="module")
def prompts_and_reference(long_llama_dir) -> tuple[list[list[int]], list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    rng = random.Random(32)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (2048, 37)]
    model = AutoModelForCausalLM.from_pretrained(long_llama_dir, dtype=torch.float32).eval()
    return prompts, [hf_greedy(model, p, N) for p in prompts]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "sp, budget, threshold",
    [
        (False, 2048, 1024),  # plain tensor parallelism: the baseline
        (True, 2048, 1024),  # the 2,048-token prompt in one sequence-parallel step
        (True, 500, 256),  # chunked: 500-token steps run sequence-parallel, the 48-token tail does not
    ],
    ids=["tp2", "tp2-sp-one-step", "tp2-sp-chunked"],
)
async def test_long_prompt_greedy_matches_transformers(long_llama_dir, prompts_and_reference, sp, budget, threshold):
    prompts, want = prompts_and_reference
    config = EngineConfig(
        model=long_llama_dir,
        num_workers=2,
        sequence_parallel=sp,
        sequence_parallel_threshold=threshold,
        max_num_batched_tokens=budget,
        block_size=16,
        num_kv_blocks=200,
        log_level="warning",
    )
    stats: list = []
    got = await run_staggered(config, prompts, n=N, stats=stats)
    assert got == want
    ran = stats[0].sequence_parallel_forwards
    if not sp:
        assert ran == 0
    elif budget >= 2048:
        assert ran >= 1, stats[0]
    else:
        assert ran >= 4, stats[0]  # 2,048 tokens in 500-token chunks: 4 at least
