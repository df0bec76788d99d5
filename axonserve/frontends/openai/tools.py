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

Every parser is an incremental scanner fed the text piece by piece (a whole output is one
piece), so one code path serves whole outputs and streams, and a stream's delta costs O(delta)
scanning however long the output already is: a call's `arguments` is the raw JSON text the model
wrote for it (valid JSON once complete), streamed as it grows, so reassembled stream deltas
equal the non-streaming message.
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

from axonserve.protocol.messages import ParamError, StructuredOutputsParams
from axonserve.structured_output.grammar import json_schema

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


def plan_tools(
    tools: list[ChatTool] | None,
    tool_choice: str | NamedToolChoice | None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str = "",
    parallel_tool_calls: bool = True,
) -> ToolPlan | None:
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
            raise ParamError(
                "tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            )
        return ToolPlan(rendered, make_parser(tool_call_parser))
    if choice == "required":
        schema = required_schema(tools, max_calls=None if parallel_tool_calls else 1)
        return ToolPlan(rendered, JsonArrayToolParser(), json_schema(schema))
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise ParamError(
                "tool_choice", f"tool_choice names function {choice.function.name!r}, which is not in `tools`"
            )
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
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
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
#
# A stream's text only ever grows, so every scanner below is a state machine that resumes where
# the previous delta stopped, holding absolute positions into the text. Re-scanning the whole
# text on each delta made a stream's parsing quadratic in its length (issue 27 item 7).


class _Malformed(ValueError):
    """The text cannot be the tool-call JSON the parser expects."""


_NOWHERE = 1 << 62  # a position no text reaches: "nothing needed from here"
_WS_RUN = re.compile(r"[ \t\n\r]*")
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)  # inside a JSON string, up to its end
_SCALAR = re.compile(r"[^ \t\n\r,}\]]*")  # number / true / false / null: up to a delimiter
_STRUCTURE = re.compile(r'["{}\[\]]')


class _Window:
    """The part of a stream's text a scanner may still read: `buf` is text[off:]. Positions are
    absolute, so they survive `trim`, which drops what no one will read again (so appending
    copies the open call, not the whole output). `scanned` counts characters examined."""

    __slots__ = ("buf", "off", "scanned")

    def __init__(self) -> None:
        self.buf = ""
        self.off = 0
        self.scanned = 0

    @property
    def end(self) -> int:
        return self.off + len(self.buf)

    def trim(self, pos: int) -> None:
        pos = min(pos, self.end)
        if pos > self.off:
            self.buf = self.buf[pos - self.off :]
            self.off = pos

    def slice(self, a: int, b: int | None = None) -> str:
        assert a >= self.off, (a, self.off)
        return self.buf[a - self.off : None if b is None else b - self.off]

    def char(self, i: int) -> str:
        return self.buf[i - self.off]

    def ws(self, i: int) -> int:
        """First non-whitespace position at or after i (the end if none yet)."""
        j = _WS_RUN.match(self.buf, i - self.off).end() + self.off
        self.scanned += j - i + 1
        return j

    def find(self, sub: str, i: int) -> int:
        k = self.buf.find(sub, i - self.off)
        self.scanned += (len(self.buf) if k < 0 else k + len(sub)) - (i - self.off)
        return k + self.off if k >= 0 else -1

    def string(self, i: int) -> tuple[int | None, int]:
        """Scan a JSON string's body from i: (end after its closing quote or None, resume at)."""
        k = _STRING_BODY.match(self.buf, i - self.off).end()
        self.scanned += k - (i - self.off) + 1
        if k < len(self.buf) and self.buf[k] == '"':
            return k + 1 + self.off, k + 1 + self.off
        return None, k + self.off  # open (k may be a lone trailing backslash: rescanned)

    def scalar(self, i: int) -> int:
        k = _SCALAR.match(self.buf, i - self.off).end()
        self.scanned += k - (i - self.off) + 1
        return k + self.off

    def structure(self, i: int) -> int | None:
        m = _STRUCTURE.search(self.buf, i - self.off)
        self.scanned += (m.start() + 1 if m else len(self.buf)) - (i - self.off)
        return m.start() + self.off if m else None


