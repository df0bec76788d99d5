"""OpenAI response bodies from engine outputs: whole responses, SSE chunks, usage.

`CompletionFormat` and `ChatFormat` turn each choice's `StreamOutput`s into the two APIs' JSON
(logprobs, echo, prompt logprobs, tool calls); `sse_response` streams them (errors in-band once
the stream has started); `merge_streams` interleaves several prompts' generations.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, Response, StreamingResponse

from axonserve.frontends.client import AsyncEngineClient, RequestError, StreamOutput
from axonserve.frontends.openai.errors import error_for
from axonserve.frontends.openai.middleware import access_record
from axonserve.frontends.openai.protocol import (
    ERROR_TYPES,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptLogprobList,
    TopLogprob,
    UsageInfo,
)
from axonserve.frontends.openai.tools import ToolCallFormatter
from axonserve.protocol.messages import SamplingParams

_json = msgspec.json.encode


def _js(value: str | int | None) -> str:
    return _json(value).decode()


class Format:
    """Turns RequestOutputs into one API's JSON: whole responses and stream chunks.

    Choice `index` is prompt j's choice i at j * n + i; `prompts` holds each prompt's ids.
    A plain stream chunk (no logprobs, echo or tool calls: one per choice per engine step) is
    written straight from a prebuilt head (`_chunk_head`), the same JSON the pydantic models
    give at a fraction of their cost (issue 33; tests/frontends/test_sse_chunks.py compares them)."""

    OBJECT = ""  # the stream chunk's "object"

    def __init__(
        self, client: AsyncEngineClient, rid: str, model: str, params: SamplingParams, prompts: list[list[int]]
    ):
        self.client, self.rid, self.model, self.params = client, rid, model, params
        self.prompts, self.n = prompts, params.n
        self.created = int(time.time())
        head = {"id": rid, "object": self.OBJECT, "created": self.created, "model": model}
        self._chunk_head = _json(head)[:-1].decode() + ',"choices":[{"index":'

    def prompt_logprob_list(self, index: int, out: StreamOutput) -> PromptLogprobList | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then {id: logprob} with
        the prompt token and the top alternatives."""
        if out.prompt_logprobs is None or self.params.prompt_logprobs is None:
            return None
        text = self.client.tokenizer.token_text
        rows: PromptLogprobList = [None]
        for tid, lp in zip(self.prompts[index // self.n][1:], out.prompt_logprobs):
            entry = {tid: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=text(tid))}
            for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1):
                entry.setdefault(t, PromptLogprob(logprob=v, rank=rank, decoded_token=text(t)))
            rows.append(entry)
        return rows

    def first_chunks(self, num_choices: int) -> list[str]:
        return []

    def chunk(self, index: int, out: StreamOutput) -> str | None:
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo) -> str:
        raise NotImplementedError

    def response(self, outs: dict[int, list[StreamOutput]], usage: UsageInfo) -> Any:
        raise NotImplementedError

    async def full(self, streams: list[AsyncGenerator[StreamOutput, None]], n: int) -> Response:
        outs: dict[int, list[StreamOutput]] = {}
        usage = Usage()
        async for j, out in merge_streams(streams):
            if out.finish_reason == "error":
                raise RequestError(out.error or "generation failed", out.error_code)
            outs.setdefault(j * n + out.index, []).append(out)
            usage.add(j, out)
        body = self.response(dict(sorted(outs.items())), usage.info())
        return JSONResponse(body.model_dump(mode="json"))

    def token_logprobs(self, out: StreamOutput) -> list[tuple[str, float, list[tuple[str, float]]]]:
        """(token text, logprob, top alternatives) for each new token."""
        if out.logprobs is None:
            return []
        text = self.client.tokenizer.token_text
        k = self.params.logprobs or 0
        rows = []
        for tid, lp in zip(out.token_ids, out.logprobs):
            top = [(text(t), v) for t, v in zip(lp.top_ids[:k], lp.top_logprobs[:k])]
            rows.append((text(tid), lp.logprob, top))
        return rows


