"""Sliding-window models through the whole engine: greedy tokens equal transformers' (eager
attention, its sliding_window_causal mask) for prompts ~3x the window and generations past it,
with prefix caching, chunked prefill whose chunks start past the window, mixed short and long
prompts and preemption; and a sliding request's KV stops growing at its window (the engine's own
gauges: EngineStats and /metrics over HTTP), while a model with a full-attention layer keeps growing.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from conftest import hf_greedy, make_tiny_model
from frontends.server import serve
from prometheus_client.parser import text_string_to_metric_families

from axonserve.actors.supervisor import Supervisor
from axonserve.config import EngineConfig
from axonserve.engine.sliding_window import blocks_held
from axonserve.frontends.client import AsyncEngineClient
from axonserve.protocol.messages import SamplingParams

WINDOW, BS = 16, 4
CASES = {
    "mistral": ("MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0}),
    # layer 0 full, layer 1 sliding
    "qwen2-mixed": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3-mixed": (
        "Qwen3ForCausalLM",
        {"use_sliding_window": True, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}


def _model(tmp_path_factory, name: str, tokenizer_dir: str) -> str:
    arch, overrides = CASES[name]
    return make_tiny_model(str(tmp_path_factory.mktemp(name)), arch, tokenizer_dir, **overrides)


def _hf(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


async def _engine(config: EngineConfig, body) -> object:
    sup = Supervisor(config, frontend=False)
    await sup.start()
    client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
    try:
        return await asyncio.wait_for(body(client), 400)
    finally:
        client.close()
        await sup.stop("test done")


async def _greedy(client, prompts: list[list[int]], n: int, stagger: float = 0.05) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)

    async def one(i: int, ids: list[int]) -> list[int]:
        await asyncio.sleep(stagger * i)  # arrive while earlier requests are decoding
        toks: list[int] = []
        async for out in client.generate(ids, params):
            assert out.error is None, out.error
            toks.extend(out.token_ids)
        return toks

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def _prompts(seed: int) -> list[list[int]]:
    """Short and long (~3x the window) prompts, two of them sharing a 40-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1024) for _ in range(40)]
    lengths = (5, 50, 60, 17, 3)
    prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in lengths]
    return [*prompts, shared + prompts[1][:8], shared + prompts[3][:11]]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["mistral", "qwen2-mixed", "qwen3-mixed"])
async def test_greedy_past_the_window_matches_transformers(tmp_path_factory, smollm2_dir, name):
    """Two rounds (the second hits the first's prefix cache: blocks given back while their request
    ran may have been reused by then), a 20-token budget (chunks of long prompts start past the
    window), 40 tokens each: every sequence ends well past the window."""
    d = _model(tmp_path_factory, name, smollm2_dir)
    prompts = _prompts(1)
    config = EngineConfig(
        model=d, block_size=BS, num_kv_blocks=160, max_num_batched_tokens=20, log_level="warning", threads=1
    )

    async def body(client):
        first = await _greedy(client, prompts, 40)
        second = await _greedy(client, prompts[::-1], 40)
        return first, second[::-1], await client.get_stats()

    first, second, stats = await _engine(config, body)
    ref = _hf(d)
    want = [hf_greedy(ref, p, 40) for p in prompts]
    assert first == want and second == want
    assert stats.prefix_cache_hits > 0


@pytest.mark.timeout(600)
async def test_preemption_keeps_parity(tmp_path_factory, smollm2_dir):
    """Qwen2 sliding on every layer with a 24-block pool (96 token slots): seven requests of up to
    108 tokens fit only because each holds ~its window; together they overflow it and get preempted
    and recomputed, and the tokens still equal transformers'."""
    d = _model(tmp_path_factory, "qwen2", smollm2_dir)
    prompts = _prompts(2)
    config = EngineConfig(
        model=d, block_size=BS, num_kv_blocks=24, max_num_batched_tokens=20, log_level="warning", threads=1
    )

    async def body(client):
        return await _greedy(client, prompts, 48, stagger=0.0), await client.get_stats()

    got, stats = await _engine(config, body)
    assert stats.num_preemptions > 0
    ref = _hf(d)
    assert got == [hf_greedy(ref, p, 48) for p in prompts]


