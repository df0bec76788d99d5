"""Tool calling end to end: `axonserve serve --enable-auto-tool-choice --tool-call-parser hermes`
+ the official OpenAI client, on a random tiny Llama whose chat template renders tools the
Hermes way. tool_choice required / named is constrained decoding, so even this model always
makes a well-formed call; "auto" is driven through the Hermes parser by constraining the output
to Hermes-format text with a regex.
"""

from __future__ import annotations

import json
import os

import openai
import pytest

from axonserve.frontends.openai.tools import template_messages
from axonserve.frontends.tokenizer import Tokenizer

from .server import serve

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(300)

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call functions. Signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 5}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir) -> str:
    from conftest import make_tiny_llama

    d = make_tiny_llama(str(tmp_path_factory.mktemp("tiny-tools")), smollm2_dir, vocab_size=49216)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(HERMES_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def oai(model_dir):
    args = (
        "--max-num-seqs",
        "16",
        "--max-model-len",
        "1024",
        "--num-kv-blocks",
        "512",
        "--served-model-name",
        "tiny",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    with serve(model_dir, *args) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(oai, **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 0)
    kw.setdefault("messages", MSGS)
    return oai.chat.completions.create(model="tiny", tools=TOOLS, **kw)


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def reassemble(stream) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """A client's view of a stream: content, calls (name, arguments) by index, finish_reason."""
    content, calls, finish = "", {}, None
    for ch in stream:
        for c in ch.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                if t.index not in calls:
                    assert t.id and t.id.startswith("call_") and t.type == "function" and t.function.name
                    calls[t.index] = [t.function.name, ""]
                else:
                    assert t.id is None and not t.function.name
                calls[t.index][1] += t.function.arguments or ""
            finish = c.finish_reason or finish
    return content or None, [tuple(v) for _, v in sorted(calls.items())], finish


def assert_valid_calls(calls: list[tuple[str, str]]):
    assert calls
    for name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_template_renders_tools_and_tool_messages(model_dir):
    tok = Tokenizer.load(model_dir)
    convo = template_messages(
        [
            *MSGS,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ]
    )
    text = tok.render_chat(convo, tools=TOOLS)
    assert '"name": "get_weather"' in text and "Current weather in a city" in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_named_tool_choice(oai):
    r = chat(oai, tool_choice=NAMED)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None  # OpenAI's (and vLLM's) reason for a named tool
    assert [n for n, _ in calls_of(c.message)] == ["get_weather"] and c.message.tool_calls[0].id.startswith("call_")
    assert_valid_calls(calls_of(c.message))
    assert reassemble(chat(oai, tool_choice=NAMED, stream=True)) == (None, calls_of(c.message), "stop")


def test_required_tool_choice_many_seeds(oai):
    for seed in range(4):
        kw = {"tool_choice": "required", "temperature": 1.0, "seed": seed}
        c = chat(oai, **kw).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c.message
        assert_valid_calls(calls_of(c.message))
        assert reassemble(chat(oai, stream=True, **kw)) == (None, calls_of(c.message), "tool_calls")
    one = chat(oai, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=1).choices[0]
    assert len(one.message.tool_calls) == 1


def test_auto_tool_choice_through_the_hermes_parser(oai):
    forced = (
        r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", '
        r'"days": [1-7]\}\}\n</tool_call>'
    )
    kw = {"tool_choice": "auto", "temperature": 1.0, "seed": 11, "extra_body": {"guided_regex": forced}}
    c = chat(oai, **kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking.\n"
    assert_valid_calls(calls_of(c.message))
    assert reassemble(chat(oai, stream=True, **kw)) == ("Checking.\n", calls_of(c.message), "tool_calls")
    # no call in the output: plain content
    plain = chat(oai, tool_choice="auto", extra_body={"guided_choice": ["No tool needed."]}).choices[0]
    assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == ("No tool needed.", None, "stop")


def test_tool_choice_none_and_a_conversation_with_tool_results(oai):
    convo = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    c = chat(oai, messages=convo, tool_choice="none", max_tokens=8, extra_body={"ignore_eos": True}).choices[0]
    assert c.message.tool_calls is None and c.finish_reason == "length" and c.message.content
    none_stream = reassemble(
        chat(oai, messages=convo, tool_choice="none", max_tokens=8, stream=True, extra_body={"ignore_eos": True})
    )
    assert none_stream == (c.message.content, [], "length")


def test_tool_request_errors(oai):
    def bad(**kw):
        with pytest.raises(openai.BadRequestError) as e:
            chat(oai, **kw)
        return e.value.body

    assert bad(tool_choice={"type": "function", "function": {"name": "nope"}})["param"] == "tool_choice"
    assert "cannot be combined" in bad(tool_choice="required", response_format={"type": "json_object"})["message"]
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=MSGS, tools=[broken], tool_choice="required")
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="tiny", messages=MSGS, tool_choice="required")