class _Value:
    """Where the JSON value starting at `start` ends, found incrementally. Only strings are
    checked; containers are matched by bracket depth and scalars end at a delimiter."""

    __slots__ = ("start", "kind", "j", "depth", "in_string")

    def __init__(self, w: _Window, start: int):
        c = w.char(start)
        self.start = start
        self.kind = c if c in '"{[' else ""
        self.j = start + 1 if c == '"' else start
        self.depth = 0
        self.in_string = False

    def end(self, w: _Window) -> int | None:
        """The value's end (exclusive), None while it is incomplete."""
        if self.kind == '"':
            end, self.j = w.string(self.j)
            return end
        if not self.kind:
            self.j = w.scalar(self.j)
            return self.j if self.j < w.end else None
        while True:
            if self.in_string:
                end, self.j = w.string(self.j)
                if end is None:
                    return None
                self.in_string = False
            k = w.structure(self.j)
            if k is None:
                self.j = w.end
                return None
            self.j = k + 1
            c = w.char(k)
            if c == '"':
                self.in_string = True
                continue
            self.depth += 1 if c in "{[" else -1
            if self.depth == 0:
                return k + 1


_OPEN, _KEY, _KEY_STRING, _COLON, _VALUE_START, _VALUE, _AFTER_VALUE = range(7)


class _Call:
    """One call object `{"name": ..., <args key>: ...}` parsed as it streams in.

    `members` maps each key to (value start, value end or None while open), a later duplicate
    key replacing an earlier one; `name` is the parsed name once its value is complete."""

    __slots__ = (
        "start",
        "arg_keys",
        "members",
        "end",
        "name",
        "name_bad",
        "_state",
        "_j",
        "_key",
        "_key_start",
        "_value",
    )

    def __init__(self, start: int, arg_keys: tuple[str, ...]):
        self.start = start
        self.arg_keys = arg_keys
        self.members: dict[str, tuple[int, int | None]] = {}
        self.end: int | None = None  # end of the object, once complete
        self.name: str | None = None
        self.name_bad = False  # the complete "name" is not a JSON string: the call is malformed
        self._state = _OPEN
        self._j = start + 1
        self._key = ""
        self._key_start = 0
        self._value: _Value | None = None

    def args(self, text_end: int) -> tuple[int, int] | None:
        """Span of the arguments' raw JSON text so far (None before its key appears)."""
        for key in self.arg_keys:
            if key in self.members:
                a, b = self.members[key]
                return a, text_end if b is None else b
        return None

    def need(self) -> int:
        """First position this parse may read again (a key or a name is decoded whole)."""
        if self.end is not None:
            return _NOWHERE
        if self._state == _KEY_STRING:
            return self._key_start
        if self._state == _VALUE:
            assert self._value is not None
            return self._value.start if self._key == "name" else self._value.j
        return self._j

    def _member(self, w: _Window, start: int, end: int | None) -> None:
        self.members[self._key] = (start, end)
        if self._key == "name":
            self.name, self.name_bad = None, False
            if end is not None:
                try:
                    name = json.loads(w.slice(start, end))
                except ValueError:
                    name = None
                self.name, self.name_bad = (name, False) if isinstance(name, str) else (None, True)

    def advance(self, w: _Window) -> bool:
        """Parse on from where the last delta stopped; True once the object is complete."""
        while True:
            st = self._state
            if st in (_OPEN, _KEY):
                j = self._j = w.ws(self._j)
                if j == w.end:
                    return False
                c = w.char(j)
                if st == _OPEN and c == "}":
                    self.end = j + 1
                    return True
                if c != '"':
                    raise _Malformed(c)
                self._key_start, self._j, self._state = j, j + 1, _KEY_STRING
            elif st == _KEY_STRING:
                end, self._j = w.string(self._j)
                if end is None:
                    return False
                try:
                    self._key = json.loads(w.slice(self._key_start, end))
                except ValueError:
                    raise _Malformed(w.slice(self._key_start, end)) from None
                self._state = _COLON
            elif st == _COLON:
                j = self._j = w.ws(self._j)
                if j == w.end:
                    return False
                if w.char(j) != ":":
                    raise _Malformed(w.char(j))
                self._j, self._state = j + 1, _VALUE_START
            elif st == _VALUE_START:
                v = self._j = w.ws(self._j)
                if v == w.end:
                    return False
                self._value = _Value(w, v)
                self._member(w, v, None)
                self._state = _VALUE
            elif st == _VALUE:
                assert self._value is not None
                end = self._value.end(w)
                if end is None:
                    return False
                self._member(w, self._value.start, end)
                self._j, self._value, self._state = end, None, _AFTER_VALUE
            else:  # _AFTER_VALUE
                j = self._j = w.ws(self._j)
                if j == w.end:
                    return False
                c = w.char(j)
                if c == "}":
                    self.end = j + 1
                    return True
                if c != ",":
                    raise _Malformed(c)
                self._j, self._state = j + 1, _KEY


