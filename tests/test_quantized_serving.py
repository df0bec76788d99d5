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
        config = EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, quantization="int8", dtype="bfloat16",
                              kv_cache_dtype=kv)
        with LLM(config=config) as llm:
            outs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [len(t) for t in outs["int8"]] == [12, 12, 12]
    assert [t[0] for t in outs["int8"]] == [t[0] for t in outs["auto"]]


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="m", dtype="bfloat16", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="int8 KV cache"):
        EngineConfig(model="m", dtype="bfloat16", kv_cache_dtype="int8", role="prefill")
