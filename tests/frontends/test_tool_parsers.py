"""Tool-call parsers and tool_choice planning (frontends/openai/tools.py), whole and streamed.

Streaming is checked the way a client sees it: deltas of every chunking of the same output,
reassembled, must equal the non-streaming message, and held-back text must never leak.
"""

from __future__ import annotations

import json
import random

import pytest

from axonserve.frontends.openai.tools import (
    ChatTool,
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    NamedToolChoice,
    NamedToolParser,
    ToolCallFormatter,
    ToolParser,
    plan_tools,
    required_schema,
    template_messages,
)
from axonserve.protocol.messages import ParamError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def whole(parser: ToolParser, text: str, finish: str = "stop"):
    content, calls, reason = ToolCallFormatter(parser).message(text, finish)
    return content, [(c.function.name, c.function.arguments) for c in calls or []], reason


def streamed(parser: ToolParser, text: str, sizes: list[int], finish: str = "stop"):
    """Feed `text` in chunks of the given sizes (cycled); reassemble like an OpenAI client."""
    fmt = ToolCallFormatter(parser)
    chunks, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        chunks.append(text[i : i + n])
        i, k = i + n, k + 1
    chunks = chunks or [""]
    content, calls, reason = "", {}, None
    for j, chunk in enumerate(chunks):
        last = j == len(chunks) - 1
        text_delta, frags, reason = fmt.delta(0, chunk, finish if last else None)
        if not last:
            assert reason is None
        content += text_delta
        for f in frags or []:
            d = f.model_dump()
            if f.index not in calls:
                assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function"
                assert d["id"].startswith("call_") and "name" in d["function"]
                assert f.index == len(calls), "calls start in order"
                calls[f.index] = {"id": d["id"], "name": d["function"]["name"], "args": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[f.index]["args"] += d["function"].get("arguments", "")
    return content or None, [(c["name"], c["args"]) for _, c in sorted(calls.items())], reason


def assert_stream_equals_whole(parser_factory, text: str, finish: str = "stop"):
    expect = whole(parser_factory(), text, finish)
    rng = random.Random(len(text))
    for sizes in ([1], [2, 3], [7], [len(text) or 1], [rng.randint(1, 6) for _ in range(9)]):
        assert streamed(parser_factory(), text, sizes, finish) == expect, sizes
    return expect


# --------------------------------------------------------------------------- hermes

HERMES_ONE = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_TWO = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "note": "a}\\"b{"}}\n'
    '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>'
)


def test_hermes_one_call_with_content():
    content, calls, reason = assert_stream_equals_whole(HermesToolParser, HERMES_ONE)
    assert content == "Let me check.\n"
    assert calls == [("get_weather", '{"city": "Paris"}')] and reason == "tool_calls"
    assert json.loads(calls[0][1]) == {"city": "Paris"}


def test_hermes_two_calls_escapes_and_key_order():
    content, calls, reason = assert_stream_equals_whole(HermesToolParser, HERMES_TWO)
    assert content is None and reason == "tool_calls"
    assert [n for n, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1]) == {"city": "Rome", "note": 'a}"b{'} and calls[1][1] == "{}"


def test_hermes_streams_arguments_as_they_grow_and_holds_the_tag():
    fmt = ToolCallFormatter(HermesToolParser())
    seen = []
    for ch in HERMES_ONE:
        content, frags, _ = fmt.delta(0, ch, None)
        seen.append((content, frags))
        assert "<" not in content  # a partial "<tool_call>" is never emitted as content
    arg_frags = [f for _, fs in seen for f in fs or [] if f.id is None]
    assert len(arg_frags) > 3  # arguments arrive piece by piece, not at the end


def test_hermes_plain_text_and_malformed_calls_are_content():
    for text in ("Just an answer with a < sign and <tool_ not a tag", "<tool_call>\nnot json\n</tool_call>"):
        content, calls, reason = assert_stream_equals_whole(HermesToolParser, text)
        assert (content, calls, reason) == (text, [], "stop")
    # cut by max_tokens mid-call: the whole message is content (as vLLM's); a stream has already
    # sent the call's start and cannot take it back, but its finish_reason stays "length" too
    cut = HERMES_ONE[:-20]
    assert whole(HermesToolParser(), cut, "length") == (cut, [], "length")
    content, calls, reason = streamed(HermesToolParser(), cut, [3], "length")
    assert content == "Let me check.\n" and calls == [("get_weather", '{"city": "P')] and reason == "length"


# --------------------------------------------------------------------------- llama 3 json


