"""Chat tool calling: request/response models, tool_choice planning, output parsers.

tool_choice (vLLM semantics):
- "none": tools reach the chat template, the output is plain content.
- "auto" (the default when tools are given): needs the server flags `--enable-auto-tool-choice
  --tool-call-parser {hermes,llama3_json}` (else 400); the model writes calls in its own format
  and the parser finds them: Hermes `<tool_call>{"name", "arguments"}</tool_call>` blocks, or
  Llama-3.1 `{"name", "parameters"}` objects (optionally after `<|python_tag|>`, `;`-separated).
- "required" / a named function: constrained decoding, like vLLM. Named: the output is the
  function's arguments, constrained to its parameters schema. Required: a JSON array of
  `{"name", "parameters"}` with one schema branch per tool, at least one item.

Every parser works by re-scanning the accumulated text, so one code path serves whole outputs
and streams: a call's `arguments` is the raw JSON text the model wrote for it (valid JSON once
complete), streamed as it grows, so reassembled stream deltas equal the non-streaming message.
A stream holds back text that may still turn into a call (a partial `<tool_call>` tag). When the
finished output holds no well-formed call, the whole text is plain content.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from axonserve.engine.structured import json_schema
from axonserve.protocol.messages import ParamError, StructuredOutputsParams

PARSERS = ("hermes", "llama3_json")


# --------------------------------------------------------------------------- API models


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # strict, ... reach the template

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: _FunctionName


class FunctionCall(BaseModel):
    name: str
    arguments: str


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCall(BaseModel):
    id: str = Field(default_factory=call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _only_set(self) -> dict[str, str]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class DeltaToolCall(BaseModel):
    """A stream fragment of call `index`: its first carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type=self.type or "function")
        out["function"] = self.function.model_dump()
        return out


# --------------------------------------------------------------------------- planning


@dataclass
class ToolPlan:
    """What a chat request's tools mean for the prompt, the decoding and the output."""

    tools: list[dict[str, Any]]  # for the chat template
    parser: ToolParser | None  # None: plain content (tool_choice none)
    structured: StructuredOutputsParams | None = None  # required / named: constrained decoding

    def template_kwargs(self) -> dict[str, Any]:
        return {"tools": self.tools} if self.tools else {}

    def formatter(self) -> ToolCallFormatter | None:
        return ToolCallFormatter(self.parser) if self.parser is not None else None


def plan_tools(tools: list[ChatTool] | None, tool_choice: str | NamedToolChoice | None,
               enable_auto_tool_choice: bool = False, tool_call_parser: str = "",
               parallel_tool_calls: bool = True) -> ToolPlan | None:
    """Validate tools + tool_choice against the server's flags (ParamError -> 400).
    parallel_tool_calls=False limits tool_choice "required" to one call."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise ParamError("tool_choice", "when using `tool_choice`, `tools` must be set")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ParamError("tools", "tool function names must be unique")
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(rendered, None)
    if choice == "auto":
        if not (enable_auto_tool_choice and tool_call_parser):
            raise ParamError("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and '
                                            "--tool-call-parser to be set")
        return ToolPlan(rendered, make_parser(tool_call_parser))
    if choice == "required":
        schema = required_schema(tools, max_calls=None if parallel_tool_calls else 1)
        return ToolPlan(rendered, JsonArrayToolParser(), json_schema(schema))
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise ParamError("tool_choice", f"tool_choice names function {choice.function.name!r}, "
                                            f"which is not in `tools`")
        return ToolPlan(rendered, NamedToolParser(tool.function.name), json_schema(_parameters(tool)))
    raise ParamError("tool_choice", f"unsupported tool_choice {choice!r}")


def make_parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesToolParser()
    if name == "llama3_json":
        return Llama3JsonToolParser()
    raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(PARSERS)}")


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return copy.deepcopy(tool.function.parameters) or {"type": "object", "properties": {}}


def required_schema(tools: list[ChatTool], max_calls: int | None = None) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": `[{"name": <tool>, "parameters": <its schema>}, ...]`,
    each tool's `$defs` hoisted to the top so their `#/$defs/...` references still resolve."""
    defs: dict[str, Any] = {}
    branches = []
    for t in tools:
        params = _parameters(t)
        for k, v in params.pop("$defs", {}).items():
            if k in defs and defs[k] != v:
                raise ParamError("tools", f"tools define `$defs/{k}` differently")
            defs[k] = v
        branches.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant `tool_calls` arguments arrive as JSON text; chat templates expect objects
    (they render them with `tojson`), as vLLM passes them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise ParamError("messages", f"tool call arguments are not valid JSON: {args!r}") from None
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