class CompletionFormat(Format):
    OBJECT = "text_completion"

    def __init__(self, *args: Any, echo: list[str] | None = None):
        """echo: each prompt's text, put before its choices' text (with logprobs if asked)."""
        super().__init__(*args)
        self.echo = echo
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}

    def _echo_prefix(self, index: int, out: StreamOutput) -> tuple[str, CompletionLogprobs | None]:
        """The prompt, once per choice, when echo is on; its token logprobs when logprobs is set
        (the first prompt token has none, like OpenAI's)."""
        if self.echo is None or index in self._echoed:
            return "", None
        self._echoed.add(index)
        text, k = self.echo[index // self.n], self.params.logprobs
        if k is None:
            return text, None
        tt, lp, offset = self.client.tokenizer.token_text, CompletionLogprobs(), 0
        for tid, p in zip(self.prompts[index // self.n], [None, *(out.prompt_logprobs or [])]):
            tok = tt(tid)
            lp.tokens.append(tok)
            lp.text_offset.append(offset)
            offset += len(tok)
            lp.token_logprobs.append(None if p is None else p.logprob)
            lp.top_logprobs.append(
                None if p is None else {tok: p.logprob, **{tt(t): v for t, v in zip(p.top_ids[:k], p.top_logprobs[:k])}}
            )
        self._offsets[index] = offset
        return text, lp

    def logprobs(self, index: int, out: StreamOutput) -> CompletionLogprobs | None:
        if self.params.logprobs is None:
            return None
        lp = CompletionLogprobs()
        offset = self._offsets.get(index, 0)
        for token, logprob, top in self.token_logprobs(out):
            lp.tokens.append(token)
            lp.token_logprobs.append(logprob)
            lp.top_logprobs.append({token: logprob, **dict(top)})
            lp.text_offset.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return lp

    def chunk(self, index: int, out: StreamOutput) -> str | None:
        if (
            self.params.logprobs is None
            and (self.echo is None or index in self._echoed)
            and out.prompt_logprobs is None
        ):
            if not (out.text or out.finish_reason is not None):
                return None
            return (
                f'{self._chunk_head}{index},"text":{_js(out.text)},"logprobs":null,'
                f'"finish_reason":{_js(out.finish_reason)},"stop_reason":{_js(out.stop_reason)},'
                '"prompt_logprobs":null}],"usage":null}'
            )
        prefix, echo_lp = self._echo_prefix(index, out)
        text = prefix + out.text
        if not (text or out.finished or self.params.logprobs is not None or out.prompt_logprobs):
            return None
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=concat_logprobs(echo_lp, self.logprobs(index, out)),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            prompt_logprobs=self.prompt_logprob_list(index, out),
        )
        return CompletionResponse(
            id=self.rid, created=self.created, model=self.model, choices=[choice]
        ).model_dump_json()

    def usage_chunk(self, usage: UsageInfo) -> str:
        return CompletionResponse(
            id=self.rid, created=self.created, model=self.model, choices=[], usage=usage
        ).model_dump_json()

    def response(self, outs: dict[int, list[StreamOutput]], usage: UsageInfo) -> CompletionResponse:
        choices = []
        for index, steps in outs.items():
            prefix, merged = self._echo_prefix(index, steps[0])
            for o in steps:
                merged = concat_logprobs(merged, self.logprobs(index, o))
            last = steps[-1]
            choices.append(
                CompletionChoice(
                    index=index,
                    text=prefix + last.output_text,
                    logprobs=merged,
                    finish_reason=last.finish_reason,
                    stop_reason=last.stop_reason,
                    prompt_logprobs=self.prompt_logprob_list(index, steps[0]),
                )
            )
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)


def concat_logprobs(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
    if a is None or b is None:
        return a or b
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


class ChatFormat(Format):
    OBJECT = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolCallFormatter | None = None):
        """tools: finds tool calls in the output (requests with tools, tool_choice not none)."""
        super().__init__(*args)
        self.tools = tools

    def logprobs(self, out: StreamOutput) -> ChatLogprobs | None:
        if self.params.logprobs is None:
            return None
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    token=token,
                    logprob=logprob,
                    bytes=list(token.encode()),
                    top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in top],
                )
                for token, logprob, top in self.token_logprobs(out)
            ]
        )

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return ChatCompletionChunk(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump_json()

    def first_chunks(self, num_choices: int) -> list[str]:
        return [
            self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            for i in range(num_choices)
        ]

    def chunk(self, index: int, out: StreamOutput) -> str | None:
        if self.tools is None and self.params.logprobs is None:
            text = out.text
            if not (text or out.finish_reason is not None):
                return None
            delta = f'{{"content":{_js(text)}}}' if text else "{}"
            return (
                f'{self._chunk_head}{index},"delta":{delta},"logprobs":null,'
                f'"finish_reason":{_js(out.finish_reason)},"stop_reason":{_js(out.stop_reason)}}}],"usage":null}}'
            )
        text, calls, finish = out.text, None, out.finish_reason
        if self.tools is not None:
            text, calls, finish = self.tools.delta(index, out.text, out.finish_reason)
        if not (text or calls or out.finished or self.params.logprobs is not None):
            return None
        delta = DeltaMessage(content=text or None, tool_calls=calls)
        return self._chunk(
            [
                ChatStreamChoice(
                    index=index,
                    delta=delta,
                    logprobs=self.logprobs(out),
                    finish_reason=finish,
                    stop_reason=out.stop_reason,
                )
            ]
        )

    def usage_chunk(self, usage: UsageInfo) -> str:
        return self._chunk([], usage)

    def response(self, outs: dict[int, list[StreamOutput]], usage: UsageInfo) -> ChatCompletionResponse:
        choices = []
        for index, steps in outs.items():
            last = steps[-1]
            logprobs = None
            if self.params.logprobs is not None:
                logprobs = ChatLogprobs(content=[c for o in steps for c in (self.logprobs(o).content or [])])  # type: ignore[union-attr]
            content, calls, finish = last.output_text, None, last.finish_reason
            if self.tools is not None:
                content, calls, finish = self.tools.message(last.output_text, last.finish_reason)
            choices.append(
                ChatChoice(
                    index=index,
                    message=ChatResponseMessage(content=content, tool_calls=calls),
                    logprobs=logprobs,
                    finish_reason=finish,
                    stop_reason=last.stop_reason,
                )
            )
        first = next(iter(outs.items()), None)
        return ChatCompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            prompt_logprobs=self.prompt_logprob_list(first[0], first[1][0]) if first else None,
        )