async def _held_blocks(client, num_blocks: int, prompt: list[int], n: int) -> list[tuple[int, int]]:
    """(sequence length the client has seen, KV blocks in use) sampled from the scheduler's own
    gauges while one request streams (samples taken after the engine finished it are dropped)."""
    samples = []
    seen, next_at = len(prompt), len(prompt) + 8
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
    async for out in client.generate(prompt, params):
        seen += len(out.token_ids)
        if out.finished:
            break
        if seen >= next_at:
            next_at += 8
            stats = await client.get_stats()
            if stats.num_running:
                samples.append((seen, round(stats.kv_cache_usage * num_blocks)))
    return samples


@pytest.mark.timeout(600)
async def test_blocks_held_stop_growing_past_the_window(tmp_path_factory, smollm2_dir):
    """Mistral (every layer slides): the blocks a request holds stay under blocks_held's bound at
    any length; the same shape with a full-attention layer holds at least every block its sequence
    spans (nothing may be freed)."""
    results = {}
    for name in ("mistral", "qwen2-mixed"):
        config = EngineConfig(
            model=_model(tmp_path_factory, name, smollm2_dir),
            block_size=BS,
            num_kv_blocks=96,
            log_level="warning",
            threads=1,
        )

        async def body(client):
            return await _held_blocks(client, 96, list(range(10, 18)), 120)

        results[name] = await _engine(config, body)
    print("sequence length -> blocks held:", results)
    bound = blocks_held(10**6, 8, WINDOW, BS)  # the 8-token prompt is the longest chunk
    sliding, full = results["mistral"], results["qwen2-mixed"]
    assert len(sliding) >= 10 and sliding[-1][0] >= 6 * WINDOW
    assert all(0 < held <= bound for _, held in sliding)
    assert all(held >= -(-(seen - 1) // BS) for seen, held in full)  # (the last token's KV may be pending)
    assert full[-1][1] > 3 * bound


def _metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.timeout(600)
def test_kv_usage_metric_stays_flat_over_http(tmp_path_factory, smollm2_dir):
    """The served KV usage gauge (vllm:kv_cache_usage_perc) of a sliding-window model never exceeds
    the window's blocks while a long completion streams (read with the step's own running count and
    generated tokens, from the same stats event); leaving the stream ends the request. A prompt past
    the window is a 200, one past max_model_len a 400."""
    d = _model(tmp_path_factory, "mistral", smollm2_dir)
    args = (
        "--block-size",
        str(BS),
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "4000",
        "--max-num-batched-tokens",
        "64",
    )
    with serve(d, *args) as srv:
        body = {"model": d, "prompt": "hello " * 4, "max_tokens": 3900, "stream": True, "ignore_eos": True}
        samples, chunks = [], 0
        with httpx.Client(base_url=srv.base_url, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    chunks += line.startswith("data: ")
                    if chunks >= 4 * WINDOW and chunks % 16 == 0:
                        m = _metrics(srv.base_url)
                        if m["vllm:num_requests_running"] == 1:  # (not after the request ended)
                            samples.append((m["vllm:generation_tokens_total"], m["vllm:kv_cache_usage_perc"]))
                        if len(samples) == 8:
                            break  # the client leaves: the request is aborted
            long = {"model": d, "prompt": "hello " * 120, "max_tokens": 4}
            assert c.post("/v1/completions", json=long).status_code == 200
            too_long = {"model": d, "prompt": "hello " * 4100, "max_tokens": 4}
            r = c.post("/v1/completions", json=too_long)
            assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    print("(generated tokens, kv_cache_usage_perc) samples:", samples)
    bound = blocks_held(10**6, 16, WINDOW, BS) / 64  # (a prompt of at most 16 tokens)
    assert samples and all(0 < u <= bound for _, u in samples)
    assert max(n for n, _ in samples) > 3 * WINDOW