# --------------------------------------------------------------------------- scanning JSON


class _Malformed(ValueError):
    """The text cannot be the tool-call JSON the parser expects."""


_WS = " \t\n\r"


def _ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a complete JSON string (unrolled: linear)
_STRUCTURE = re.compile(r'["{}\[\]]')


def _string_end(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at s[i] == '"', None if it is still open.
    Regex scans: a stream re-scans its whole text on every token, so no per-char Python loops."""
    m = _STRING.match(s, i)
    return m.end() if m else None


def _value_end(s: str, i: int) -> int | None:
    """End of the JSON value starting at s[i], None while it is incomplete."""
    if s[i] == '"':
        return _string_end(s, i)
    if s[i] in "{[":
        depth, j = 0, i
        while (m := _STRUCTURE.search(s, j)) is not None:
            j = m.start()
            if s[j] == '"':
                end = _string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if s[j] in "{[" else -1
            if depth == 0:
                return j + 1
            j += 1
        return None
    j = i  # number / true / false / null: ends at a delimiter
    while j < len(s) and s[j] not in _WS + ",}]":
        j += 1
    return j if j < len(s) else None


def _object(s: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The object at s[i] == '{': key -> (value start, value end or None), and its own end."""
    members: dict[str, tuple[int, int | None]] = {}
    j = _ws(s, i + 1)
    if j < len(s) and s[j] == "}":
        return members, j + 1
    while j < len(s):
        if s[j] != '"':
            raise _Malformed(s[j])
        k = _string_end(s, j)
        if k is None:
            return members, None
        try:
            key = json.loads(s[j:k])
        except ValueError:
            raise _Malformed(s[j:k]) from None
        j = _ws(s, k)
        if j == len(s):
            return members, None
        if s[j] != ":":
            raise _Malformed(s[j])
        v = _ws(s, j + 1)
        if v == len(s):
            return members, None
        end = _value_end(s, v)
        members[key] = (v, end)
        if end is None:
            return members, None
        j = _ws(s, end)
        if j == len(s):
            return members, None
        if s[j] == "}":
            return members, j + 1
        if s[j] != ",":
            raise _Malformed(s[j])
        j = _ws(s, j + 1)
    return members, None


@dataclass
class PartialCall:
    name: str | None  # None until the name string is complete
    arguments: str  # raw JSON text of the arguments so far (grows by appending)


@dataclass
class Scan:
    content_end: int  # text[:content_end] is plain content, safe to emit
    calls: list[PartialCall] = field(default_factory=list)
    valid: bool = True  # False: the text broke the expected call format


def _call(s: str, i: int, arg_keys: tuple[str, ...]) -> tuple[PartialCall, int | None]:
    members, end = _object(s, i)
    name = None
    if "name" in members and members["name"][1] is not None:
        a, b = members["name"]
        try:
            name = json.loads(s[a:b])
        except ValueError:
            raise _Malformed(s[a:b]) from None
        if not isinstance(name, str):
            raise _Malformed("name")
    args = ""
    for key in arg_keys:
        if key in members:
            a, b = members[key]
            args = s[a : len(s) if b is None else b]
            break
    return PartialCall(name, args), end


def _held_prefix(s: str, tag: str) -> int:
    """Length of the longest end of `s` that could start `tag` (held back while streaming)."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


# --------------------------------------------------------------------------- parsers


class ToolParser:
    """Finds tool calls in (partial) model output."""

    def scan(self, text: str) -> Scan:
        raise NotImplementedError

    def calls(self, text: str) -> tuple[str | None, list[FunctionCall]] | None:
        """(content, calls) of a finished output, None when it holds no well-formed call."""
        scan = self.scan(text)
        if not scan.valid or not scan.calls:
            return None
        out = []
        for c in scan.calls:
            if c.name is None:
                return None
            try:
                json.loads(c.arguments)
            except ValueError:
                return None
            out.append(FunctionCall(name=c.name, arguments=c.arguments))
        return text[: scan.content_end] or None, out


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, content before the first."""

    START = "<tool_call>"

    def scan(self, text: str) -> Scan:
        start = text.find(self.START)
        if start < 0:
            return Scan(len(text) - _held_prefix(text, self.START))
        calls: list[PartialCall] = []
        pos = start
        try:
            while pos >= 0:
                i = _ws(text, pos + len(self.START))
                if i == len(text):
                    break
                if text[i] != "{":
                    raise _Malformed(text[i])
                call, end = _call(text, i, ("arguments", "parameters"))
                calls.append(call)
                if end is None:
                    break
                pos = text.find(self.START, end)
        except _Malformed:
            return Scan(start, calls, valid=False)
        return Scan(start, calls)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 JSON calls: `{"name": ..., "parameters": {...}}` (`; `-separated), optionally
    after `<|python_tag|>`; output that starts otherwise is content, text after the calls is
    dropped (as Hermes drops text after its last `</tool_call>`)."""

    BOT = "<|python_tag|>"

    def scan(self, text: str) -> Scan:
        i = _ws(text, 0)
        if text.startswith(self.BOT, i):
            i = _ws(text, i + len(self.BOT))
        elif self.BOT.startswith(text[i:]):  # empty, or a partial tag: undecided
            return Scan(0)
        if i == len(text):
            return Scan(0)
        if text[i] != "{":
            return Scan(len(text))
        calls: list[PartialCall] = []
        try:
            while True:
                call, end = _call(text, i, ("parameters", "arguments"))
                calls.append(call)
                if end is None:
                    break
                j = _ws(text, end)
                if j == len(text) or text[j] != ";":  # text after the last call is dropped
                    break
                i = _ws(text, j + 1)
                if i == len(text):
                    break
                if text[i] != "{":
                    raise _Malformed(text[i])
        except _Malformed:
            return Scan(0, calls, valid=False)
        return Scan(0, calls)


class JsonArrayToolParser(ToolParser):
    """tool_choice "required": the constrained output `[{"name": ..., "parameters": {...}}, ...]`."""

    def scan(self, text: str) -> Scan:
        i = _ws(text, 0)
        if i == len(text):
            return Scan(0)
        calls: list[PartialCall] = []
        try:
            if text[i] != "[":
                raise _Malformed(text[i])
            i = _ws(text, i + 1)
            while i < len(text) and text[i] != "]":
                if text[i] != "{":
                    raise _Malformed(text[i])
                call, end = _call(text, i, ("parameters", "arguments"))
                calls.append(call)
                if end is None:
                    break
                j = _ws(text, end)
                if j == len(text) or text[j] == "]":
                    break
                if text[j] != ",":
                    raise _Malformed(text[j])
                i = _ws(text, j + 1)
        except _Malformed:
            return Scan(0, calls, valid=False)
        return Scan(0, calls)


class NamedToolParser(ToolParser):
    """A named tool_choice: the whole (constrained) output is that function's arguments."""

    def __init__(self, name: str):
        self.name = name

    def scan(self, text: str) -> Scan:
        return Scan(0, [PartialCall(self.name, text)])


# --------------------------------------------------------------------------- formatting


@dataclass
class _Stream:
    text: str = ""
    content_sent: int = 0
    ids: list[str] = field(default_factory=list)
    args_sent: list[int] = field(default_factory=list)


class ToolCallFormatter:
    """Turns one request's output (every choice) into content + tool_calls, whole or streamed."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self._streams: dict[int, _Stream] = {}
        # a named tool_choice finishes with "stop", as OpenAI's API (and vLLM) report it
        self._calls_reason = "stop" if isinstance(parser, NamedToolParser) else "tool_calls"

    def _finish(self, reason: str | None) -> str | None:
        return self._calls_reason if reason == "stop" else reason

    def message(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
        """(content, tool_calls, finish_reason) of a finished choice."""
        found = self.parser.calls(text)
        if found is None:
            return text, None, finish_reason
        content, calls = found
        return content, [ToolCall(function=c) for c in calls], self._finish(finish_reason)

    def delta(self, index: int, text: str, finish_reason: str | None
              ) -> tuple[str, list[DeltaToolCall] | None, str | None]:
        """(content, tool call fragments, finish_reason) for choice `index`'s next text."""
        st = self._streams.setdefault(index, _Stream())
        st.text += text
        scan = self.parser.scan(st.text)
        content = ""
        if scan.content_end > st.content_sent:
            content, st.content_sent = st.text[st.content_sent : scan.content_end], scan.content_end
        frags: list[DeltaToolCall] = []
        for k, call in enumerate(scan.calls if scan.valid else []):
            if call.name is None:
                break
            if k == len(st.ids):
                st.ids.append(call_id())
                st.args_sent.append(len(call.arguments))
                frags.append(DeltaToolCall(index=k, id=st.ids[k], type="function",
                                           function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
            elif len(call.arguments) > st.args_sent[k]:
                frags.append(DeltaToolCall(index=k, function=DeltaFunctionCall(
                    arguments=call.arguments[st.args_sent[k]:])))
                st.args_sent[k] = len(call.arguments)
        if finish_reason is not None:
            if self.parser.calls(st.text) is not None:
                finish_reason = self._finish(finish_reason)
            elif not st.ids:  # no call after all: what was held back is content
                content += st.text[st.content_sent:]
                st.content_sent = len(st.text)
        return content, frags or None, finish_reason

