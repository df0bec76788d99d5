"""The offline API, vLLM style: `LLM(...).generate(prompts, SamplingParams)` runs the real
engine processes and returns outputs in input order, greedy-equal to transformers."""

from __future__ import annotations

import pytest
from conftest import hf_greedy

from axonserve import LLM, SamplingParams


@pytest.mark.timeout(180)
def test_llm_generate_matches_transformers(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = ["Hello there", "The capital of France is", "1, 2, 3, 4,"]
    with LLM(tiny_llama_dir, num_kv_blocks=128, log_level="warning") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
        seeded = [llm.generate("Hi", SamplingParams(temperature=1.0, seed=7, max_tokens=6))[0] for _ in range(2)]
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(ref, ids, 8)
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    assert seeded[0].outputs[0].token_ids == seeded[1].outputs[0].token_ids


@pytest.mark.timeout(180)
def test_stop_strings_inside_a_multi_step_delta(tiny_llama_dir):
    """With 6 steps a plan a stop string usually lands inside a delta of several tokens: the text,
    the tokens kept and the finish reason equal single-step decoding's."""
    prompts = ["Hello there", "The capital of France is", "1, 2, 3, 4,"]
    free = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    got = {}
    for steps in (1, 6):
        with LLM(tiny_llama_dir, num_kv_blocks=128, log_level="warning", num_scheduler_steps=steps) as llm:
            if steps == 1:  # a stop string from the middle of each free-running text
                texts = [o.outputs[0].text for o in llm.generate(prompts, free)]
                stops = [t[len(t) // 2 : len(t) // 2 + 3] for t in texts]
                assert all(s.strip() for s in stops), stops
            outs = [
                llm.generate(p, SamplingParams(temperature=0, max_tokens=24, stop=[s]))[0].outputs[0]
                for p, s in zip(prompts, stops)
            ]
            got[steps] = [(o.text, o.token_ids, o.finish_reason) for o in outs]
    assert got[6] == got[1]
    assert all(reason == "stop" and len(ids) < 24 for _, ids, reason in got[1]), got[1]
