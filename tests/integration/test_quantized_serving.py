"""`--quantization int8|int4` end to end: the offline LLM over the real scheduler and worker processes."""

from __future__ import annotations

import pytest

from axonserve.config import EngineConfig
from axonserve.frontends.offline import LLM
from axonserve.protocol.messages import SamplingParams


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_served_through_the_engine(tiny_llama_dir, method):
    """Packed low-bit weights serve requests to their full length."""
    config = EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, quantization=method, dtype="bfloat16")
    with LLM(config=config) as llm:
        outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]


def test_int8_kv_cache_served_through_the_engine(tiny_llama_dir):
    """--kv-cache-dtype int8 (with int8 weights too): requests run to their full length, and greedy
    output starts as the bf16 cache's does (the first token reads the unquantized prompt K/V)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9], list(range(10, 50))]
    outs = {}
    for kv in ("auto", "int8"):
        config = EngineConfig(
            model=tiny_llama_dir, num_kv_blocks=64, quantization="int8", dtype="bfloat16", kv_cache_dtype=kv
        )
        with LLM(config=config) as llm:
            outs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [len(t) for t in outs["int8"]] == [12, 12, 12]
    assert [t[0] for t in outs["int8"]] == [t[0] for t in outs["auto"]]


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="m", dtype="bfloat16", kv_cache_dtype="fp9")
    with pytest.raises(ValueError, match="int8 KV cache"):
        EngineConfig(model="m", dtype="bfloat16", kv_cache_dtype="int8", role="prefill")


@pytest.mark.timeout(300)
async def test_eagle_with_int8_weights_drafts_with_an_int8_head(smollm2_dir):
    """-q int8 with EAGLE: the shipped head is packed as int8 too (half the bytes a draft step
    reads) and its drafts are still accepted at the bf16 head's rate (0.32 vs 0.33 a draft here, k=2)."""
    import asyncio

    from axonserve.actors.supervisor import Supervisor
    from axonserve.config import SpeculativeConfig
    from axonserve.frontends.client import AsyncEngineClient
    from axonserve.frontends.tokenizer import Tokenizer

    tok = Tokenizer.load(smollm2_dir)
    prompts = [
        tok.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in ("Explain how rainbows form.", "Write a short poem about the sea.", "What is the capital of France?")
    ]
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    config = EngineConfig(
        model=smollm2_dir,
        served_model_name="SmolLM2-135M-Instruct",
        dtype="bfloat16",
        quantization="int8",
        speculative=spec,
        num_kv_blocks=256,
        log_level="warning",
    )
    sup = Supervisor(config, frontend=False)
    await sup.start()
    client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        for ids in prompts:  # one at a time: below disable_by_batch_size
            toks = []
            async for out in client.generate(ids, params):
                assert out.error is None, out.error
                toks += out.token_ids
            assert len(toks) == 48
        stats = await asyncio.wait_for(client.get_stats(), 30)
    finally:
        client.close()
        await sup.stop("test done")
    assert stats.spec_draft_tokens > 0
    assert stats.spec_accepted_tokens / stats.spec_draft_tokens > 0.2, stats  # a broken head: ~0