class Usage:
    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}
        self.completion = 0

    def add(self, prompt_index: int, out: StreamOutput) -> None:
        self.prompt[prompt_index] = out.num_prompt_tokens
        if out.finished:
            self.completion += out.num_output_tokens
        rec = access_record.get()
        if rec is not None:
            if "ttft_s" not in rec and out.token_ids:
                rec["ttft_s"] = time.perf_counter() - rec["t0"]
            rec["prompt_tokens"] = sum(self.prompt.values())
            rec["completion_tokens"] = self.completion
            if out.finished:
                rec["finish_reason"] = out.finish_reason

    def info(self) -> UsageInfo:
        p = sum(self.prompt.values())
        return UsageInfo(prompt_tokens=p, completion_tokens=self.completion, total_tokens=p + self.completion)


# --------------------------------------------------------------------------- streaming


def sse_response(
    fmt: Format, streams: list[AsyncGenerator[StreamOutput, None]], n: int, include_usage: bool
) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        usage = Usage()
        try:
            for c in fmt.first_chunks(len(streams) * n):
                yield f"data: {c}\n\n"
            async for j, out in merge_streams(streams):
                if out.finish_reason == "error":
                    code = out.error_code or 500
                    err = ErrorResponse(
                        error=ErrorInfo(
                            message=out.error or "generation failed",
                            type=ERROR_TYPES.get(code, "InternalServerError"),
                            code=code,
                        )
                    )
                    yield f"data: {err.model_dump_json()}\n\n"
                    break
                usage.add(j, out)
                chunk = fmt.chunk(j * n + out.index, out)
                if chunk is not None:
                    yield f"data: {chunk}\n\n"
            else:
                if include_usage:
                    yield f"data: {fmt.usage_chunk(usage.info())}\n\n"
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
            resp = error_for(e)
            yield f"data: {resp.body.decode()}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def merge_streams(streams: list[AsyncGenerator[StreamOutput, None]]) -> AsyncIterator[tuple[int, StreamOutput]]:
    """Interleave several requests' outputs as (prompt index, output); closing the merge
    closes (so aborts) every stream."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as s:
            async for out in s:
                yield 0, out
        return
    q: asyncio.Queue[tuple[int, StreamOutput | BaseException | None]] = asyncio.Queue()

    async def pump(j: int, s: AsyncGenerator[StreamOutput, None]) -> None:
        try:
            async with aclosing(s):
                async for out in s:
                    q.put_nowait((j, out))
            q.put_nowait((j, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((j, e))

    tasks = [asyncio.create_task(pump(j, s)) for j, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            j, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield j, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
