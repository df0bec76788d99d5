"""Incremental JSON scanning for tool calls: a state machine per output that resumes where
the previous delta stopped, so a delta costs O(delta) however long the output is."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

#
# A stream's text only ever grows, so every scanner below is a state machine that resumes where
# the previous delta stopped, holding absolute positions into the text. Re-scanning the whole
# text on each delta made a stream's parsing quadratic in its length (issue 27 item 7).


class _Malformed(ValueError):
    """The text cannot be the tool-call JSON the parser expects."""


# a scanner's phases (each parser uses some of them)
_SEEK, _TAG, _CALL, _NEXT, _LEAD, _CONTENT, _AFTER, _DONE = range(8)
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

    def _call(self, start: int) -> None:
        """A call's object opens at `start` (phase _CALL)."""
        self.calls.append(_Call(start, self.ARG_KEYS))
        self._in_call = True
        self.phase = _CALL

    def _expect_call(self, i: int) -> None:
        """The format says a call's object starts at `i`."""
        if self.w.char(i) != "{":
            raise _Malformed(self.w.char(i))
        self._call(i)

    def _advance_call(self, then: int) -> bool:
        """Parse the open call on; True when it completed well-formed (then phase `then`, at
        the position after it)."""
        call = self.calls[-1]
        if not call.advance(self.w):
            return False
        if call.name_bad:
            raise _Malformed("name")
        self._in_call = False
        assert call.end is not None
        self.phase, self.pos = then, call.end
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
                if w.char(i) == close:
                    self.phase = _DONE
                    return
                self._expect_call(i)
            if self.phase == _CALL and not self._advance_call(_AFTER):
                return
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
