"""SSE framing: events split across reads, CRLF, comments, multi-line data, [DONE]."""

from axonserve.bench.sse import SSEParser


def test_events_split_at_every_byte():
    stream = b'data: {"a": 1}\n\n: keep-alive\n\ndata: {"b": 2}\r\n\r\ndata: [DONE]\n\n'
    p = SSEParser()
    events = []
    for i in range(len(stream)):
        events += p.feed(stream[i : i + 1])
    assert events == ['{"a": 1}', '{"b": 2}', "[DONE]"]


def test_multiline_data_and_other_fields():
    p = SSEParser()
    assert p.feed("event: x\nid: 3\ndata: one\ndata:two\n\n") == ["one\ntwo"]


def test_cr_only_and_flush():
    p = SSEParser()
    assert p.feed("data: a\r\rdata: b") == ["a"]
    assert p.flush() == ["b"]
    assert p.flush() == []


def test_utf8_text():
    p = SSEParser()
    assert p.feed('data: {"text": "héllo ✓"}\n\n'.encode()) == ['{"text": "héllo ✓"}']
