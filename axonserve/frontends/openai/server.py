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
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, TypeVar

import jinja2
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from axonserve import __version__
from axonserve.config import EngineConfig
from axonserve.frontends.chat_template import render_bounded, request_template
from axonserve.frontends.client import AsyncEngineClient, EngineDeadError, RequestError, StreamOutput
from axonserve.frontends.openai.embeddings import EmbeddingRequest, create_embeddings
from axonserve.frontends.openai.errors import REJECT_CODES, error_for, validation_message
from axonserve.frontends.openai.lora import LoraModels, lora_kwargs, mount_lora_routes
from axonserve.frontends.openai.middleware import AccessLog, ApiKeyAuth, BodyLimit, api_key_from_env, note_access
from axonserve.frontends.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    error_response,
    request_id,
)
from axonserve.frontends.openai.responses import ChatFormat, CompletionFormat, Format, sse_response
from axonserve.frontends.openai.tools import plan_tools, template_messages
from axonserve.multimodal.frontend import ImageInputs, PromptImages, has_images, take_images
from axonserve.protocol.messages import LoraSpec, ParamError, SamplingParams
from axonserve.structured_output.frontend import with_structured_outputs

log = structlog.get_logger(__name__)

T = TypeVar("T")
_LONG_PROMPT_CHARS = 4096  # more prompt text than this in a request is tokenized off the event loop
_LONG_ECHO_TOKENS = 4096  # echoing more prompt tokens than this is detokenized off the event loop
_IMAGE_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="images")  # decoding and fetching
_TRACE_WAIT_S = 60.0  # /stop_profile waits this long for the ranks' traces to be written


