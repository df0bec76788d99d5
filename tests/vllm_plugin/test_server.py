"""vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on axonserve's ranks.

One server for the module, selected the way a user would: AXONSERVE_VLLM=1 makes our
`vllm.platform_plugins` entry point pick AxonExecutor. It runs 2 tensor-parallel axonserve
ranks under vLLM's scheduler with a 16-token step budget (every 32-token prompt is prefilled
in chunks) and a 10-block KV pool (160 tokens), so six concurrent 72-token sequences force
vLLM to preempt and resume. Tests run in file order; the last one stops the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from dataclasses import dataclass

import httpx
import pytest

from axonserve.actors.supervisor import free_port
from axonserve.bench.servers import http_status, stop_group
from tests.vllm_plugin.conftest import hf_reference, rank_pids, vllm_env, wait_gone

TP, BLOCK, KV_BLOCKS, MAX_LEN, BUDGET = 2, 16, 10, 128, 16
MODEL = "tiny"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@pytest.fixture(scope="module")
def server(vllm_python, vllm_model, tmp_path_factory):
    from axonserve.neuron.config import ModelConfig

    block_bytes = BLOCK * ModelConfig.from_dir(vllm_model).kv_bytes_per_token("float32", TP)  # one rank's block
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("vllm-server") / "server.log")
    cmd = [
        vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        vllm_model,
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_LEN),
        "--max-num-batched-tokens",
        str(BUDGET),
        "--max-num-seqs",
        "8",
        "--block-size",
        str(BLOCK),
        "--kv-cache-memory-bytes",
        str(KV_BLOCKS * block_bytes),
        "--tensor-parallel-size",
        str(TP),
        "--seed",
        "0",
        "--enforce-eager",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(AXONSERVE_VLLM="1"), start_new_session=True
        )
    srv = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        for _ in range(600):  # up to 5 min on a loaded machine
            if http_status(srv.url + "/health", 2.0) == 200:
                break
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {proc.returncode}:\n{srv.log()[-6000:]}")
            try:
                proc.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
        else:
            pytest.fail(f"vLLM server not healthy in time:\n{srv.log()[-6000:]}")
        yield srv
    finally:
        stop_group(proc, 30.0)


def _prompt(i: int, n: int = 32) -> list[int]:
    return [(i * 997 + j * 31) % 40000 + 300 for j in range(n)]


async def _complete(c: httpx.AsyncClient, url: str, prompt: list[int], n: int, **extra) -> dict:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    r = await c.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def test_concurrent_greedy_through_chunked_prefill_and_preemption(server, hf_model):
    prompts = [_prompt(i) for i in range(6)]

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*(_complete(c, server.url, p, 40) for p in prompts))

    outs = asyncio.run(run())
    for p, o in zip(prompts, outs):
        assert o["choices"][0]["token_ids"] == hf_reference(hf_model, p, 40)[0]
    assert _metric(server.url, "vllm:num_preemptions_total") > 0, "the tiny KV pool forced no preemption"


def test_streaming_completion(server, hf_model):
    prompt = _prompt(7, 40)
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    ids, chunks, usage = [], 0, None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for ch in ev["choices"]:
                ids += ch.get("token_ids") or []
                chunks += 1
    assert chunks > 1 and ids == hf_reference(hf_model, prompt, 20)[0]
    assert usage["completion_tokens"] == 20 and usage["prompt_tokens"] == len(prompt)


def test_streaming_chat(server, hf_model):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name three rivers in Europe."}],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    prompt, ids, text = None, [], ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            prompt = ev.get("prompt_token_ids") or prompt
            for ch in ev["choices"]:
                ids += ch.get("token_ids") or []
                text += ch["delta"].get("content") or ""
    assert prompt and ids == hf_reference(hf_model, prompt, 16)[0] and text


def test_prefix_cache_hit(server, hf_model):
    """The second prompt shares 3 full blocks with the first: vLLM hands it to the ranks with
    48 tokens already computed, whose KV the first request left in the pool."""
    shared = _prompt(11, 48)
    second = shared + _prompt(12, 8)
    before = _metric(server.url, "vllm:prefix_cache_hits_total")

    async def run() -> tuple[dict, dict]:
        async with httpx.AsyncClient(timeout=300) as c:
            return await _complete(c, server.url, shared, 8), await _complete(c, server.url, second, 12)

    a, b = asyncio.run(run())
    assert a["choices"][0]["token_ids"] == hf_reference(hf_model, shared, 8)[0]
    assert b["choices"][0]["token_ids"] == hf_reference(hf_model, second, 12)[0]
    assert _metric(server.url, "vllm:prefix_cache_hits_total") - before >= 48


def test_abandoned_stream_then_exact_output(server, hf_model):
    """A client that disconnects mid-stream is aborted by vLLM (its id reaches the ranks as
    finished); the next request is unaffected."""
    body = {
        "model": MODEL,
        "prompt": _prompt(13),
        "max_tokens": 80,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break
    prompt = _prompt(14)

    async def run() -> dict:
        async with httpx.AsyncClient(timeout=300) as c:
            return await _complete(c, server.url, prompt, 10)

    assert asyncio.run(run())["choices"][0]["token_ids"] == hf_reference(hf_model, prompt, 10)[0]


def test_unsupported_sampling_feature_is_a_400(server):
    """The platform plugin refuses what the ranks cannot do at the door (the engine lives on)."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "bad_words": ["world"]}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "bad_words" in r.text
    assert http_status(server.url + "/health") == 200


def test_sigterm_shuts_the_ranks_down_cleanly(server):
    """vLLM's API server SIGKILLs EngineCore's process tree at once on shutdown; the ranks live
    outside it and are stopped through the executor's lifeline with a clean Shutdown."""
    pids = rank_pids(server.log())
    assert len(pids) == 1 + TP, server.log()[-3000:]
    stop_group(server.proc, 30.0)
    assert not wait_gone(pids), f"ranks outlived the vLLM server: {pids}"
    log = server.log()
    assert log.count("shutdown_requested") >= TP, log[-4000:]
    run_dir = re.search(r"ranks_ready.*?run_dir=(\S+)", log).group(1)
    assert not os.path.exists(run_dir), "the executor's socket directory outlived it"
