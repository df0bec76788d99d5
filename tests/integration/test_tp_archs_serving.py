"""Served end to end through the OpenAI API on 2 and 4 worker ranks: Llama and Qwen3 (tensor
parallel) and Qwen3-MoE (tensor + expert parallel, tokens dispatched between the ranks by
all-to-all) give transformers' greedy text, for requests that share steps."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import hf_greedy, make_tiny_model
from frontends.server import serve

from axonserve.frontends.tokenizer import Tokenizer

from .test_faults import session_pids

PROMPTS = ("Once upon a time", "The capital of France is", "1, 2, 3,", "def fibonacci(n):")
N_NEW = 12


def served_texts(base_url: str) -> list[str]:
    def one(prompt: str) -> str:
        with httpx.Client(base_url=base_url, timeout=120) as http:
            r = http.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": N_NEW, "min_tokens": N_NEW, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: the requests share steps
        return list(pool.map(one, PROMPTS))


def transformers_texts(model_dir: str) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.load(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [tok.decode(hf_greedy(model, tok.encode(p), N_NEW)) for p in PROMPTS]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "arch, tp, flags",
    [
        ("Qwen3ForCausalLM", 2, ()),
        ("Qwen3MoeForCausalLM", 2, ("--enable-expert-parallel",)),
        ("LlamaForCausalLM", 4, ()),
        ("Qwen3MoeForCausalLM", 4, ("--enable-expert-parallel",)),
    ],
    ids=["qwen3-tp2", "qwen3moe-tp2-ep", "llama-tp4", "qwen3moe-tp4-ep"],
)
def test_ranks_serve_transformers_greedy(arch, tp, flags, tmp_path, smollm2_dir):
    model_dir = make_tiny_model(str(tmp_path), arch, tokenizer_dir=smollm2_dir)
    want = transformers_texts(model_dir)
    args = ("--num-kv-blocks", "128", "--served-model-name", "tiny", "--tensor-parallel-size", str(tp), *flags)
    with serve(model_dir, *args) as srv:
        workers = [c for c in session_pids(srv.proc.pid).values() if '"kind":"worker"' in c]
        assert len(workers) == tp
        if flags:
            assert all('"enable_expert_parallel":true' in c for c in workers)
        got = served_texts(srv.base_url)
    assert got == want
