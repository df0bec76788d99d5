"""The load generator against an in-process fake server (httpx MockTransport): no sockets."""

import asyncio
import json

import httpx
import pytest

from axonserve.bench.dataset import RequestSpec
from axonserve.bench.loadgen import LoadConfig, is_loopback, request_body, run_load, send_one


def _sse(texts, usage=None, finish="length"):
    events = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in texts]
    events[-1]["choices"][0]["finish_reason"] = finish
    if usage is not None:
        events.append({"choices": [], "usage": {"completion_tokens": usage}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def _client(handler):
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _resp(status, text):
    return httpx.Response(status, stream=httpx.ByteStream(text.encode()))


def test_request_body_forces_length():
    cfg = LoadConfig("http://127.0.0.1:1", "m", extra_body={"logit_bias": {"2": -100}})
    b = request_body(cfg, RequestSpec([1, 2, 3], 3, 16))
    assert b["prompt"] == [1, 2, 3] and b["stream"] and b["stream_options"] == {"include_usage": True}
    assert (b["max_tokens"], b["min_tokens"], b["ignore_eos"]) == (16, 16, True)
    assert b["logit_bias"] == {"2": -100} and b["temperature"] == 0.0


@pytest.mark.parametrize("usage,expected", [(5, 5), (None, 3)])
async def test_send_one_counts_usage_or_chunks(usage, expected):
    body = _sse(["a", "", "b", "c"], usage)  # the empty chunk is not a token arrival
    async with _client(lambda req: _resp(200, body)) as c:
        r = await send_one(c, "http://x/v1/completions", {}, 7, 0.0)
    assert r.ok and r.output_tokens == expected and r.prompt_len == 7
    assert len(r.itl) == 2 and 0 <= r.ttft <= r.e2e and r.finish_reason == "length"


async def test_cut_off_stream_is_a_failure():
    body = _sse(["a", "b"], finish=None).replace("data: [DONE]\n\n", "")
    async with _client(lambda req: _resp(200, body)) as c:
        r = await send_one(c, "http://x/v1/completions", {}, 1, 0.0)
    assert not r.ok and "without finish_reason" in r.error


async def test_send_one_reports_http_and_stream_errors():
    async with _client(lambda req: _resp(400, "bad")) as c:
        r = await send_one(c, "http://x/v1/completions", {}, 1, 0.0)
    assert not r.ok and r.error.startswith("HTTP 400")
    err = 'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n'
    async with _client(lambda req: _resp(200, err)) as c:
        r = await send_one(c, "http://x/v1/completions", {}, 1, 0.0)
    assert not r.ok and "boom" in r.error


async def test_run_load_respects_concurrency(monkeypatch):
    live, peak = 0, 0

    async def fake_send(client, url, body, prompt_len, t0):
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.01)
        live -= 1
        from axonserve.bench.stats import RequestResult
        return RequestResult(ok=True, prompt_len=prompt_len, output_tokens=2, ttft=0.01, itl=[0.0], e2e=0.01)

    monkeypatch.setattr("axonserve.bench.loadgen.send_one", fake_send)
    specs = [RequestSpec([1], 1, 2) for _ in range(10)]
    res, dur = await run_load(LoadConfig("http://127.0.0.1:1", "m", concurrency=3, progress=False), specs)
    assert len(res) == 10 and all(r.ok for r in res) and peak == 3
    res, _ = await run_load(LoadConfig("http://127.0.0.1:1", "m", request_rate=1000.0, seed=1,
                                       progress=False), specs)
    assert len(res) == 10


def test_loopback_guard():
    assert is_loopback("http://127.0.0.1:8000") and is_loopback("http://localhost:1")
    assert not is_loopback("http://10.0.0.1:8000")


def test_sampling_flags_reach_the_request_body():
    """vLLM bench's --temperature / --top-p / --top-k override --extra-body's; greedy when absent."""
    import argparse

    from axonserve.bench.serve import add_workload_args, request_extras

    p = argparse.ArgumentParser()
    add_workload_args(p)
    p.add_argument("--extra-body", default=None)
    spec = RequestSpec(prompt=[1, 2], prompt_len=2, max_tokens=4)
    args = p.parse_args(["--temperature", "0.7", "--top-p", "0.9", "--extra-body", '{"top_k": 5, "temperature": 0.1}'])
    body = request_body(LoadConfig("http://127.0.0.1:1", "m", extra_body=request_extras(args)), spec)
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.9, 5)
    body = request_body(LoadConfig("http://127.0.0.1:1", "m", extra_body=request_extras(p.parse_args([]))), spec)
    assert body["temperature"] == 0.0 and "top_p" not in body
