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
