"""Property test: no request body, however wrong, gets a 5xx or leaves a request stuck.

Hypothesis mutates valid bodies of every POST route (fields replaced by arbitrary JSON of
any type or by values around the server's size bounds, unknown fields added, random bytes,
deep nesting) and sends them to a real `axonserve serve` started with small bounds. Every
answer must be a 2xx or a 4xx carrying OpenAI error JSON; after the run the engine must be
idle again (nothing running, no KV block held) and still serve.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .server import serve

pytestmark = pytest.mark.timeout(600)

BASES = {
    "/v1/completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 3},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    "/tokenize": {"model": "tiny", "prompt": "Hi"},
    "/detokenize": {"model": "tiny", "tokens": [1, 2, 3]},
}
FIELDS = {  # fields worth attacking, per route (plus whatever the base has)
    "/v1/completions": [
        "prompt",
        "n",
        "stop",
        "seed",
        "logprobs",
        "echo",
        "logit_bias",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "max_tokens",
        "min_tokens",
        "ignore_eos",
        "stream",
        "stream_options",
        "stop_token_ids",
        "allowed_token_ids",
        "prompt_logprobs",
        "truncate_prompt_tokens",
        "user",
        "suffix",
        "request_id",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "guided_regex",
        "guided_choice",
        "guided_json",
        "structured_outputs",
    ],
    "/v1/chat/completions": [
        "messages",
        "n",
        "stop",
        "seed",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "temperature",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "stream",
        "stream_options",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "user",
        "response_format",
        "tools",
        "tool_choice",
        "chat_template",
        "request_id",
        "guided_grammar",
    ],
    "/tokenize": [
        "prompt",
        "messages",
        "add_special_tokens",
        "return_token_strs",
        "add_generation_prompt",
        "chat_template",
        "chat_template_kwargs",
    ],
    "/detokenize": ["tokens", "model"],
}

leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 16, 255, 256, 4096, 49151, 49152, 2**31, 2**63, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "user", "assistant", "system", "tool", "tiny", "\x00", "{{ x }}", "<|im_end|>"]),
)
json_value = st.recursive(
    leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)
# values around the server's bounds (see `server`): counts and lengths just under, at and over them
SIZES = [0, 1, 3, 4, 5, 8, 9, 16, 17, 64, 129, 2049, 70_000]
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.text("abcdef", min_size=1, max_size=6), "parameters": st.just({"type": "object"})}
        ),
    }
)
oversized = st.one_of(
    st.builds(lambda n, c: c * n, st.sampled_from(SIZES), st.sampled_from(["a", "é", "{%", " ", "\n"])),
    st.builds(lambda n, x: [x] * n, st.sampled_from(SIZES[:-2]), st.one_of(st.text(max_size=4), st.integers(0, 9))),
    st.builds(lambda n: {str(i): 1.0 for i in range(n)}, st.sampled_from(SIZES[:-2])),
    st.builds(lambda n, t: [t] * n, st.sampled_from(SIZES[:-2]), tool),
    st.sampled_from(
        [
            "{% for i in range(99999) %}{% for j in range(99999) %}{{ j }}{% endfor %}{% endfor %}",
            "{{ messages }}",
            "{% set r = range(100000) %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}",
            {"chat_template": "{{ 1 }}"},
            {"tokenize": True},
            {"x": "y"},
        ]
    ),
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
        "content": st.one_of(st.text(max_size=20), json_value),
    }
)


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(BASES)))
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "raw", "json"]))
    if kind == "raw":
        return route, draw(st.binary(max_size=64))
    if kind == "json":
        return route, json.dumps(draw(json_value)).encode()
    body = dict(BASES[route])
    for key in draw(st.lists(st.sampled_from(FIELDS[route]), max_size=4, unique=True)):
        if key == "messages":
            body[key] = draw(st.one_of(st.lists(message, max_size=3), json_value))
        else:
            body[key] = draw(st.one_of(json_value, oversized))
    if draw(st.booleans()):
        body.pop(draw(st.sampled_from(sorted(body))), None)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=8))] = draw(json_value)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:  # keep the run short
        body["max_tokens"] = 64
    body.setdefault("max_tokens", 3) if route.startswith("/v1") else None
    return route, json.dumps(body).encode()


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    args = (
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        "128",
        "--served-model-name",
        "tiny",
        "--max-request-fanout",
        "8",
        "--max-stop-strings",
        "4",
        "--max-stop-string-chars",
        "16",
        "--max-logit-bias",
        "16",
        "--max-tools",
        "4",
        "--max-structured-output-bytes",
        "2048",
        "--max-request-id-chars",
        "16",
        "--max-waiting",
        "16",
        "--max-waiting-tokens",
        "2048",
        "--trust-request-chat-template",
        "--chat-template-timeout",
        "2",
    )
    with serve(tiny_llama_dir, *args) as srv:
        yield srv


def _check(resp: httpx.Response, route: str, body: bytes) -> None:
    assert resp.status_code < 500, f"{route} {body[:300]!r} -> {resp.status_code} {resp.text[:300]}"
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and err["code"] == resp.status_code
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert resp.text.rstrip().endswith("data: [DONE]")
        for event in resp.text.strip().split("\n\n")[:-1]:
            chunk = json.loads(event.removeprefix("data: "))
            assert "error" not in chunk or chunk["error"]["code"] < 500, f"{route} {body[:300]!r}: {chunk}"


def test_no_body_gets_a_5xx_or_sticks(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:

        @settings(
            max_examples=300, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
        )
        @given(bodies())
        def probe(case: tuple[str, bytes]) -> None:
            route, body = case
            t0 = time.monotonic()
            _check(http.post(route, content=body, headers={"content-type": "application/json"}), route, body)
            assert time.monotonic() - t0 < 15, f"{route} {body[:300]!r}: {time.monotonic() - t0:.1f}s"

        probe()

        def metric(name: str) -> float:
            m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", http.get("/metrics").text, re.M)
            assert m, name
            return float(m.group(1))

        deadline = time.monotonic() + 30
        while (
            metric("vllm:num_requests_running")
            or metric("vllm:num_requests_waiting")
            or metric("vllm:kv_cache_usage_perc")
        ):
            assert time.monotonic() < deadline, "requests or KV blocks left behind after the fuzz run"
            time.sleep(0.2)
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "still alive", "max_tokens": 2})
        assert r.status_code == 200 and http.get("/health").status_code == 200
