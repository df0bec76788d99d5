"""The default model: GGUF converted by our reader equals transformers' own GGUF loading."""

from __future__ import annotations

import os

import pytest
import torch

from axonserve.neuron.model_source import resolve_model
from axonserve.protocol.messages import SamplingParams

from .conftest import MiniScheduler, make_runner

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
N_NEW = 20


@pytest.fixture(scope="module")
def smollm2(hf_smollm2):
    """(converted dir, transformers model, tokenizer); the reference load is shared per session."""
    from transformers import AutoTokenizer

    d = resolve_model(None)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == d
    return d, hf_smollm2[0], AutoTokenizer.from_pretrained(d)


def test_converted_directory_is_complete(smollm2):
    d, ref, tok = smollm2
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(d, f)), f
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token_id == 2


def test_greedy_equals_transformers_gguf(smollm2):
    d, ref, tok = smollm2
    runner = make_runner(d, block_size=16, num_kv_blocks=64)
    assert runner.eos_token_ids == [2]
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    sched = MiniScheduler(runner, chunk=24)  # the long chat prompts prefill in two chunks
    for i, p in enumerate(prompts):
        sched.add(str(i), p, N_NEW, at_step=i, params=SamplingParams(temperature=0.0))
    got = sched.run()
    assert sched.chunked
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=N_NEW,
            )
        want = out[0, len(p) :].tolist()
        assert got[str(i)][: len(want)] == want, (tok.decode(got[str(i)]), tok.decode(want))
        assert len(want) == N_NEW or want[-1] == 2  # transformers stops at EOS; we run on
    assert "Paris" in tok.decode(got["0"])
