"""The tool-call formats: Hermes blocks, Llama 3.1 JSON, tool_choice required (a JSON array)
and named (the arguments alone), each an incremental scanner (scan.py)."""

from __future__ import annotations

import json

from axonserve.frontends.openai.tools.models import FunctionCall
from axonserve.frontends.openai.tools.scan import (
    _CALL,
    _CONTENT,
    _DONE,
    _LEAD,
    _NEXT,
    _NOWHERE,
    _SEEK,
    _TAG,
    Scan,
    Scanner,
    _Call,
    _held_prefix,
    _Malformed,
)

PARSERS = ("hermes", "llama3_json")


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
                self._expect_call(i)
            if self.phase == _CALL and not self._advance_call(_NEXT):
                return
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
            self._call(i)
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


def make_parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesToolParser()
    if name == "llama3_json":
        return Llama3JsonToolParser()
    raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(PARSERS)}")
