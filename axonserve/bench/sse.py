"""Incremental Server-Sent-Events parser, so chunk arrival times are taken at the byte level."""

from __future__ import annotations


class SSEParser:
    """Feed raw bytes as they arrive; get back the `data:` payload of every completed event.

    Handles CRLF/LF/CR line ends, multi-line data (joined with "\\n"), comments and events split
    across network reads, per the WHATWG event-stream rules (only the fields we need).
    """

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []
        self._pending_cr = False

    def feed(self, chunk: bytes | str) -> list[str]:
        text = chunk.decode("utf-8", errors="replace") if isinstance(chunk, bytes) else chunk
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]  # the LF of a CRLF split across two reads
        self._pending_cr = text.endswith("\r")
        self._buf += text.replace("\r\n", "\n").replace("\r", "\n")
        events: list[str] = []
        while True:
            nl = self._buf.find("\n")
            if nl < 0:
                return events
            line, self._buf = self._buf[:nl], self._buf[nl + 1 :]
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(":"):
                continue
            else:
                field, _, value = line.partition(":")
                if field == "data":
                    self._data.append(value[1:] if value.startswith(" ") else value)

    def flush(self) -> list[str]:
        """An event the server left without the final blank line (stream closed)."""
        events = self.feed("\n\n") if (self._buf or self._data) else []
        return events
