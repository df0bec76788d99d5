"""The load generator against a real aiohttp server on loopback that streams canned SSE bodies in
pieces (events split across network reads)."""

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web

from axonserve.bench.dataset import RequestSpec
from axonserve.bench.loadgen import LoadConfig, is_loopback, request_body, run_load, send_one


def _sse(texts, usage=None, finish="length"):
    events = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in texts]
    events[-1]["choices"][0]["finish_reason"] = finish
    if usage is not None:
        events.append({"choices": [], "usage": {"completion_tokens": usage}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def _server(status: int, text: str, pieces: int = 5):
    """A session and the URL of a server answering every POST with `text` (streamed in pieces)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if status != 200:
            return web.Response(status=status, text=text)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        data = text.encode()
        step = max(1, len(data) // pieces)
        for i in range(0, len(data), step):
            await resp.write(data[i : i + step])
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as c:
            yield c, f"http://127.0.0.1:{port}/v1/completions"
    finally:
        await runner.cleanup()


def test_request_body_forces_length():
    cfg = LoadConfig("http://127.0.0.1:1", "m", extra_body={"logit_bias": {"2": -100}})
    b = request_body(cfg, RequestSpec([1, 2, 3], 3, 16))
    assert b["prompt"] == [1, 2, 3] and b["stream"] and b["stream_options"] == {"include_usage": True}
    assert (b["max_tokens"], b["min_tokens"], b["ignore_eos"]) == (16, 16, True)
    assert b["logit_bias"] == {"2": -100} and b["temperature"] == 0.0


@pytest.mark.parametrize("usage,expected", [(5, 5), (None, 3)])
async def test_send_one_counts_usage_or_chunks(usage, expected):
    body = _sse(["a", "", "b", "c"], usage)  # the empty chunk is not a token arrival
    async with _server(200, body) as (c, url):
        r = await send_one(c, url, {}, 7, 0.0)
    assert r.ok and r.output_tokens == expected and r.prompt_len == 7
    assert len(r.itl) == 2 and 0 <= r.ttft <= r.e2e and r.finish_reason == "length"


async def test_cut_off_stream_is_a_failure():
    body = _sse(["a", "b"], finish=None).replace("data: [DONE]\n\n", "")
    async with _server(200, body) as (c, url):
        r = await send_one(c, url, {}, 1, 0.0)
    assert not r.ok and "without finish_reason" in r.error


async def test_send_one_reports_http_and_stream_errors():
    async with _server(400, "bad") as (c, url):
        r = await send_one(c, url, {}, 1, 0.0)
    assert not r.ok and r.error.startswith("HTTP 400")
    err = 'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n'
    async with _server(200, err) as (c, url):
        r = await send_one(c, url, {}, 1, 0.0)
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
    res, _ = await run_load(LoadConfig("http://127.0.0.1:1", "m", request_rate=1000.0, seed=1, progress=False), specs)
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
