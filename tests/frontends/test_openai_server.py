"""The OpenAI-compatible server end to end: `axonserve serve` subprocess + the official client.

The model is a random tiny Llama (SmolLM2 tokenizer), so texts are gibberish but greedy
decoding is deterministic, which is all the stop-string and seed checks need.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from .server import serve

pytestmark = pytest.mark.timeout(300)
MAX_LEN = 256


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    args = (
        "--max-num-seqs",
        "16",
        "--max-model-len",
        str(MAX_LEN),
        "--num-kv-blocks",
        "512",
        "--served-model-name",
        "tiny",
    )
    with serve(tiny_llama_dir, *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def aoai(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def complete(oai, prompt="The sky is", **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return oai.completions.create(model="tiny", prompt=prompt, **kw)


# --------------------------------------------------------------------------- basics


def test_health_version_models(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/version").json()["version"]
    models = httpx.get(server.base_url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == MAX_LEN


def test_completion_non_streaming(oai):
    r = complete(oai, max_tokens=10, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert r.object == "text_completion" and r.model == "tiny"
    assert c.finish_reason == "length" and c.text
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10


def test_completion_streaming_matches_non_streaming(oai):
    full = complete(oai, max_tokens=10, extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(complete(oai, max_tokens=10, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.usage is None for ch in chunks)


def test_chat_non_streaming_and_streaming(oai):
    msgs = [{"role": "user", "content": "Say hi"}]
    r = oai.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    stream = oai.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_usage_chunk_with_include_usage(oai):
    chunks = list(
        complete(
            oai, max_tokens=5, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert all(ch.usage is None for ch in chunks[:-1])


def test_max_tokens_length(oai):
    for n in (1, 7):
        r = complete(oai, max_tokens=n, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n


def test_chat_max_tokens_none_fills_context(oai):
    r = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == MAX_LEN


# --------------------------------------------------------------------------- stops / sampling


def _stop_candidate(text: str) -> str:
    """A 3-char stop string from the middle of `text` (avoid a prefix-only match)."""
    mid = len(text) // 2
    stop = text[mid : mid + 3]
    assert stop.strip(), text
    return stop


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(oai, stream):
    full = complete(oai, max_tokens=30, extra_body={"ignore_eos": True}).choices[0].text
    stop = _stop_candidate(full)
    expect = full[: full.index(stop)]
    if stream:
        chunks = list(complete(oai, max_tokens=30, stop=[stop], stream=True))
        text = "".join(ch.choices[0].text for ch in chunks)
        fin = chunks[-1].choices[0]
    else:
        fin = complete(oai, max_tokens=30, stop=[stop]).choices[0]
        text = fin.text
    assert text == expect
    assert fin.finish_reason == "stop"
    assert fin.model_extra["stop_reason"] == stop


def test_stop_string_included(oai):
    full = complete(oai, max_tokens=30, extra_body={"ignore_eos": True}).choices[0].text
    stop = _stop_candidate(full)
    r = complete(oai, max_tokens=30, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == full[: full.index(stop) + len(stop)]


def test_seeded_sampling_is_reproducible(oai):
    kw = dict(max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = complete(oai, seed=1234, **kw).choices[0].text
    b = complete(oai, seed=1234, **kw).choices[0].text
    c = complete(oai, seed=4321, **kw).choices[0].text
    assert a == b
    assert a != c


def test_n_choices(oai):
    r = complete(oai, n=3, seed=5, temperature=1.0, max_tokens=6, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 18


def test_batch_prompts(oai):
    single = [complete(oai, prompt=p, max_tokens=4).choices[0].text for p in ("a", "b c")]
    r = complete(oai, prompt=["a", "b c"], max_tokens=4, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert [by_index[0], by_index[2]] == single and by_index[1] == by_index[0]


def test_logprobs(oai):
    r = complete(oai, max_tokens=4, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) >= 1 for t in lp.top_logprobs)
    c = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


async def test_16_concurrent_streams(aoai):
    async def one(i: int) -> tuple[str, str | None]:
        stream = await aoai.completions.create(
            model="tiny",
            prompt=f"Story number {i}:",
            max_tokens=16,
            temperature=0.8,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for ch in stream:
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
        return text, finish

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(16))), 120)
    assert all(f == "length" and t for t, f in results)


async def test_client_disconnect_keeps_server_healthy(server, aoai):
    async with httpx.AsyncClient(base_url=server.base_url) as h:
        body = {"model": "tiny", "prompt": "go", "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with h.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break  # leave after the first chunk: the server must abort the request
    r = await aoai.completions.create(model="tiny", prompt="after", max_tokens=3)
    assert r.choices[0].text is not None


# --------------------------------------------------------------------------- errors


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == status
    return err


async def test_request_id_in_flight_is_400(server):
    """vLLM's `request_id` extension: reusing an id still in flight is refused (400, param
    request_id) and the running request goes on."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as h:
        body = {
            "model": "tiny",
            "prompt": "go",
            "max_tokens": MAX_LEN - 8,
            "stream": True,
            "ignore_eos": True,
            "request_id": "dup-1",
        }
        async with h.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break
            again = await h.post("/v1/completions", json={**body, "stream": False})
            assert _error(again, 400)["param"] == "request_id"
            rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
        ok = await h.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_bad_json_is_400(server):
    r = httpx.post(
        server.base_url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "JSON" in _error(r, 400)["message"]


def test_schema_error_is_400_not_422(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": "tiny", "messages": "nope"})
    assert _error(r, 400)["param"].startswith("messages")


def test_negative_max_tokens_is_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        complete(oai, max_tokens=-1)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value)


def test_bad_sampling_param_is_400(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", "prompt": "a", "top_p": 0})
    assert _error(r, 400)["param"] == "top_p"


def test_prompt_too_long_is_400_with_numbers(server, oai):
    prompt = [100] * (MAX_LEN + 10)
    r = httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", "prompt": prompt})
    err = _error(r, 400)
    assert str(MAX_LEN) in err["message"] and str(MAX_LEN + 10) in err["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        complete(oai, prompt=[100] * (MAX_LEN - 5), max_tokens=10)


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def test_unknown_route_is_error_json(server):
    _error(httpx.get(server.base_url + "/v1/nothing"), 404)


def test_sse_framing(server):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        json.loads(e[6:])
