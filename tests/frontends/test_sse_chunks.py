"""Plain stream chunks (no logprobs, echo or tool calls) are written from a prebuilt head; they
must be the very JSON the pydantic response models give (what the chunks were built with before)."""

from __future__ import annotations

import pytest

from axonserve.frontends.client import StreamOutput
from axonserve.frontends.openai.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from axonserve.frontends.openai.responses import ChatFormat, CompletionFormat
from axonserve.protocol.messages import SamplingParams

CONTROL = "".join(map(chr, range(0x20))) + "\x7f"
TEXTS = ["", "hello", ' quo"te \\ back/slash ', CONTROL, "日本語 😀 naïve", "\u2028\u2029"]
ENDS = [(None, None), ("stop", None), ("stop", 2), ("stop", 'END"\n'), ("length", None), ("abort", None)]
RID, MODEL = 'cmpl-"x"\\1', "my/mödel\t"


def out(text: str, finish: str | None, stop: int | str | None) -> StreamOutput:
    return StreamOutput("r", 0, text, text, [5], finish_reason=finish, stop_reason=stop)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish,stop", ENDS)
def test_completion_chunk_is_the_models_json(text, finish, stop):
    fmt = CompletionFormat(None, RID, MODEL, SamplingParams(n=2), [[1, 2]])
    got = fmt.chunk(3, out(text, finish, stop))
    if not text and finish is None:
        assert got is None
        return
    choice = CompletionChoice(index=3, text=text, finish_reason=finish, stop_reason=stop)
    want = CompletionResponse(id=RID, created=fmt.created, model=MODEL, choices=[choice]).model_dump_json()
    assert got == want


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish,stop", ENDS)
def test_chat_chunk_is_the_models_json(text, finish, stop):
    fmt = ChatFormat(None, RID, MODEL, SamplingParams(), [[1, 2]])
    got = fmt.chunk(1, out(text, finish, stop))
    if not text and finish is None:
        assert got is None
        return
    choice = ChatStreamChoice(index=1, delta=DeltaMessage(content=text or None), finish_reason=finish, stop_reason=stop)
    want = ChatCompletionChunk(id=RID, created=fmt.created, model=MODEL, choices=[choice]).model_dump_json()
    assert got == want


def test_echo_and_logprobs_keep_the_model_path():
    """A chunk with logprobs (or the echoed prompt) is not plain: the models build it."""
    fmt = CompletionFormat(None, RID, MODEL, SamplingParams(), [[1, 2]], echo=["Hi"])
    got = fmt.chunk(0, out("x", None, None))
    assert '"text":"Hix"' in got
    assert fmt.chunk(0, out("y", None, None)).count('"text":"y"') == 1  # echoed once