def test_llama3_json_calls():
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    )
    content, calls, reason = assert_stream_equals_whole(Llama3JsonToolParser, text)
    assert content is None and reason == "tool_calls"
    assert calls == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    _, calls, _ = assert_stream_equals_whole(Llama3JsonToolParser, ' {"name": "f", "arguments": [1, 2]}')
    assert calls == [("f", "[1, 2]")]


def test_llama3_json_content():
    for text in ("The weather is fine.", '{"answer": 42}', "   ", "<|python_tag|>"):
        content, calls, reason = assert_stream_equals_whole(Llama3JsonToolParser, text)
        assert (content, calls, reason) == (text, [], "stop")
    assert whole(Llama3JsonToolParser(), '{"name": "f", "parameters": {"a": 1}} and so on') == (
        None,
        [("f", '{"a": 1}')],
        "tool_calls",
    )


# --------------------------------------------------------------------------- required / named


def test_required_array_and_named():
    text = '[{"name":"get_weather","parameters":{"city":"Lima"}},{"name":"get_time","parameters":{}}]'
    content, calls, reason = assert_stream_equals_whole(JsonArrayToolParser, text)
    assert content is None and reason == "tool_calls"
    assert calls == [("get_weather", '{"city":"Lima"}'), ("get_time", "{}")]
    content, calls, reason = assert_stream_equals_whole(lambda: NamedToolParser("get_weather"), '{"city":"Kyiv"}')
    assert (content, calls, reason) == (None, [("get_weather", '{"city":"Kyiv"}')], "stop")  # as OpenAI reports
    # a named call's header goes out before any argument text
    _, frags, _ = ToolCallFormatter(NamedToolParser("get_weather")).delta(0, "", None)
    assert frags is not None and frags[0].function.name == "get_weather" and frags[0].id


def test_choices_stream_independently():
    fmt = ToolCallFormatter(NamedToolParser("f"))
    a = fmt.delta(0, '{"x":', None)[1]
    b = fmt.delta(1, '{"y":', None)[1]
    assert a[0].id != b[0].id and a[0].index == b[0].index == 0
    assert fmt.delta(0, "1}", "stop")[1][0].function.arguments == "1}"


# --------------------------------------------------------------------------- planning


def tools(*ts):
    return [ChatTool.model_validate(t) for t in ts]


def test_plan_tool_choice_rules():
    ts = tools(WEATHER, TIME)
    assert plan_tools(None, None) is None
    none = plan_tools(ts, "none")
    assert none.parser is None and none.structured is None and none.template_kwargs()["tools"][0] == WEATHER
    with pytest.raises(ParamError, match="--enable-auto-tool-choice"):
        plan_tools(ts, None)  # tools without tool_choice mean "auto"
    with pytest.raises(ParamError, match="--enable-auto-tool-choice"):
        plan_tools(ts, "auto", enable_auto_tool_choice=True)  # no parser
    auto = plan_tools(ts, "auto", True, "hermes")
    assert isinstance(auto.parser, HermesToolParser) and auto.structured is None
    with pytest.raises(ParamError, match="`tools` must be set"):
        plan_tools(None, "required")
    with pytest.raises(ParamError, match="not in `tools`"):
        plan_tools(ts, NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}}))
    with pytest.raises(ParamError, match="unique"):
        plan_tools(tools(WEATHER, WEATHER), "required")
    named = plan_tools(ts, NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}}))
    assert named.structured.kind == "json" and json.loads(named.structured.spec) == WEATHER["function"]["parameters"]
    req = plan_tools(ts, "required")
    assert isinstance(req.parser, JsonArrayToolParser)
    assert json.loads(req.structured.spec) == required_schema(ts)


def test_required_schema_accepts_exactly_the_tool_calls():
    jsonschema = pytest.importorskip("jsonschema")
    defs_tool = {
        "type": "function",
        "function": {
            "name": "put",
            "parameters": {
                "type": "object",
                "properties": {"item": {"$ref": "#/$defs/item"}},
                "required": ["item"],
                "$defs": {"item": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
            },
        },
    }
    schema = required_schema(tools(WEATHER, defs_tool))
    assert "$defs" in schema and "$defs" not in json.dumps(schema["items"]).replace("#/$defs", "")
    ok = [{"name": "get_weather", "parameters": {"city": "x"}}, {"name": "put", "parameters": {"item": {"n": 1}}}]
    jsonschema.validate(ok, schema)
    for bad in (
        [],
        [{"name": "get_time", "parameters": {}}],
        [{"name": "put", "parameters": {"item": {"n": "1"}}}],
        [{"name": "get_weather", "parameters": {"city": "x"}, "extra": 1}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_template_messages_parse_assistant_arguments():
    msgs = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    out = template_messages(msgs)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and out[2] == msgs[2]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # input untouched
    with pytest.raises(ParamError, match="not valid JSON"):
        template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])
