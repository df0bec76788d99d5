"""Tool calls out of a chat output: whole messages and stream deltas (OpenAI shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from axonserve.frontends.openai.tools.models import DeltaFunctionCall, DeltaToolCall, ToolCall, call_id
from axonserve.frontends.openai.tools.parsers import NamedToolParser, ToolParser
from axonserve.frontends.openai.tools.scan import _NOWHERE, Scanner


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
