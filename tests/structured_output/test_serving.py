"""Structured output end to end: `axonserve serve` subprocess + the official OpenAI client.

The model is a random tiny Llama (SmolLM2's tokenizer, vocabulary padded past it), so nothing
but the grammar makes its output JSON: every answer that ends by "stop" must parse and validate.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from frontends.server import serve

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(300)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
MSGS = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    from conftest import make_tiny_llama

    model = make_tiny_llama(str(tmp_path_factory.mktemp("tiny-so")), smollm2_dir, vocab_size=49216)
    with serve(
        model, "--max-num-seqs", "16", "--max-model-len", "512", "--num-kv-blocks", "512", "--served-model-name", "tiny"
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    """The real default model: any JSON object is unbounded (strings, nesting), and only a model
    that means to close it does so; a random one writes one string until max_tokens."""
    with serve(smollm2_dir, "--max-model-len", "512", "--num-kv-blocks", "128", "--served-model-name", "smol") as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(oai, **kw):
    kw.setdefault("max_tokens", 150)
    kw.setdefault("temperature", 0)
    return oai.chat.completions.create(model="tiny", messages=MSGS, **kw)


def stream_text(stream) -> tuple[str, str | None]:
    text, finish = "", None
    for ch in stream:
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def test_json_object_real_model(smol):
    msgs = [{"role": "user", "content": "Give the name and age of a fictional person as a JSON object."}]
    free = smol.chat.completions.create(model="smol", messages=msgs, max_tokens=24, temperature=0)
    with pytest.raises(ValueError):  # unconstrained, this model answers in prose
        json.loads(free.choices[0].message.content)
    kw = {
        "model": "smol",
        "messages": msgs,
        "max_tokens": 80,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    c = smol.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict), c.message.content
    assert stream_text(smol.chat.completions.create(stream=True, **kw)) == (c.message.content, "stop")


def test_json_schema_every_choice_validates(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(oai, response_format=fmt, n=6, temperature=1.0, seed=7)
    assert len(r.choices) == 6
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)
    assert len({c.message.content for c in r.choices}) > 1
    text, finish = stream_text(chat(oai, response_format=fmt, stream=True, seed=3, temperature=1.0))
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_completions_guided_extras(oai):
    def complete(temperature=1.0, **extra):
        r = oai.completions.create(
            model="tiny", prompt="Answer:", max_tokens=60, temperature=temperature, seed=5, extra_body=extra
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].text
        return r.choices[0].text

    assert complete(guided_choice=["red", "green", "blue"]) in ("red", "green", "blue")
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", complete(guided_regex=r"[A-Z]{2}-[0-9]{3}"))
    jsonschema.validate(json.loads(complete(guided_json=PERSON)), PERSON)
    jsonschema.validate(json.loads(complete(guided_json=json.dumps(PERSON))), PERSON)
    assert complete(structured_outputs={"choice": ["on", "off"]}) in ("on", "off")
    assert re.fullmatch(r"(ab|cd)!", complete(structured_outputs={"grammar": 'root ::= ("ab" | "cd") "!"'}))
    jsonschema.validate(json.loads(complete(temperature=0.0, structured_outputs={"json": PERSON})), PERSON)


def test_invalid_specs_are_400(oai):
    def bad(**kw):
        with pytest.raises(openai.BadRequestError) as e:
            chat(oai, **kw)
        return e.value.body

    err = bad(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert err["param"] == "response_format" and "Invalid type" in err["message"]
    assert bad(response_format={"type": "json_schema", "json_schema": {"name": "x"}})["param"] == "response_format"
    assert bad(extra_body={"guided_regex": "a("})["param"] == "guided_regex"
    assert bad(extra_body={"guided_json": "{not json"})["param"] == "guided_json"
    assert bad(extra_body={"guided_choice": []})["param"] == "guided_choice"
    assert bad(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})["param"] == "structured_outputs"
    two = bad(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    assert "only one" in two["message"]
    # tools without tool_choice mean "auto", which this server (no --enable-auto-tool-choice) refuses
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert "--enable-auto-tool-choice" in bad(tools=[tool])["message"]
    assert chat(oai, max_tokens=4).choices[0].message.content is not None  # the server is fine after all that
