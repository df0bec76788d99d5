"""`--data-parallel-size 2`: two engines (scheduler + rank each) behind one frontend.

Greedy parity with transformers for requests that spread over both engines (per-engine metrics
with vLLM's `engine` label), prefix affinity (requests sharing leading blocks land where the first
one ran: its prefix cache holds them), and a killed rank of one engine heals while the other engine
keeps serving untouched."""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import hf_greedy
from frontends.server import serve

from axonserve.frontends.tokenizer import Tokenizer

from .test_faults import session_pids, wait_until
from .test_self_healing import Streams

N = 16


def per_engine(base_url: str, name: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        e = re.search(r'engine="(\d+)"', m[1])
        if e:
            out[e[1]] = out.get(e[1], 0.0) + float(m[2])
    return out


def worker_pids(sid: int) -> dict[str, int]:
    return {
        name: pid
        for pid, cmd in session_pids(sid).items()
        for name in ("worker-0", "worker-0-dp1")
        if "axonserve.actors.entry" in cmd and f'"name":"{name}"' in cmd
    }


@pytest.mark.timeout(300)
def test_two_engines_parity_spread_affinity_and_isolation(tiny_llama_dir):
    prompts = [f"Request {i} is about {i * 7} apples and" for i in range(8)]
    tok = Tokenizer.load(tiny_llama_dir)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    want = [tok.decode(hf_greedy(model, tok.encode(p), N)) for p in prompts]
    args = ("--served-model-name", "tiny", "--num-kv-blocks", "256", "--max-model-len", "512", "-dp", "2")
    with serve(tiny_llama_dir, *args) as srv:
        sid = srv.proc.pid
        assert set(worker_pids(sid)) == {"worker-0", "worker-0-dp1"}

        def one(p: str) -> str:
            body = {"model": "tiny", "prompt": p, "max_tokens": N, "min_tokens": N, "temperature": 0}
            r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(8) as pool:  # concurrent: the least loaded engine takes each
            assert list(pool.map(one, prompts)) == want
        done = per_engine(srv.base_url, "vllm:request_success_total")
        assert done.get("0", 0) >= 1 and done.get("1", 0) >= 1, done
        assert sum(done.values()) == len(prompts)

        # prefix affinity: one after another, prompts sharing 4 blocks (64 tokens) of prefix all go
        # to the engine that served the first, and hit its prefix cache
        shared = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
        before = per_engine(srv.base_url, "vllm:request_success_total")
        for i in range(6):
            one(f"{shared} then number {i}")
        after = per_engine(srv.base_url, "vllm:request_success_total")
        moved = {e: after.get(e, 0) - before.get(e, 0) for e in ("0", "1")}
        assert sorted(moved.values()) == [0, 6], moved
        hits = per_engine(srv.base_url, "vllm:prefix_cache_hits_total")
        assert max(hits.values()) >= 5 * 64, hits

        # engine 1's rank dies: it is replaced and its streams resume; engine 0 is never touched
        streams = Streams(srv.base_url, [f"Story {i}: once upon a time" for i in range(6)])
        wait_until(streams.started, 60, "every stream's first tokens")
        pids = worker_pids(sid)
        os.kill(pids["worker-0-dp1"], signal.SIGKILL)
        streams.join(180)
        assert not streams.errors and streams.finish == ["length"] * 6, (streams.errors, streams.finish)
        wait_until(lambda: worker_pids(sid).get("worker-0-dp1") not in (None, pids["worker-0-dp1"]), 60, "a new rank")
        assert worker_pids(sid)["worker-0"] == pids["worker-0"]
        with ThreadPoolExecutor(2) as pool:  # both engines serve again
            assert list(pool.map(one, prompts[:2])) == want[:2]
