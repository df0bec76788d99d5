"""OpenAI-compatible routes over an `AsyncEngineClient`.

Errors always leave as OpenAI/vLLM error JSON `{"error": {message, type, param, code}}`:
schema problems are 400 (not FastAPI's 422), an unknown model 404, a dead engine 503, an
engine-side failure 500, and inside an already-started SSE stream an error chunk followed
by `[DONE]`. A client that disconnects gets its request aborted on the engine: streams are
cancelled by Starlette, non-streaming handlers by racing them against `http.disconnect`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from contextvars import ContextVar
from typing import Any, TypeVar

import jinja2
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from axonserve import __version__
from axonserve.config import EngineConfig
from axonserve.frontends.chat_template import render_bounded, request_template
from axonserve.frontends.client import AsyncEngineClient, EngineDeadError, RequestError, StreamOutput
from axonserve.frontends.openai.embeddings import EmbeddingRequest, create_embeddings
from axonserve.frontends.openai.middleware import ApiKeyAuth, BodyLimit, api_key_from_env
from axonserve.frontends.openai.protocol import (
    ERROR_TYPES,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobList,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    error_response,
    request_id,
)
from axonserve.frontends.openai.tools import ToolCallFormatter, plan_tools, template_messages
from axonserve.multimodal.frontend import ImageInputs, PromptImages, has_images, take_images
from axonserve.protocol.messages import ParamError, SamplingParams
from axonserve.structured_output.frontend import with_structured_outputs

log = structlog.get_logger(__name__)

# The access record of the HTTP request being served (set by AccessLog, filled by handlers).
_access: ContextVar[dict[str, Any] | None] = ContextVar("axonserve_access", default=None)
_QUIET_PATHS = ("/health", "/metrics")


class AccessLog:
    """Pure ASGI middleware: one structured log line per request, with status, timings and
    token counts (Starlette's BaseHTTPMiddleware would break disconnect detection)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rec: dict[str, Any] = {"status": 0, "t0": time.perf_counter()}
        token = _access.set(rec)

        async def send_status(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                rec["status"] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            _access.reset(token)
            t0 = rec.pop("t0")
            fields = {k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}
            emit = log.debug if scope["path"] in _QUIET_PATHS else log.info
            emit(
                "access",
                method=scope["method"],
                path=scope["path"],
                seconds=round(time.perf_counter() - t0, 4),
                **fields,
            )


def _note_access(**fields: Any) -> None:
    rec = _access.get()
    if rec is not None:
        rec.update(fields)


T = TypeVar("T")
_LONG_PROMPT_CHARS = 4096  # tokenize longer prompts off the event loop
_IMAGE_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="images")  # decoding and fetching
_TRACE_WAIT_S = 60.0  # /stop_profile waits this long for the ranks' traces to be written


async def _wait_for_files(paths: list[str], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


class ModelNotFound(LookupError):
    pass


_REJECT_CODES = (400, 408, 503)  # engine refusals that become the HTTP status before a stream starts


def _error_for(exc: BaseException) -> JSONResponse:
    if isinstance(exc, ParamError):
        return error_response(400, str(exc), "BadRequestError", exc.param)
    if isinstance(exc, ModelNotFound):
        return error_response(404, str(exc), "NotFoundError", "model")
    if isinstance(exc, EngineDeadError):
        return error_response(503, f"engine unavailable: {exc}", "ServiceUnavailableError")
    if isinstance(exc, RequestError):
        return error_response(exc.status, str(exc))
    if isinstance(exc, (ValueError, TypeError, OverflowError, jinja2.TemplateError)):
        return error_response(400, str(exc), "BadRequestError")
    if isinstance(exc, NotImplementedError):
        return error_response(501, str(exc), "NotImplementedError")
    log.error("request_failed", error=repr(exc))
    return error_response(500, f"internal error: {type(exc).__name__}", "InternalServerError")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """Readable message from pydantic errors (str(exc) would leak server paths)."""
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            why = (err.get("ctx") or {}).get("error", "")
            parts.append(f"invalid JSON body: {why}".rstrip(": "))
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = ".".join(loc)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", param


def build_app(
    client: AsyncEngineClient,
    config: EngineConfig | None = None,
    metrics: Callable[[], Awaitable[str]] | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The FastAPI app. `app.state.unhealthy` (a reason string) turns /health to 503.
    `metrics` returns the Prometheus text exposition (the metrics actor's) for `/metrics`.
    `api_key` (default: from the environment) guards every route but the probes (middleware.py)."""
    app = FastAPI(title="axonserve", version=__version__, docs_url=None, redoc_url=None)
    # added last = outermost: access log, then CORS (so 401/413 carry CORS headers), auth, body limit
    cfg = config or EngineConfig(model="")
    app.add_middleware(BodyLimit, max_bytes=cfg.max_request_body_bytes)
    key = api_key if api_key is not None else api_key_from_env()
    if key:
        app.add_middleware(ApiKeyAuth, api_key=key)
    if cfg.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cfg.allowed_origins,
            allow_methods=cfg.allowed_methods,
            allow_headers=cfg.allowed_headers,
            allow_credentials=cfg.allow_credentials,
        )
    app.add_middleware(AccessLog)
    app.state.unhealthy = None
    model_name = client.info.served_model_name or (config and config.served_model_name) or client.info.model
    known_models = {model_name, client.info.model}
    image_inputs = ImageInputs.load(client.info.model, client.tokenizer.hf, config) if client.info.model else None

    # ------------------------------------------------------------------ errors

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "BadRequestError", param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "HTTPError"
        return error_response(exc.status_code, str(exc.detail), kind)

    async def _on_error(_: Request, exc: Exception) -> JSONResponse:
        return _error_for(exc)

    # Known classes go through ExceptionMiddleware (handled, not re-raised); the bare
    # Exception entry is the last resort (Starlette logs those as server errors too).
    for cls in (
        ParamError,
        ValueError,
        TypeError,
        OverflowError,
        jinja2.TemplateError,
        LookupError,
        EngineDeadError,
        RequestError,
        NotImplementedError,
        Exception,
    ):
        app.add_exception_handler(cls, _on_error)

    # ------------------------------------------------------------------ helpers

    def check_model(name: str | None) -> None:
        if name is not None and name not in known_models:
            raise ModelNotFound(f"The model `{name}` does not exist.")

    def unavailable() -> str | None:
        return app.state.unhealthy or (client.dead_reason if client.dead else None)

    async def tokenize(prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return prompt
        if len(prompt) > _LONG_PROMPT_CHARS:
            return await asyncio.to_thread(client.tokenizer.encode, prompt)
        return client.tokenizer.encode(prompt)

    limits = client.info.limits

    async def encode_chat(
        messages: list[dict[str, Any]],
        body: ChatCompletionRequest | TokenizeRequest,
        extra: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat prompt's ids: the template rendered and the text encoded on the template pool,
        under the time limit; a request's own template only with --trust-request-chat-template."""
        override, variables = request_template(
            body.chat_template, body.chat_template_kwargs, cfg.trust_request_chat_template
        )
        kwargs = {**(extra or {}), **variables, **({"chat_template": override} if override is not None else {})}

        def work() -> list[int]:
            return client.tokenizer.encode_chat(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                **kwargs,
            )

        max_chars = max(1 << 20, 64 * client.info.max_model_len)
        return await render_bounded(work, cfg.chat_template_timeout_s, max_chars)

    async def constrained(params: SamplingParams, body: Any, tool_spec: Any = None) -> SamplingParams:
        """The request's structured-output constraint, size-checked then compiled off the loop."""
        return await asyncio.to_thread(
            with_structured_outputs, params, body, client.tokenizer, tool_spec, limits.max_structured_output_bytes
        )

    def start(
        prompts: list[list[int]], params: SamplingParams, rid: str, images: PromptImages | None = None
    ) -> list[AsyncGenerator[StreamOutput, None]]:
        reason = unavailable()
        if reason is not None:
            raise EngineDeadError(reason)
        return client.generate_batch(prompts, params, rid, images)  # validated there, once

    # ------------------------------------------------------------------ routes

    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's) name for the same probe
    async def health() -> Response:
        reason = unavailable()
        if reason is not None:
            return error_response(503, f"engine unavailable: {reason}", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(
            data=[ModelCard(id=model_name, root=client.info.model, max_model_len=client.info.max_model_len)]
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        client.require_task("generate", "Completions API")
        rid = request_id(body.request_id, "cmpl", limits.max_request_id_chars)
        texts = body.prompts()
        if len(texts) > limits.max_fanout:
            raise ParamError("prompt", f"at most {limits.max_fanout} prompts per request")
        params = await constrained(body.sampling_params(), body)
        prompts = [body.truncate(await tokenize(p)) for p in texts]
        _note_access(request_id=rid)
        streams = start(prompts, params, rid)
        echo = [client.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts] if body.echo else None
        fmt = _CompletionFormat(client, rid, model_name, params, prompts, echo=echo)
        if body.stream:
            return await _stream_response(raw, fmt, streams, params.n, body.include_usage)
        return await _cancel_on_disconnect(raw, fmt.full(streams, params.n))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        client.require_task("generate", "Chat Completions API")
        rid = request_id(body.request_id, "chatcmpl", limits.max_request_id_chars)
        if body.tools is not None and len(body.tools) > limits.max_tools:
            raise ParamError("tools", f"at most {limits.max_tools} tools per request")
        tools = plan_tools(
            body.tools, body.tool_choice, cfg.enable_auto_tool_choice, cfg.tool_call_parser, body.parallel_tool_calls
        )
        params = await constrained(body.sampling_params(), body, tools.structured if tools else None)
        messages = template_messages([m.model_dump(exclude_none=True) for m in body.messages])
        urls: list[str] = []
        if has_images(messages):
            if image_inputs is None:
                raise ParamError("messages", f"The model `{model_name}` is text-only: it does not accept images")
            messages, urls = take_images(messages, image_inputs.image_token)
        ids = body.truncate(await encode_chat(messages, body, tools.template_kwargs() if tools else None))
        images = None
        if urls:
            assert image_inputs is not None
            # a pool of their own: slow image URLs (up to the fetch deadline) never hold the
            # threads that tokenize and compile grammars for everyone else
            ids, images = await asyncio.get_running_loop().run_in_executor(_IMAGE_POOL, image_inputs.prepare, ids, urls)
            _note_access(images=len(urls))
        _note_access(request_id=rid)
        streams = start([ids], params, rid, images)
        fmt = _ChatFormat(client, rid, model_name, params, [ids], tools=tools.formatter() if tools else None)
        if body.stream:
            return await _stream_response(raw, fmt, streams, params.n, body.include_usage)
        return await _cancel_on_disconnect(raw, fmt.full(streams, params.n))

    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        check_model(body.model)
        if (reason := unavailable()) is not None:
            raise EngineDeadError(reason)
        rid = request_id(body.request_id, "embd", limits.max_request_id_chars)
        _note_access(request_id=rid)
        return await _cancel_on_disconnect(raw, create_embeddings(client, body, model_name, rid))

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        body.check_fields()
        check_model(body.model)
        tok = client.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise ParamError("prompt", "give exactly one of `prompt` and `messages`")
        if body.messages is not None:
            ids = await encode_chat([m.model_dump(exclude_none=True) for m in body.messages], body)
        else:
            ids = await asyncio.to_thread(tok.hf.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(
            count=len(ids),
            max_model_len=client.info.max_model_len,
            tokens=ids,
            token_strs=tok.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        )

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        body.check_fields()
        check_model(body.model)
        vocab = client.info.vocab_size

        def decode() -> str:  # up to the body limit's worth of ids: off the event loop
            if any(not 0 <= t < vocab for t in body.tokens):
                raise ParamError("tokens", f"token ids must be in [0, {vocab})")
            return client.tokenizer.decode(body.tokens, skip_special_tokens=False)

        return DetokenizeResponse(prompt=await asyncio.to_thread(decode))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if metrics is None:
            return error_response(404, "metrics are not enabled", "NotFoundError")
        try:
            text = await metrics()
        except (TimeoutError, asyncio.TimeoutError):
            return error_response(503, "metrics actor did not answer", "ServiceUnavailableError")
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/start_profile", response_model=None)
    @app.post("/stop_profile", response_model=None)
    async def profile(raw: Request) -> Response:
        """vLLM's profiler routes: torch.profiler on every worker rank, traces in --profile-dir."""
        start = raw.url.path == "/start_profile"
        try:
            st = await (client.start_profile() if start else client.stop_profile())
        except RequestError as e:
            return error_response(e.status, str(e))
        if start:
            return JSONResponse({"status": "started", "files": []})
        # the ranks write their traces on threads; answer when they are on disk (200) or, past
        # the wait, say they are still being written (202): the engine never waits for them
        written = await _wait_for_files(st.files, _TRACE_WAIT_S)
        return JSONResponse(
            {"status": "stopped" if written else "writing", "files": st.files}, status_code=200 if written else 202
        )

    return app


async def _first_output(stream: AsyncGenerator[StreamOutput, None]) -> StreamOutput | None:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


async def _stream_response(
    raw: Request, fmt: "_Format", streams: list[AsyncGenerator[StreamOutput, None]], n: int, include_usage: bool
) -> Response:
    """Wait for a single stream's first output before committing to HTTP 200, so a request
    the engine rejects at once (overload 503, bad input 400) gets a real status code. While it
    waits (queued behind others) a client that leaves has its request aborted before prefill."""
    if len(streams) == 1 and n == 1:
        first_stream = streams[0]
        first = await _cancel_on_disconnect(raw, _first_output(first_stream))
        if isinstance(first, Response):  # the client left: the request is aborted
            await first_stream.aclose()
            return first
        if first is not None and first.finish_reason == "error" and first.error_code in _REJECT_CODES:
            await first_stream.aclose()
            return error_response(first.error_code, first.error or "rejected")
        streams = [_prepend(first, first_stream)]
    return _sse(fmt, streams, n, include_usage)


async def _prepend(
    first: StreamOutput | None, rest: AsyncGenerator[StreamOutput, None]
) -> AsyncGenerator[StreamOutput, None]:
    async with aclosing(rest):
        if first is not None:
            yield first
        async for out in rest:
            yield out


# --------------------------------------------------------------------------- formatting


class _Format:
    """Turns RequestOutputs into one API's JSON: whole responses and stream chunks.

    Choice `index` is prompt j's choice i at j * n + i; `prompts` holds each prompt's ids."""

    def __init__(
        self, client: AsyncEngineClient, rid: str, model: str, params: SamplingParams, prompts: list[list[int]]
    ):
        self.client, self.rid, self.model, self.params = client, rid, model, params
        self.prompts, self.n = prompts, params.n
        self.created = int(time.time())

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
        usage = _Usage()
        async for j, out in _merge(streams):
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


class _CompletionFormat(_Format):
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
        prefix, echo_lp = self._echo_prefix(index, out)
        text = prefix + out.text
        if not (text or out.finished or self.params.logprobs is not None or out.prompt_logprobs):
            return None
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=_concat_logprobs(echo_lp, self.logprobs(index, out)),
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
                merged = _concat_logprobs(merged, self.logprobs(index, o))
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


def _concat_logprobs(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
    if a is None or b is None:
        return a or b
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


class _ChatFormat(_Format):
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


class _Usage:
    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}
        self.completion = 0

    def add(self, prompt_index: int, out: StreamOutput) -> None:
        self.prompt[prompt_index] = out.num_prompt_tokens
        if out.finished:
            self.completion += out.num_output_tokens
        rec = _access.get()
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


def _sse(
    fmt: _Format, streams: list[AsyncGenerator[StreamOutput, None]], n: int, include_usage: bool
) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        usage = _Usage()
        try:
            for c in fmt.first_chunks(len(streams) * n):
                yield f"data: {c}\n\n"
            async for j, out in _merge(streams):
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
            resp = _error_for(e)
            yield f"data: {resp.body.decode()}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _merge(streams: list[AsyncGenerator[StreamOutput, None]]) -> AsyncIterator[tuple[int, StreamOutput]]:
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


async def _cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    """Run `work` but cancel it (aborting its requests) if the HTTP client goes away."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)  # let its aborts go out
        log.info("client_disconnected", path=request.url.path)
        return Response(status_code=499)
    return task.result()
