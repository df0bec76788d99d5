"""OpenAI API completeness and hardening, end to end against a real `axonserve serve`:
request parameters (logit_bias, allowed_token_ids, echo, prompt logprobs, truncation),
unknown parameters, /tokenize and /detokenize, /openapi.json, API-key auth, body size
limit, CORS, and a client disconnect freeing its KV blocks.

One server (tiny random Llama, SmolLM2 tokenizer) with an API key, a small body limit and
one allowed CORS origin serves every test here.
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from .server import serve

pytestmark = pytest.mark.timeout(300)
KEY = "sk-test-key"
MAX_LEN = 256
BODY_LIMIT = 64 * 1024
ORIGIN = "http://ui.example"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    args = (
        "--max-num-seqs",
        "16",
        "--max-model-len",
        str(MAX_LEN),
        "--num-kv-blocks",
        "256",
        "--served-model-name",
        "tiny",
        "--api-key",
        KEY,
        "--max-request-body-bytes",
        str(BODY_LIMIT),
        "--allowed-origins",
        f'["{ORIGIN}"]',
    )
    with serve(tiny_llama_dir, *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == status
    return err


def _metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


# --------------------------------------------------------------------------- parameters


def _token_text(http: httpx.Client, tid: int) -> str:
    return http.post("/detokenize", json={"tokens": [tid]}).json()["prompt"]


def test_logit_bias_forces_a_token(oai, http):
    r = oai.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, logit_bias={"1234": 100}, logprobs=0
    )
    assert set(r.choices[0].logprobs.tokens) == {_token_text(http, 1234)}


def test_logit_bias_rejects_bad_ids_and_values(http):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
    assert _error(http.post("/v1/completions", json={**body, "logit_bias": {"x": 1}}), 400)["param"] == "logit_bias"
    assert _error(http.post("/v1/completions", json={**body, "logit_bias": {"5": 101}}), 400)["param"] == "logit_bias"
    err = _error(http.post("/v1/completions", json={**body, "logit_bias": {"99999999": 1}}), 400)
    assert err["param"] == "logit_bias" and "49152" in err["message"]


def test_allowed_token_ids_limit_sampling(http):
    allowed = [300, 301, 302]
    r = http.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "a",
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 3,
            "allowed_token_ids": allowed,
            "logprobs": 0,
        },
    )
    assert r.status_code == 200, r.text
    assert set(r.json()["choices"][0]["logprobs"]["tokens"]) <= {_token_text(http, t) for t in allowed}


def test_echo_returns_prompt_then_completion(oai):
    plain = oai.completions.create(model="tiny", prompt="The sky is", max_tokens=6, temperature=0)
    echo = oai.completions.create(model="tiny", prompt="The sky is", max_tokens=6, temperature=0, echo=True)
    assert echo.choices[0].text == "The sky is" + plain.choices[0].text
    chunks = oai.completions.create(
        model="tiny", prompt="The sky is", max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echo.choices[0].text


def _hf_logprobs(hf_tiny, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_tiny(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_echo_logprobs_match_transformers(oai, http, hf_tiny):
    prompt = "Once upon a time there was"
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = oai.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=3)
    lp = r.choices[0].logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _hf_logprobs(hf_tiny, ids)
    want = [ref[i - 1, ids[i]].item() for i in range(1, n)]
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=2e-3)
    assert all(len(t) >= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_prompt_logprobs_extension_and_prefix_cache(http, hf_tiny):
    """vLLM's prompt_logprobs: the full list every time, even when the prefix cache holds the
    prompt (the cache is bypassed for such requests)."""
    ids = list(range(500, 540))  # 40 tokens: more than two KV blocks
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    http.post("/v1/completions", json={**body, "prompt_logprobs": None}).raise_for_status()  # warm the cache
    ref = _hf_logprobs(hf_tiny, ids)
    for _ in range(2):
        r = http.post("/v1/completions", json=body)
        pl = r.json()["choices"][0]["prompt_logprobs"]
        assert len(pl) == len(ids) and pl[0] is None
        got = [pl[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
        assert got == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=2e-3)
        assert all(len(e) >= 2 for e in pl[1:])
    chat = http.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0},
    )
    pl = chat.json()["prompt_logprobs"]
    assert pl[0] is None and len(pl) == chat.json()["usage"]["prompt_tokens"]


def test_truncate_prompt_tokens(http):
    r = http.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": list(range(100, 400)), "max_tokens": 2, "truncate_prompt_tokens": 50},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 50


def test_unknown_parameter_is_400_naming_it(oai, http):
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        oai.completions.create(model="tiny", prompt="a", max_tokens=2, extra_body={"frobnicate": 1})
    err = _error(
        http.post(
            "/v1/chat/completions",
            json={"model": "tiny", "max_tokens": 2, "best_of": 3, "messages": [{"role": "user", "content": "x"}]},
        ),
        400,
    )
    assert err["param"] == "best_of"
    # fields that do not change the output are accepted, as OpenAI's server does
    r = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        user="u1",
        metadata={"a": "b"},
        store=False,
    )
    assert r.choices[0].message.content is not None


def test_n_is_bounded(http):
    err = _error(http.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 1, "n": 100000}), 400)
    assert err["param"] == "n"


# --------------------------------------------------------------------------- extra endpoints


def test_tokenize_detokenize_roundtrip(http, oai):
    t = http.post("/tokenize", json={"model": "tiny", "prompt": "Hello world", "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] == MAX_LEN
    assert (
        http.post("/detokenize", json={"model": "tiny", "tokens": t["tokens"]}).json()["prompt"].endswith("Hello world")
    )
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    chat_ids = http.post("/tokenize", json={"messages": msgs}).json()
    r = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    assert chat_ids["count"] == r.usage.prompt_tokens
    assert _error(http.post("/tokenize", json={"prompt": "a", "messages": msgs}), 400)
    assert _error(http.post("/detokenize", json={"tokens": [-1]}), 400)["param"] == "tokens"
    assert _error(http.post("/detokenize", json={"tokens": [1], "model": "other"}), 404)


def test_openapi_describes_every_route(server):
    spec = httpx.get(server.base_url + "/openapi.json").json()
    paths = spec["paths"]
    for path, method in [
        ("/v1/completions", "post"),
        ("/v1/chat/completions", "post"),
        ("/v1/models", "get"),
        ("/tokenize", "post"),
        ("/detokenize", "post"),
        ("/health", "get"),
        ("/version", "get"),
        ("/metrics", "get"),
        ("/v1/embeddings", "post"),
        ("/start_profile", "post"),
        ("/stop_profile", "post"),
    ]:
        assert method in paths.get(path, {}), f"{method.upper()} {path} missing from /openapi.json"
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"):
        assert "requestBody" in paths[path]["post"], f"POST {path} has no request body schema"
    schemas = spec["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "TokenizeRequest"} <= set(schemas)
    assert "logit_bias" in schemas["CompletionRequest"]["properties"]


# --------------------------------------------------------------------------- auth, limits, CORS


def test_api_key_guards_every_route_but_the_probes(server):
    base = server.base_url
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/start_profile"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            err = _error(httpx.request(method, base + path, headers=headers, json={}), 401)
            assert err["type"] == "AuthenticationError"
    for path in ("/health", "/ping", "/version", "/metrics", "/openapi.json"):
        assert httpx.get(base + path).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(base + "/v1/models", headers=AUTH).status_code == 200


def test_body_limit_is_413(http):
    big = {"model": "tiny", "prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1}
    assert _error(http.post("/v1/completions", json=big), 413)["type"] == "RequestTooLargeError"

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"y" * 1024
        yield b'", "max_tokens": 1}'

    r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    _error(r, 413)
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 1}).status_code == 200


def test_cors(server):
    pre = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.options(server.base_url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(server.base_url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(server.base_url + "/v1/models", headers={"Origin": ORIGIN})  # 401 still carries CORS headers
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


# --------------------------------------------------------------------------- disconnect


def test_disconnect_mid_stream_aborts_and_frees_kv(server, http):
    """A client gone mid-stream: its request is aborted and its KV blocks return to the pool
    (read from the engine's own gauges), while the server keeps serving."""
    body = {"model": "tiny", "prompt": "go", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    _wait(lambda: _metric(http, "vllm:num_requests_running") == 1, "request running")
                    assert _metric(http, "vllm:kv_cache_usage_perc") > 0
                    break
    _wait(
        lambda: _metric(http, "vllm:num_requests_running") == 0 and _metric(http, "vllm:kv_cache_usage_perc") == 0,
        "aborted request to release its KV blocks",
    )
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2}).status_code == 200


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_image_parts_to_a_text_only_model_are_400(http):
    img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, img]}],
        },
    )
    assert "does not accept images" in _error(r, 400)["message"]
