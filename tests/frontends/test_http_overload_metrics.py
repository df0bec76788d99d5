"""Through the HTTP server: overload gets quick 503s while admitted requests complete, and
/metrics serves the metrics actor's Prometheus text."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from frontends.server import serve


@pytest.mark.timeout(180)
async def test_overload_gets_503_while_admitted_requests_complete(tiny_llama_dir):
    with serve(tiny_llama_dir, "--num-kv-blocks", "256", "--max-num-seqs", "1", "--max-waiting", "1") as srv:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as http:

            async def one(stream: bool) -> tuple[int, float, str]:
                t0 = time.monotonic()
                body = {
                    "model": tiny_llama_dir,
                    "prompt": "hello",
                    "max_tokens": 150,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": stream,
                }
                if stream:
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        text = (await r.aread()).decode()
                        return r.status_code, time.monotonic() - t0, text
                r = await http.post("/v1/completions", json=body)
                return r.status_code, time.monotonic() - t0, r.text

            results = await asyncio.gather(*(one(i % 2 == 0) for i in range(8)))
    codes = [c for c, _, _ in results]
    # at most max_num_seqs + max_waiting are admitted (fewer if all arrive before a step runs)
    assert 1 <= codes.count(200) <= 2 and codes.count(503) == 8 - codes.count(200), codes
    for code, dt, text in results:
        if code == 503:
            assert '"code":503' in text.replace(" ", "") and "overloaded" in text
            assert dt < 5.0  # rejected at once, not after queueing
        else:
            assert code == 200 and ("[DONE]" in text or '"finish_reason":"length"' in text.replace(" ", ""))


@pytest.mark.timeout(120)
def test_metrics_route_serves_prometheus_text(tiny_llama_dir):
    with serve(tiny_llama_dir, "--num-kv-blocks", "64", "--served-model-name", "tiny") as srv:
        with httpx.Client(base_url=srv.base_url, timeout=30) as http:
            r = http.post(
                "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 5, "ignore_eos": True}
            )
            assert r.status_code == 200
            deadline = time.monotonic() + 10
            while True:
                m = http.get("/metrics")
                assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
                if 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 5.0' in m.text:  # (vLLM's labels)
                    break
                assert time.monotonic() < deadline, m.text[-2000:]
                time.sleep(0.2)
            assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 1.0' in m.text


@pytest.mark.timeout(120)
def test_one_json_access_log_line_per_request(tiny_llama_dir):
    import json

    with serve(tiny_llama_dir, "--num-kv-blocks", "64", "--served-model-name", "tiny", "--log-format", "json") as srv:
        with httpx.Client(base_url=srv.base_url, timeout=30) as http:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 6, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200
            with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                r.read()
            assert http.post("/v1/completions", json=body | {"max_tokens": -1}).status_code == 400
        deadline = time.monotonic() + 10
        while True:
            lines = [json.loads(x) for x in open(srv.log_path) if x.startswith("{")]
            access = [x for x in lines if x.get("event") == "access" and x.get("path") == "/v1/completions"]
            if len(access) >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    ok = [a for a in access if a["status"] == 200]
    assert len(ok) == 2 and len(access) == 3, access
    for a in ok:
        assert a["actor"] == "frontend" and a["request_id"].startswith("cmpl")
        assert a["prompt_tokens"] >= 1 and a["completion_tokens"] == 6
        assert a["finish_reason"] == "length" and 0 < a["ttft_s"] <= a["seconds"]
    assert [a["status"] for a in access if a["status"] != 200] == [400]
