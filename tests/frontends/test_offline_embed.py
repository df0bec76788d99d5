"""Offline `LLM(...).embed(prompts)` on the real all-MiniLM-L6-v2 through the engine processes:
vectors equal transformers + mean pooling + normalize (1e-5), in input order; the wrong task
fails clearly, before (task flag) or without (generate) touching the engine."""

from __future__ import annotations

import pytest
import torch
from embedding_reference import hf_encoder, minilm_dir, st_embed

from axonserve import LLM, SamplingParams
from axonserve.protocol.messages import ParamError, PoolingParams

TEXTS = ["Offline embeddings, vLLM style.", "Hello world", "x", "Paris is the capital of France."]


@pytest.mark.timeout(180)
def test_llm_embed_matches_transformers():
    tok = hf_encoder(minilm_dir())[1]
    with LLM("all-MiniLM-L6-v2", log_level="warning") as llm:
        outs = llm.embed(TEXTS)
        by_ids = llm.embed([tok.encode(t) for t in TEXTS[:2]])
        raw = llm.embed(TEXTS[1], PoolingParams(normalize=False))
        with pytest.raises(ParamError, match="embedding model.*Completions API"):
            llm.generate("hello", SamplingParams(max_tokens=2))
        with pytest.raises(ParamError, match="512 tokens.*600 tokens"):
            llm.embed([[101] + [2088] * 598 + [102]])
    got = torch.tensor([o.outputs.embedding for o in outs])
    torch.testing.assert_close(got, st_embed(minilm_dir(), TEXTS), atol=1e-5, rtol=0)
    assert [o.prompt for o in outs] == TEXTS and outs[1].prompt_token_ids == tok.encode(TEXTS[1])
    assert outs[0].outputs.hidden_size == 384
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in by_ids]), got[:2], atol=1e-6, rtol=0)
    torch.testing.assert_close(
        torch.tensor(raw[0].outputs.embedding),
        st_embed(minilm_dir(), TEXTS[1:2], normalize=False)[0],
        atol=1e-5,
        rtol=0,
    )


def test_llm_refuses_a_task_the_model_cannot_serve():
    with pytest.raises(ValueError, match="serves only the embed task"):
        LLM("all-MiniLM-L6-v2", task="generate")
