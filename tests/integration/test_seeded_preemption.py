"""Seeded sampling end to end through preemption: a request with a seed samples (temperature 1) the
same tokens whether it is served alone or in a crowd that outgrows a tiny KV pool, where requests
are preempted and recomputed (re-sent to the workers as new). Its draws hash (seed, position)
(neuron/counter_rng.py), so nothing about the preemption reaches them."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import make_tiny_llama
from frontends.server import serve

N_NEW = 24
# six prompts of 5..30 token ids: up to 14 blocks of 4 with their outputs, so one fits the 24-block
# pool alone and six at once do not
PROMPTS = [[(101 + 37 * i + 11 * j) % 49000 + 3 for j in range(5 + 5 * i)] for i in range(6)]
# temperature only (the native kernel) and top-k/top-p (the torch path), each request its own seed
PARAMS = [{} if i % 2 == 0 else {"top_k": 40, "top_p": 0.9} for i in range(6)]


@pytest.fixture(scope="module")
def peaked_llama_dir(tmp_path_factory, smollm2_dir) -> str:
    """The tiny Llama with large weights: a few likely tokens a position (~4 at temperature 1), so a
    draw is not at the mercy of float rounding between batch shapes, yet still varies."""
    return make_tiny_llama(str(tmp_path_factory.mktemp("peaked-llama")), smollm2_dir, initializer_range=1.0)


def complete(base_url: str, i: int, start: threading.Barrier | None = None) -> str:
    """Request i; with `start`, posted only once every thread of the crowd is ready to post (each
    thread's client set-up took longer than a request on a fast hour: the crowd never overlapped)."""
    body = {
        "prompt": PROMPTS[i],
        "max_tokens": N_NEW,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 1000 + i,
        **PARAMS[i],
    }
    with httpx.Client(base_url=base_url, timeout=120) as http:
        if start is not None:
            start.wait(60)
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length", choice
    return choice["text"]


def preemptions(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    m = re.search(r"^vllm:num_preemptions_total(\{[^}]*\})? (\S+)$", text, re.M)
    assert m, "no vllm:num_preemptions_total in /metrics"
    return float(m[2])


@pytest.mark.timeout(300)
def test_seeded_outputs_survive_preemption(peaked_llama_dir):
    args = ("--num-kv-blocks", "24", "--block-size", "4", "--max-model-len", "256", "--log-level", "warning")
    with serve(peaked_llama_dir, *args) as srv:
        alone = [complete(srv.base_url, i) for i in range(len(PROMPTS))]
        assert preemptions(srv.base_url) == 0, "a request alone must fit the pool"
        assert len(set(alone)) == len(alone)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            start = threading.Barrier(len(PROMPTS))
            crowd = list(pool.map(lambda i: complete(srv.base_url, i, start), range(len(PROMPTS))))
        assert preemptions(srv.base_url) > 0, "no request was preempted: the test no longer tests preemption"
    assert crowd == alone
