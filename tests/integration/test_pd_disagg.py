"""Prefill/decode disaggregation (`role="decode"`): a prefill engine (its own scheduler and
worker process) computes each prompt and its first token, the prompt's KV moves block by
block over the bus into the decode worker's blocks, and decoding continues there. Greedy
output equals transformers' (and so the combined engine's) token for token, for text
prompts of mixed lengths (chunked prefill, block-boundary crossings, preemption-free) and for
LLaVA prompts with images."""

from __future__ import annotations

import random

import pytest
from conftest import hf_greedy
from multimodal.test_llava_engine import CASES, N, render, run_engine

from axonserve.config import EngineConfig

from .test_engine_parity import run_staggered


@pytest.mark.timeout(300)
@pytest.mark.parametrize("steps", [1, 4], ids=["single-step", "multi-step"])
async def test_pd_text_greedy_matches_transformers(tiny_llama_dir, steps):
    import torch
    from transformers import AutoModelForCausalLM

    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(length)] for length in (1, 4, 5, 17, 40, 63)]
    config = EngineConfig(
        model=tiny_llama_dir,
        role="decode",
        block_size=4,
        num_kv_blocks=200,
        max_num_batched_tokens=24,
        log_level="warning",
        threads=1,
        num_scheduler_steps=steps,
    )
    stats: list = []
    got = await run_staggered(config, prompts, n=10, stats=stats)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    assert got == [hf_greedy(ref, p, 10) for p in prompts]
    # the decode engine admitted every request with imported KV: it looked up no prompt
    # token in its prefix cache (the combined engine looks up every one)
    assert stats[0].prompt_tokens > 0 and stats[0].prefix_cache_queries == 0
    assert (stats[0].num_forwards > stats[0].num_steps) == (steps > 1)  # decode plans of several forwards


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "encoders,steps", [(0, 1), (2, 1), (0, 4)], ids=["prefill-worker-encodes", "encoder-pool", "multi-step-decode"]
)
async def test_pd_llava_greedy_matches_transformers(tiny_llava_dir, encoders, steps):
    """Images too: encoded by the prefill worker, or by the encoder pool before the prefill
    engine gets the features (encode -> prefill -> decode, three pools); and decoded with
    multi-step plans."""
    from conftest import hf_llava_greedy
    from transformers import AutoTokenizer

    config = EngineConfig(
        model=tiny_llava_dir,
        role="decode",
        block_size=4,
        num_kv_blocks=400,
        max_num_batched_tokens=32,
        log_level="warning",
        threads=1,
        encoder_workers=encoders,
        num_scheduler_steps=steps,
    )
    got, stats, (same_image, other_image) = await run_engine(config, CASES)
    tok = AutoTokenizer.from_pretrained(tiny_llava_dir)
    for (_ids, toks), messages in zip(got, CASES):
        text, imgs = render(tok, messages, "<image>")
        assert toks == hf_llava_greedy(tiny_llava_dir, text, imgs, N)[1]
    assert stats.num_steps > 0 and stats.prefix_cache_queries == 0  # every prompt's KV was imported
    assert (stats.num_forwards > stats.num_steps) == (steps > 1)
    assert same_image > 0 and other_image == 0  # the prefill engine's prefix cache, keyed by image
    if encoders:
        assert stats.mm_cache_hits >= 1


@pytest.mark.timeout(180)
def test_pd_server_matches_transformers_then_a_dead_prefill_worker_fails_clearly(tiny_llama_dir):
    """`axonserve serve --role decode` over HTTP: greedy text as transformers'; then the prefill
    pool's worker dies mid-stream: the stream ends with an error chunk, /health turns 503,
    the launcher exits non-zero and no process is left."""
    import os
    import signal
    import time

    import httpx
    import torch
    from frontends.server import health, serve
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .test_faults import session_pids, stream_until_error, wait_until

    with serve(
        tiny_llama_dir, "--role", "decode", "--num-kv-blocks", "512", "--max-model-len", "2048", "--block-size", "4"
    ) as srv:
        tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
        ids = tok("The capital of France is")["input_ids"]
        r = httpx.post(
            srv.base_url + "/v1/completions",
            timeout=60,
            json={"model": tiny_llama_dir, "prompt": ids, "max_tokens": 12, "min_tokens": 12, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
        assert r.json()["choices"][0]["text"] == tok.decode(hf_greedy(ref, ids, 12), skip_special_tokens=True)

        sid = srv.proc.pid
        victim = next(pid for pid, cmd in session_pids(sid).items() if '"name":"prefill-worker-0"' in cmd)
        body = {
            "model": tiny_llama_dir,
            "prompt": "Once upon a time",
            "max_tokens": 1900,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        t_kill = None

        def kill() -> None:
            nonlocal t_kill
            os.kill(victim, signal.SIGKILL)
            t_kill = time.monotonic()

        error = stream_until_error(srv.base_url, body, kill)
        assert t_kill is not None and error is not None
        assert time.monotonic() - t_kill < 10 and "prefill-worker-0" in error["message"]
        wait_until(lambda: health(srv.base_url) in (503, None), 10, "/health 503")
        assert srv.proc.wait(30) != 0
        wait_until(lambda: not session_pids(sid), 10, "all actor processes to exit")