async def _wait_for_files(paths: list[str], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


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
    app.state.restarting = {}  # actor -> why: being replaced by the supervisor (/health 503 meanwhile)
    model_name = client.info.served_model_name or (config and config.served_model_name) or client.info.model
    known_models = {model_name, client.info.model}
    loras = LoraModels(cfg, model_name, known_models)  # adapters: `model` names one (frontends/openai/lora.py)
    mount_lora_routes(app, loras)
    image_inputs = ImageInputs.load(client.info.model, client.tokenizer.hf, config) if client.info.model else None

    # ------------------------------------------------------------------ errors

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, "BadRequestError", param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "HTTPError"
        return error_response(exc.status_code, str(exc.detail), kind)

    async def _on_error(_: Request, exc: Exception) -> JSONResponse:
        return error_for(exc)

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

    def check_model(name: str | None, api: str | None = None) -> LoraSpec | None:
        """The LoRA adapter `name` selects (None: the base model); 404 for an unknown name, 400 for
        an adapter on a route (`api`) that serves only the base model."""
        return loras.resolve(name, api)

    def unavailable() -> str | None:
        return app.state.unhealthy or (client.dead_reason if client.dead else None)

    async def tokenize(prompts: list[str | list[int]]) -> list[list[int]]:
        """Every prompt's ids. More than _LONG_PROMPT_CHARS of text in all (one long prompt or a
        batch of short ones: ~1 ms per 4k characters) is encoded on a thread: the event loop
        streams everyone else's tokens meanwhile."""

        def work() -> list[list[int]]:
            return [client.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]

        if sum(len(p) for p in prompts if isinstance(p, str)) > _LONG_PROMPT_CHARS:
            return await asyncio.to_thread(work)
        return work()

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

    def constrained(params: SamplingParams, body: Any, tool_spec: Any = None) -> SamplingParams:
        """The request's structured-output constraint, size-checked then compiled (llguidance: up
        to seconds for a large schema): callers run this on a thread, never on the event loop."""
        return with_structured_outputs(params, body, client.tokenizer, tool_spec, limits.max_structured_output_bytes)

    def start(
        prompts: list[list[int]],
        params: SamplingParams,
        rid: str,
        images: PromptImages | None = None,
        lora: LoraSpec | None = None,
    ) -> list[AsyncGenerator[StreamOutput, None]]:
        reason = unavailable()
        if reason is not None:
            raise EngineDeadError(reason)
        return client.generate_batch(prompts, params, rid, images, **lora_kwargs(lora))  # validated there, once

    # ------------------------------------------------------------------ routes

    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's) name for the same probe
    async def health() -> Response:
        restarting = ", ".join(f"{k} restarting ({v})" for k, v in app.state.restarting.items())
        reason = unavailable() or restarting or None
        if reason is not None:
            return error_response(503, f"engine unavailable: {reason}", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=model_name, root=client.info.model, max_model_len=client.info.max_model_len),
                *loras.cards(),
            ]
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        lora = check_model(body.model)
        client.require_task("generate", "Completions API")
        rid = request_id(body.request_id, "cmpl", limits.max_request_id_chars)
        texts = body.prompts()
        if len(texts) > limits.max_fanout:
            raise ParamError("prompt", f"at most {limits.max_fanout} prompts per request")
        params = await asyncio.to_thread(constrained, body.sampling_params(), body)
        prompts = [body.truncate(ids) for ids in await tokenize(texts)]
        note_access(request_id=rid)
        streams = start(prompts, params, rid, lora=lora)
        echo = None
        if body.echo:

            def detokenize() -> list[str]:
                return [client.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]

            long = sum(len(ids) for ids in prompts) > _LONG_ECHO_TOKENS
            echo = await asyncio.to_thread(detokenize) if long else detokenize()
        fmt = CompletionFormat(client, rid, lora.name if lora else model_name, params, prompts, echo=echo)
        if body.stream:
            return await _stream_response(raw, fmt, streams, params.n, body.include_usage)
        return await _cancel_on_disconnect(raw, fmt.full(streams, params.n))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        lora = check_model(body.model)
        client.require_task("generate", "Chat Completions API")
        rid = request_id(body.request_id, "chatcmpl", limits.max_request_id_chars)
        if body.tools is not None and len(body.tools) > limits.max_tools:
            raise ParamError("tools", f"at most {limits.max_tools} tools per request")

        def prepare() -> tuple[Any, SamplingParams, list[dict[str, Any]]]:
            """Request-sized CPU work, on a thread: tool schemas, the output constraint's compile,
            the messages (tool-call arguments parsed)."""
            tools = plan_tools(
                body.tools,
                body.tool_choice,
                cfg.enable_auto_tool_choice,
                cfg.tool_call_parser,
                body.parallel_tool_calls,
            )
            params = constrained(body.sampling_params(), body, tools.structured if tools else None)
            return tools, params, template_messages([m.model_dump(exclude_none=True) for m in body.messages])

        tools, params, messages = await asyncio.to_thread(prepare)
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
            note_access(images=len(urls))
        note_access(request_id=rid)
        streams = start([ids], params, rid, images, lora)
        name = lora.name if lora else model_name
        fmt = ChatFormat(client, rid, name, params, [ids], tools=tools.formatter() if tools else None)
        if body.stream:
            return await _stream_response(raw, fmt, streams, params.n, body.include_usage)
        return await _cancel_on_disconnect(raw, fmt.full(streams, params.n))

    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        check_model(body.model, "Embeddings API")
        if (reason := unavailable()) is not None:
            raise EngineDeadError(reason)
        rid = request_id(body.request_id, "embd", limits.max_request_id_chars)
        note_access(request_id=rid)
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
        strs = await asyncio.to_thread(tok.hf.convert_ids_to_tokens, ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=client.info.max_model_len, tokens=ids, token_strs=strs)

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
    raw: Request, fmt: Format, streams: list[AsyncGenerator[StreamOutput, None]], n: int, include_usage: bool
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
        if first is not None and first.finish_reason == "error" and first.error_code in REJECT_CODES:
            await first_stream.aclose()
            return error_response(first.error_code, first.error or "rejected")
        streams = [_prepend(first, first_stream)]
    return sse_response(fmt, streams, n, include_usage)


async def _prepend(
    first: StreamOutput | None, rest: AsyncGenerator[StreamOutput, None]
) -> AsyncGenerator[StreamOutput, None]:
    async with aclosing(rest):
        if first is not None:
            yield first
        async for out in rest:
            yield out


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