def _held_prefix(s: str, tag: str) -> int:
    """Length of the longest end of `s` that could start `tag` (held back while streaming)."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


@dataclass
class PartialCall:
    name: str | None  # None until the name string is complete
    arguments: str  # raw JSON text of the arguments so far (grows by appending)


@dataclass
class Scan:
    content_end: int  # text[:content_end] is plain content, safe to emit
    calls: list[PartialCall] = field(default_factory=list)
    valid: bool = True  # False: the text broke the expected call format


class Scanner:
    """Incremental scan of one output: `feed` each new piece of text; the state (content end,
    calls so far, validity) is what a full re-scan of the text so far would find."""

    ARG_KEYS: tuple[str, ...] = ()  # the keys a call's arguments may stand under

    def __init__(self) -> None:
        self.w = _Window()
        self.content_end = 0
        self.calls: list[_Call] = []
        self.broken = False  # the text broke the format for good
        self._in_call = False

    @property
    def valid(self) -> bool:
        return not self.broken and not (self.calls and self.calls[-1].name_bad)

    def feed(self, text: str) -> None:
        self.w.buf += text
        if self.broken:
            return
        try:
            self._advance()
        except _Malformed:
            self.broken = True
            if self._in_call:  # a full scan never lists the call it found malformed
                self.calls.pop()

    def need(self) -> int:
        """First position the scan may read again (content still undecided counts)."""
        if self.broken:
            return _NOWHERE
        if self._in_call:
            return self.calls[-1].need()
        return self._need()

    def _call(self, start: int, arg_keys: tuple[str, ...]) -> None:
        self.calls.append(_Call(start, arg_keys))
        self._in_call = True

    def _advance_call(self) -> bool:
        """Parse the open call on; True when it completed (well-formed)."""
        call = self.calls[-1]
        if not call.advance(self.w):
            return False
        if call.name_bad:
            raise _Malformed("name")
        self._in_call = False
        return True

    def _advance_objects(self, sep: str, close: str | None) -> None:
        """Go on through calls written as JSON objects separated by `sep`: phases _NEXT (an
        object or `close` expected), _CALL (inside one), _AFTER (`sep`, or `close`; with no
        `close` anything else ends the calls) and _DONE."""
        w = self.w
        while True:
            if self.phase == _NEXT:
                i = self.pos = w.ws(self.pos)
                if i == w.end:
                    return
                c = w.char(i)
                if c == close:
                    self.phase = _DONE
                    return
                if c != "{":
                    raise _Malformed(c)
                self._call(i, self.ARG_KEYS)
                self.phase = _CALL
            if self.phase == _CALL:
                if not self._advance_call():
                    return
                end = self.calls[-1].end
                assert end is not None
                self.phase, self.pos = _AFTER, end
            if self.phase == _AFTER:
                j = self.pos = w.ws(self.pos)
                if j == w.end:
                    return
                c = w.char(j)
                if c == sep:
                    self.phase, self.pos = _NEXT, j + 1
                elif close is None or c == close:
                    self.phase = _DONE
                else:
                    raise _Malformed(c)
            if self.phase == _DONE:
                return

    def _advance(self) -> None:
        raise NotImplementedError

    def _need(self) -> int:
        raise NotImplementedError

    def result(self) -> Scan:
        """The scan as a whole-text parse reports it (needs the whole text still in the window)."""
        calls = self.calls[:-1] if self.calls and self.calls[-1].name_bad else self.calls
        end = self.w.end
        out = []
        for c in calls:
            span = c.args(end)
            out.append(PartialCall(c.name, self.w.slice(*span) if span else ""))
        return Scan(self.content_end, out, self.valid)


# --------------------------------------------------------------------------- parsers


class ToolParser:
    """Finds tool calls in (partial) model output."""

    def scanner(self) -> Scanner:
        raise NotImplementedError

    def scan(self, text: str) -> Scan:
        sc = self.scanner()
        sc.feed(text)
        return sc.result()

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


_SEEK, _TAG, _CALL, _NEXT, _LEAD, _CONTENT, _AFTER, _DONE = range(8)


class _HermesScanner(Scanner):
    START = "<tool_call>"
    ARG_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        super().__init__()
        self.phase = _SEEK
        self.pos = 0  # where the next search / skip resumes

    def _need(self) -> int:
        return self.pos

    def _advance(self) -> None:
        w, tag = self.w, self.START
        if self.phase == _SEEK:
            i = w.find(tag, self.pos)
            if i < 0:  # content, less an end that may start the tag
                self.pos = max(self.pos, w.end - len(tag) + 1)
                self.content_end = w.end - _held_prefix(w.slice(max(w.off, w.end - len(tag))), tag)
                return
            self.content_end, self.phase, self.pos = i, _TAG, i + len(tag)
        while True:
            if self.phase == _TAG:
                i = self.pos = w.ws(self.pos)
                if i == w.end:
                    return
                if w.char(i) != "{":
                    raise _Malformed(w.char(i))
                self._call(i, self.ARG_KEYS)
                self.phase = _CALL
            if self.phase == _CALL:
                if not self._advance_call():
                    return
                end = self.calls[-1].end
                assert end is not None
                self.phase, self.pos = _NEXT, end
            i = w.find(tag, self.pos)  # _NEXT: text between calls is skipped
            if i < 0:
                self.pos = max(self.pos, w.end - len(tag) + 1)
                return
            self.phase, self.pos = _TAG, i + len(tag)


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, content before the first."""

    START = _HermesScanner.START

    def scanner(self) -> Scanner:
        return _HermesScanner()


