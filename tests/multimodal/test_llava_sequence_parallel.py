"""Sequence parallelism with image rows: tiny LLaVA on two ranks with `sequence_parallel`,
where the language model gets the embedded batch with image features merged in
(`inputs_embeds`, sliced into token shards), still gives transformers' greedy tokens."""

from __future__ import annotations

import pytest
from conftest import hf_llava_greedy
from transformers import AutoTokenizer

from axonserve.config import EngineConfig

from .test_llava_engine import CASES, N, render, run_engine


@pytest.mark.timeout(300)
async def test_llava_sequence_parallel_greedy_matches_transformers(tiny_llava_dir):
    config = EngineConfig(
        model=tiny_llava_dir,
        block_size=4,
        num_kv_blocks=400,
        max_num_batched_tokens=32,
        num_workers=2,
        sequence_parallel=True,
        sequence_parallel_threshold=16,  # the 32-token prefill chunks (image rows among them), not decodes
        log_level="warning",
    )
    got, stats, _ = await run_engine(config, CASES)
    tok = AutoTokenizer.from_pretrained(tiny_llava_dir)
    for (_ids, toks), messages in zip(got, CASES):
        text, imgs = render(tok, messages, "<image>")
        assert toks == hf_llava_greedy(tiny_llava_dir, text, imgs, N)[1]
    assert stats.sequence_parallel_forwards > 0