class _Llama3Scanner(Scanner):
    BOT = "<|python_tag|>"
    ARG_KEYS = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self.phase = _LEAD
        self.pos = 0
        self.bot = False  # `<|python_tag|>` seen

    def _need(self) -> int:
        if self.phase == _LEAD:
            return 0  # undecided: all of it may still turn out to be content
        if self.phase == _DONE:
            return _NOWHERE
        return self.content_end if self.phase == _CONTENT else self.pos

    def _advance(self) -> None:
        w, bot = self.w, self.BOT
        if self.phase == _CONTENT:
            self.content_end = w.end
            return
        if self.phase == _LEAD:
            i = self.pos = w.ws(self.pos)
            if not self.bot:
                head = w.slice(i, min(w.end, i + len(bot)))
                if head == bot:
                    self.bot = True
                    i = self.pos = w.ws(i + len(bot))
                elif bot.startswith(head):  # empty, or a partial tag: undecided
                    return
            if i == w.end:
                return
            if w.char(i) != "{":  # not a call: the whole output is content
                self.phase, self.content_end = _CONTENT, w.end
                return
            self._call(i, self.ARG_KEYS)
            self.phase = _CALL
        self._advance_objects(";", None)  # text after the last call is dropped


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 JSON calls: `{"name": ..., "parameters": {...}}` (`; `-separated), optionally
    after `<|python_tag|>`; output that starts otherwise is content, text after the calls is
    dropped (as Hermes drops text after its last `</tool_call>`)."""

    BOT = _Llama3Scanner.BOT

    def scanner(self) -> Scanner:
        return _Llama3Scanner()


class _JsonArrayScanner(Scanner):
    ARG_KEYS = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self.phase = _LEAD
        self.pos = 0

    def _need(self) -> int:
        return _NOWHERE if self.phase == _DONE else self.pos

    def _advance(self) -> None:
        w = self.w
        if self.phase == _LEAD:
            i = self.pos = w.ws(self.pos)
            if i == w.end:
                return
            if w.char(i) != "[":
                raise _Malformed(w.char(i))
            self.phase, self.pos = _NEXT, i + 1
        self._advance_objects(",", "]")


class JsonArrayToolParser(ToolParser):
    """tool_choice "required": the constrained output `[{"name": ..., "parameters": {...}}, ...]`."""

    def scanner(self) -> Scanner:
        return _JsonArrayScanner()


class _NamedScanner(Scanner):
    def __init__(self, name: str) -> None:
        super().__init__()
        call = _Call(0, ("arguments",))
        call.name, call.members["arguments"] = name, (0, None)
        self.calls.append(call)

    def _need(self) -> int:
        return _NOWHERE

    def _advance(self) -> None:
        pass


class NamedToolParser(ToolParser):
    """A named tool_choice: the whole (constrained) output is that function's arguments."""

    def __init__(self, name: str):
        self.name = name

    def scanner(self) -> Scanner:
        return _NamedScanner(self.name)


# --------------------------------------------------------------------------- formatting


@dataclass
class _Stream:
    scanner: Scanner
    parts: list[str] = field(default_factory=list)  # the whole text, joined only at the end
    content_sent: int = 0
    ids: list[str] = field(default_factory=list)
    args_sent: list[int] = field(default_factory=list)
    settled: int = 0  # calls before this are complete and fully sent: never looked at again

    def need(self) -> int:
        """First position of text the stream may still send as a call's arguments."""
        sc = self.scanner
        if sc.broken or self.settled >= len(sc.calls):
            return _NOWHERE
        k, call = self.settled, sc.calls[self.settled]
        span = call.args(sc.w.end)
        if span is None or (call.end is not None and call.name is None):
            return _NOWHERE  # arguments yet to come lie ahead of the scan / blocked for good
        return span[0] + (self.args_sent[k] if k < len(self.ids) else 0)


class ToolCallFormatter:
    """Turns one request's output (every choice) into content + tool_calls, whole or streamed.

    A stream keeps its scanner between deltas, so each delta costs O(delta) scanning plus a
    copy of the still-open call's text, not a re-scan of all the text so far."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self._streams: dict[int, _Stream] = {}
        # a named tool_choice finishes with "stop", as OpenAI's API (and vLLM) report it
        self._calls_reason = "stop" if isinstance(parser, NamedToolParser) else "tool_calls"

    def _finish(self, reason: str | None) -> str | None:
        return self._calls_reason if reason == "stop" else reason

    def stream_work(self, index: int = 0) -> tuple[int, int]:
        """(chars scanned so far, chars buffered now) of choice `index`'s stream: work counters
        that show a stream's cost is linear in its length, without timing anything."""
        st = self._streams.get(index)
        return (st.scanner.w.scanned, len(st.scanner.w.buf)) if st is not None else (0, 0)

    def message(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
        """(content, tool_calls, finish_reason) of a finished choice."""
        found = self.parser.calls(text)
        if found is None:
            return text, None, finish_reason
        content, calls = found
        return content, [ToolCall(function=c) for c in calls], self._finish(finish_reason)

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[str, list[DeltaToolCall] | None, str | None]:
        """(content, tool call fragments, finish_reason) for choice `index`'s next text."""
        st = self._streams.get(index)
        if st is None:
            st = self._streams[index] = _Stream(self.parser.scanner())
        sc, w = st.scanner, st.scanner.w
        st.parts.append(text)
        sc.feed(text)
        content = ""
        if sc.content_end > st.content_sent:
            content, st.content_sent = w.slice(st.content_sent, sc.content_end), sc.content_end
        frags: list[DeltaToolCall] = []
        calls = sc.calls if sc.valid else []
        for k in range(st.settled, len(calls)):
            call = calls[k]
            if call.name is None:
                break
            span = call.args(w.end)
            n = span[1] - span[0] if span else 0
            if k == len(st.ids):
                st.ids.append(call_id())
                st.args_sent.append(n)
                frags.append(
                    DeltaToolCall(
                        index=k,
                        id=st.ids[k],
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=w.slice(*span) if span else ""),
                    )
                )
            elif n > st.args_sent[k]:
                assert span is not None
                frags.append(
                    DeltaToolCall(
                        index=k, function=DeltaFunctionCall(arguments=w.slice(span[0] + st.args_sent[k], span[1]))
                    )
                )
                st.args_sent[k] = n
            if call.end is not None:  # complete and all sent
                st.settled = k + 1
        if finish_reason is not None:
            full = "".join(st.parts)  # once per stream
            if self.parser.calls(full) is not None:
                finish_reason = self._finish(finish_reason)
            elif not st.ids:  # no call after all: what was held back is content
                content += full[st.content_sent :]
                st.content_sent = len(full)
        else:
            w.trim(min(sc.need(), st.need()))
        return content, frags or None, finish_reason
