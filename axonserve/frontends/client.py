"""`AsyncEngineClient`: the Python library that talks to a running scheduler over ZeroMQ.

Over 500 lines: the whole client side of the engine protocol (requests, fan-out, streams,
embeddings, stats, profiler, the reader and the watchdog) shares its routing state.

One DEALER socket to the scheduler's ROUTER (on one host a routed channel, actors/channel.py, that
behaves as one). A single reader task decodes every incoming
frame and appends each `RequestDelta` to its request's inbox (`_Request.push`), waking the
request's consumer at most once per message; `generate()` consumers drain everything queued in
one wake-up, detokenize and apply stop strings themselves, so that work is spread over the
requests' own tasks and never blocks the reader. (An inbox list and one future per wake-up, not
an asyncio.Queue: every step's message reaches each request in flight, and the queue's put/get
bookkeeping per delta was most of the client's CPU per step - issue 33.) A watchdog pings the
engine when it has gone quiet with requests in flight, so a dead scheduler ends requests with an
error instead of a hang.

    client = await AsyncEngineClient.connect("ipc:///tmp/ax/engine")
    async for out in client.generate("Hello", SamplingParams(max_tokens=8)):
        print(out.text, end="")
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from axonserve.actors.channel import ChannelClient, channel_path, is_channel
from axonserve.actors.runtime import DATA_MESSAGE_BYTES, attach, bus_socket
from axonserve.frontends.detokenizer import IncrementalDetokenizer
from axonserve.frontends.tokenizer import Tokenizer
from axonserve.multimodal.frontend import PromptImages
from axonserve.protocol import Codec, DecodeError, EngineToClient, tensor_from_frame
from axonserve.protocol.messages import (
    AbortRequest,
    AddRequest,
    EngineDead,
    EngineInfo,
    EngineStats,
    GetEngineInfo,
    GetStats,
    LoraSpec,
    Outputs,
    ParamError,
    PoolingParams,
    ProfileStatus,
    RequestDelta,
    SamplingParams,
    StartProfile,
    StopProfile,
    TokenLogprobs,
)

log = structlog.get_logger(__name__)
_codec = Codec(EngineToClient)


class EngineDeadError(RuntimeError):
    """The engine cannot serve (it died, hung, or this client was closed)."""


class RequestError(RuntimeError):
    """The engine rejected or failed one request (or a profiler start/stop); `status` is its
    HTTP-style code (400, 409, 503, 500)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status or 500


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's pooled vector (embed task)."""

    request_id: str
    embedding: Any  # torch.Tensor [dim], float32
    num_prompt_tokens: int


MAX_N = 128  # choices per request (OpenAI's bound): n fans out into n engine requests


@dataclass(slots=True)
class StreamOutput:
    """One step of one choice: the new tokens/text plus running totals (the offline API's
    `RequestOutput`, vLLM's shape, is a whole finished request)."""

    request_id: str
    index: int  # choice index (n > 1 fans out into n engine requests)
    text: str  # text added by this step
    output_text: str  # all text so far
    token_ids: list[int]  # tokens added by this step
    logprobs: list[TokenLogprobs] | None = None  # aligned with token_ids
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # stop token id or stop string
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: int = 0  # engine's HTTP-style status for an error (400, 503, 500)
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., on the first output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _Choice:
    """Client-side state of one engine request (one choice): what resuming it needs (its prompt,
    parameters and every token the engine sent) besides its detokenizer."""

    engine_id: str
    index: int
    detok: IncrementalDetokenizer
    params: SamplingParams | None = None
    finished: bool = False
    sent: bool = False  # its AddRequest left (a resume sends it again, with its tokens)
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    inbox: list[RequestDelta] = field(default_factory=list)  # routed, not yet taken by its consumer
    waiter: asyncio.Future[None] | None = None  # its consumer sleeps on this while the inbox is empty
    choices: dict[str, _Choice] = field(default_factory=dict)
    vectors: dict[str, Any] = field(default_factory=dict)  # embed: engine id -> pooled vector
    prompt_ids: list[int] = field(default_factory=list)
    images: Any = None  # (MultiModalInput, frames) of a vision-language prompt
    lora: LoraSpec | None = None  # its LoRA adapter (kept for a resume after a scheduler restart)

    def push(self, delta: RequestDelta) -> None:
        """Queue a delta for the consumer and wake it (once: it drains the whole inbox)."""
        self.inbox.append(delta)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list[RequestDelta]:
        """Everything routed since the last take, waiting while there is nothing."""
        while not self.inbox:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        out, self.inbox = self.inbox, []
        return out


class AsyncEngineClient:
    """Async client for one scheduler; many concurrent `generate()` calls share it."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        info: EngineInfo,
        tokenizer: Tokenizer,
        *,
        ctx: zmq.asyncio.Context | None = None,
        ping_after_s: float = 3.0,
        ping_timeout_s: float = 10.0,
    ):
        self.info = info
        self.tokenizer = tokenizer
        self.dead = False
        self.dead_reason: str | None = None
        self._sock = sock
        self._ctx = ctx
        self._ping_after = ping_after_s
        self._ping_timeout = ping_timeout_s
        self._requests: dict[str, _Request] = {}  # by user request id
        self._routes: dict[str, _Request] = {}  # by engine request id (choice)
        self._last_rx = time.monotonic()
        self._stats_waiters: list[asyncio.Future[EngineStats]] = []
        self._profile_waiters: list[asyncio.Future[ProfileStatus]] = []  # answered in order
        self._ping_sent: float | None = None
        # the scheduler is being replaced (`suspend`): new requests wait, in-flight ones are
        # resubmitted once it is back (`resume`); `_unresponsive`: failed by the watchdog, not dead
        self._running = asyncio.Event()
        self._running.set()
        self.suspended: str | None = None
        self._unresponsive = False
        self.num_resumed = 0
        self._tasks = [
            asyncio.create_task(self._reader(), name="engine-client-reader"),
            asyncio.create_task(self._watchdog(), name="engine-client-watchdog"),
        ]

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(
        cls,
        address: str,
        *,
        timeout: float = 60.0,
        tokenizer: Tokenizer | None = None,
        ctx: zmq.asyncio.Context | None = None,
        ping_after_s: float = 3.0,
        ping_timeout_s: float = 10.0,
        model_hint: str | None = None,
    ) -> "AsyncEngineClient":
        """Connect, fetch `EngineInfo` (retrying until `timeout`), load the tokenizer.
        model_hint: the model directory the engine is expected to serve; its tokenizer loads while
        the engine starts (time of a cold start otherwise spent after the engine is ready;
        docs/benchmarks.md#fig-frontends)."""
        own_ctx = ctx is None
        early = (
            asyncio.ensure_future(asyncio.to_thread(Tokenizer.load, model_hint))
            if tokenizer is None and model_hint
            else None
        )
        identity = b"c-" + uuid.uuid4().hex[:12].encode()
        if is_channel(address):  # an engine on this host (actors/channel.py); nothing to term
            own_ctx, ctx = False, None
            sock: Any = ChannelClient(channel_path(address), identity, DATA_MESSAGE_BYTES, queue=True).start()
        else:
            ctx = ctx or zmq.asyncio.Context()
            sock = bus_socket(ctx, zmq.DEALER)  # frames over the bus limit are refused
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 1000)  # let final aborts leave on close
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        try:
            if ctx is not None:
                attach(sock, address)  # a CURVE client on tcp:// (BusKeysMissing without keys)
            info = await asyncio.wait_for(_fetch_info(sock), timeout)
            if early is not None and info.model == model_hint:
                tokenizer = await early
            if tokenizer is None:
                tokenizer = await asyncio.to_thread(Tokenizer.load, info.model)
        except BaseException as e:
            if early is not None and not early.done():
                early.cancel()  # the thread finishes on its own; nobody waits for it
            sock.close(linger=0)
            if own_ctx and ctx is not None:
                ctx.term()
            if isinstance(e, asyncio.TimeoutError):
                raise TimeoutError(f"no EngineInfo from {address} within {timeout:.0f}s") from None
            raise
        log.info("engine_connected", address=address, model=info.served_model_name, max_model_len=info.max_model_len)
        return cls(
            sock,
            info,
            tokenizer,
            ctx=ctx if own_ctx else None,
            ping_after_s=ping_after_s,
            ping_timeout_s=ping_timeout_s,
        )

    def close(self) -> None:
        """Abort what is in flight, end every generate(), release the socket."""
        if self._routes and not self.dead:
            self._send_nowait(AbortRequest(list(self._routes)))
        if not self.dead:
            self.dead, self.dead_reason = True, "client closed"
        self.fail_all("client closed", dead=False)
        for t in self._tasks:
            t.cancel()
        self._sock.close()
        if self._ctx is not None:
            self._ctx.term()

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ requests

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: PromptImages | None = None,
        lora: LoraSpec | None = None,
    ) -> AsyncGenerator[StreamOutput, None]:
        """Validate now (ParamError / EngineDeadError raised here, before any await), then
        return an async iterator of outputs. Leaving the iteration early (break, cancel,
        aclose) aborts the request on the engine. `images`: a vision-language prompt's images
        (multimodal/frontend.py), whose placeholder runs `prompt` already holds. `lora`: the
        LoRA adapter to run with (a validated one: axonserve/lora/adapter.py; None: the base model)."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.generate_batch([prompt_ids], params, request_id or uuid.uuid4().hex, images, lora=lora)[0]

    def generate_batch(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        images: PromptImages | None = None,
        lora: LoraSpec | None = None,
    ) -> list[AsyncGenerator[StreamOutput, None]]:
        """Several prompts with the same parameters (a completions request's batch): every prompt is
        validated before any starts (prompts x n within the engine's fan-out bound), then one
        generation each, `request_id` (`<request_id>-p<j>` with several prompts). `images`: one prompt's.
        `lora`: every prompt's adapter."""
        if self.dead:
            raise EngineDeadError(self.dead_reason or "engine is dead")
        ids = batch_ids(self.info, len(prompts), params.n, request_id)
        subs = [self._fan_out(p, params) for p in prompts]
        for rid in ids:
            self._refuse_in_flight(rid)
        return [
            self._stream(rid, p, s, images if len(prompts) == 1 else None, lora)
            for rid, p, s in zip(ids, prompts, subs)
        ]

    def _refuse_in_flight(self, request_id: str) -> None:
        """A client-chosen id (the API's `request_id`) may not name a request in flight here: its
        abort(request_id) would be ambiguous. (The engine never sees it alone: `_engine_ids`.)"""
        if request_id in self._requests:
            raise ParamError("request_id", f"request id {request_id!r} is already in flight")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check params and context length; return engine params (n=1, max_tokens filled)."""
        self.require_task("generate", "Completions API")
        if not 1 <= params.n <= MAX_N:
            raise ParamError("n", f"n must be in [1, {MAX_N}]")
        params.check_limits(self.info.limits)  # sizes first: validate() compiles a grammar
        one = msgspec.structs.replace(params, n=1).validate()
        num, limit = len(prompt_ids), self.info.max_model_len
        self._check_ids(prompt_ids, "prompt")
        one.check_vocab(self.info.vocab_size)
        if num >= limit:
            raise ParamError(
                "input_tokens",
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {num} input tokens. Please reduce the length of the input.",
            )
        if one.max_tokens is None:
            return msgspec.structs.replace(one, max_tokens=limit - num)
        if num + one.max_tokens > limit:
            raise ParamError(
                "max_tokens",
                f"'max_tokens' is too large: {one.max_tokens}. This model's maximum context "
                f"length is {limit} tokens and your request has {num} input tokens "
                f"({one.max_tokens} > {limit} - {num}).",
            )
        return one

    def _check_ids(self, ids: list[int], field: str) -> None:
        """A prompt/input is non-empty and inside the vocabulary (ParamError on `field`)."""
        if not ids:
            raise ParamError(field, f"the {field} is empty")
        vocab = self.info.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ParamError(field, f"{field} token ids must be in [0, {vocab})")

    def require_task(self, task: str, api: str) -> None:
        """ParamError (HTTP 400) unless the served model serves `task` (generate | embed)."""
        if self.info.task != task:
            kind = "an embedding" if self.info.task == "embed" else "a generative"
            raise ParamError(
                "model",
                f"The model `{self.info.served_model_name}` is {kind} model "
                f"(task {self.info.task}): it does not support the {api}",
            )

    def validate_embed(self, prompt_ids: list[int]) -> None:
        """Check an embedding input: the task, the vocabulary, the model's positions."""
        self.require_task("embed", "Embeddings API")
        num, limit = len(prompt_ids), self.info.max_model_len
        self._check_ids(prompt_ids, "input")
        if num > limit:
            raise ParamError(
                "input",
                f"This model's maximum context length is {limit} tokens. However, you requested {num} "
                "tokens in the input for embedding generation. Please reduce the length of the input.",
            )

    async def embed(
        self, prompt: str | list[int], *, request_id: str | None = None, pooling: PoolingParams | None = None
    ) -> EmbeddingOutput:
        """The pooled vector of one prompt (embed task). ParamError / EngineDeadError before
        anything is sent; RequestError when the engine rejects or fails it. Cancelling the
        call aborts the request on the engine."""
        if self.dead:
            raise EngineDeadError(self.dead_reason or "engine is dead")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_embed(prompt_ids)
        request_id = request_id or uuid.uuid4().hex
        self._refuse_in_flight(request_id)
        engine_id = _engine_ids(request_id, 1)[0]
        req = _Request()
        self._requests[request_id] = self._routes[engine_id] = req
        try:
            await self._send(
                AddRequest(
                    engine_id,
                    prompt_ids,
                    SamplingParams(max_tokens=1),
                    arrival_time=time.time(),
                    pooling=pooling or PoolingParams(),
                )
            )
            delta = (await req.take())[0]
            vec = req.vectors.pop(engine_id, None)
            if delta.finish_reason == "error" and self.dead:
                raise EngineDeadError(self.dead_reason or delta.error or "engine is dead")
            if delta.finish_reason in ("error", "abort") or vec is None:
                why = delta.error or ("request aborted" if delta.finish_reason == "abort" else "no embedding returned")
                raise RequestError(why, delta.error_code or (499 if delta.finish_reason == "abort" else 500))
            return EmbeddingOutput(request_id, vec, delta.num_prompt_tokens or len(prompt_ids))
        finally:
            self._requests.pop(request_id, None)
            if self._routes.pop(engine_id, None) is not None and not self.dead:
                self._send_nowait(AbortRequest([engine_id]))

    def _fan_out(self, prompt_ids: list[int], params: SamplingParams) -> list[SamplingParams]:
        one = self.validate(prompt_ids, params)
        if params.n == 1:
            return [one]
        seed = one.seed
        return [msgspec.structs.replace(one, seed=None if seed is None else seed + i) for i in range(params.n)]

    async def get_stats(self, timeout: float = 10.0) -> EngineStats:
        """The scheduler's counters and gauges (prefix-cache hits, preemptions, queue sizes)."""
        fut: asyncio.Future[EngineStats] = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        await self._send(GetStats())
        return await asyncio.wait_for(fut, timeout)

    async def start_profile(self, timeout: float = 180.0) -> ProfileStatus:
        """Start torch.profiler on every worker rank (needs the engine's profile dir)."""
        return await self._profile(StartProfile(), timeout)

    async def stop_profile(self, timeout: float = 180.0) -> ProfileStatus:
        """Stop profiling; returns once every rank has written its trace (`files`)."""
        return await self._profile(StopProfile(), timeout)

    async def _profile(self, msg: StartProfile | StopProfile, timeout: float) -> ProfileStatus:
        if self.dead:
            raise EngineDeadError(self.dead_reason or "engine is dead")
        fut: asyncio.Future[ProfileStatus] = asyncio.get_running_loop().create_future()
        self._profile_waiters.append(fut)
        await self._send(msg)
        status = await asyncio.wait_for(fut, timeout)
        if status.error is not None:
            raise RequestError(status.error, status.code)
        return status

    async def abort(self, request_id: str) -> None:
        """Abort a request (user id, or one choice's engine id); its generate() ends "abort"."""
        req = self._requests.get(request_id)
        if req is not None:
            ids = [cid for cid in req.choices if cid in self._routes]
        elif request_id in self._routes:
            req, ids = self._routes[request_id], [request_id]
        else:
            return
        for cid in ids:
            self._routes.pop(cid, None)
            req.push(RequestDelta(cid, finish_reason="abort"))
        if ids and not self.dead:
            await self._send(AbortRequest(ids))

    # ------------------------------------------------------------------ scheduler restarts

    def for_scheduler(self, name: str) -> "AsyncEngineClient":
        """The client of the engine scheduler `name` drives: this one (see dp_client.py)."""
        return self

    def suspend(self, reason: str) -> None:
        """The scheduler died and is being replaced: streams wait (new requests are held, the
        watchdog does not fail them) until `resume`."""
        self.suspended = reason
        self._running.clear()
        log.warning("engine_restarting", reason=reason, in_flight=len(self._requests))

    async def resume(self) -> int:
        """The new scheduler is up: resubmit every unfinished choice that had been sent, as a
        continuation (its prompt plus the tokens already received, which count as outputs: the
        same max_tokens, min_tokens, stop rules and seeded positions), so each stream goes on
        without a duplicated or missing token. Returns how many were resumed."""
        if self.suspended is None:
            return 0
        self.suspended = None
        now, resumed = time.time(), 0
        for req in list(self._requests.values()):
            for cid, choice in req.choices.items():
                if choice.finished or not choice.sent or cid not in self._routes or choice.params is None:
                    continue
                mm, frames = req.images if req.images is not None else (None, [])
                params = msgspec.structs.replace(choice.params, prompt_logprobs=None)  # (sent already)
                msg = AddRequest(
                    cid,
                    req.prompt_ids,
                    params,
                    arrival_time=now,
                    mm=mm,
                    output_token_ids=choice.token_ids,
                    lora=req.lora,
                )
                await self._send(msg, frames)
                resumed += 1
        self.num_resumed += resumed
        self._last_rx = time.monotonic()
        self._running.set()
        log.info("engine_resumed", requests=resumed)
        return resumed

    def fail_all(self, reason: str, *, dead: bool = True) -> None:
        """End every in-flight generate() with finish_reason "error"; mark the engine dead."""
        if dead and not self.dead:
            self.dead, self.dead_reason = True, reason
            log.error("engine_dead", reason=reason, in_flight=len(self._requests))
        for cid, req in list(self._routes.items()):
            req.push(RequestDelta(cid, finish_reason="error", error=reason))
        self._routes.clear()
        for fut in self._profile_waiters:
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._profile_waiters.clear()

    async def _stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        subs: list[SamplingParams],
        images: PromptImages | None = None,
        lora: LoraSpec | None = None,
    ) -> AsyncGenerator[StreamOutput, None]:
        req = _Request(lora=lora)
        for i, (cid, p) in enumerate(zip(_engine_ids(request_id, len(subs)), subs)):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                skip_special_tokens=p.skip_special_tokens,
                stop=p.stop,
                include_stop_str_in_output=p.include_stop_str_in_output,
                min_tokens=p.min_tokens,
            )
            req.choices[cid] = _Choice(cid, i, detok, p)
        req.prompt_ids = prompt_ids
        if self.dead:  # died between generate() and the first iteration
            raise EngineDeadError(self.dead_reason or "engine is dead")
        self._refuse_in_flight(request_id)  # one generate() of two may start first
        self._requests[request_id] = req
        self._routes.update((cid, req) for cid in req.choices)
        now = time.time()
        open_ids = set(req.choices)
        mm, frames = images.wire() if images is not None else (None, [])
        req.images = (mm, frames) if images is not None else None
        try:
            await self._running.wait()  # a scheduler being replaced takes it once it is back
            for (cid, choice), p in zip(req.choices.items(), subs):
                await self._send(AddRequest(cid, prompt_ids, p, arrival_time=now, mm=mm, lora=lora), frames)
                choice.sent = True
            choices, num_prompt = req.choices, len(prompt_ids)
            while open_ids:
                for delta in await req.take():
                    choice = choices.get(delta.request_id)
                    if choice is None or choice.finished:
                        continue
                    out = self._process(request_id, choice, delta, num_prompt)
                    if out.finish_reason is not None:
                        choice.finished = True
                        open_ids.discard(choice.engine_id)
                        if self._routes.pop(choice.engine_id, None) is not None:
                            self._send_nowait(AbortRequest([choice.engine_id]))  # stop string hit
                    if out.text or out.token_ids or out.finish_reason is not None or out.prompt_logprobs is not None:
                        yield out
        finally:
            self._requests.pop(request_id, None)
            left = [cid for cid in open_ids if self._routes.pop(cid, None) is not None]
            if left and not self.dead:
                self._send_nowait(AbortRequest(left))
                log.debug("request_aborted", request_id=request_id, engine_ids=left)

    def _process(self, request_id: str, choice: _Choice, delta: RequestDelta, num_prompt: int) -> StreamOutput:
        new_ids, finish, detok = delta.new_token_ids, delta.finish_reason, choice.detok
        choice.token_ids += new_ids
        d = detok.step(new_ids, finished=finish is not None, stop_terminated=finish == "stop")
        token_ids, logprobs = new_ids, delta.logprobs
        if d.num_tokens < len(new_ids):  # a stop string ended it inside this delta
            token_ids = new_ids[: d.num_tokens]
            logprobs = logprobs[: d.num_tokens] if logprobs is not None else None
        if d.stop_string is not None:
            finish, stop_reason = "stop", d.stop_string
        else:
            stop_reason = delta.stop_reason
        # positional (StreamOutput's field order): once per request per step, keywords cost more
        return StreamOutput(
            request_id,
            choice.index,
            d.text,
            detok.text,
            token_ids,
            logprobs,
            finish,
            stop_reason,
            num_prompt,  # (a resumed request's engine prompt holds its earlier outputs)
            detok.num_output_tokens,
            delta.num_cached_tokens,
            delta.error,
            delta.error_code,
            delta.prompt_logprobs,
        )

    # ------------------------------------------------------------------ socket

    async def _send(self, msg: msgspec.Struct, tensors: list[Any] | None = None) -> None:
        await self._sock.send_multipart(Codec.encode(msg, tensors or ()), copy=False)

    def _send_nowait(self, msg: msgspec.Struct) -> None:
        """Send from sync code / finally blocks (zmq.asyncio queues it if it would block)."""
        try:
            self._sock.send_multipart(Codec.encode(msg), copy=False)
        except zmq.ZMQError as e:
            log.warning("send_failed", error=str(e), type=type(msg).__name__)

    async def _reader(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            self._last_rx = time.monotonic()
            self._ping_sent = None
            try:
                msg, _ = _codec.decode(frames)
            except DecodeError as e:
                log.warning("bad_engine_message", error=str(e))
                continue
            if isinstance(msg, Outputs):
                routes = self._routes
                for delta in msg.deltas:
                    req = routes.get(delta.request_id)
                    if req is not None:
                        if delta.embedding is not None:
                            delta = _keep_vector(req, delta, frames)
                        req.push(delta)
                        if delta.finish_reason is not None:
                            del routes[delta.request_id]
            elif isinstance(msg, EngineInfo):
                self.info = msg
                if self._unresponsive:  # it answers again: serve again
                    self.dead, self.dead_reason, self._unresponsive = False, None, False
                    log.info("engine_recovered")
            elif isinstance(msg, EngineStats):
                for fut in self._stats_waiters:
                    if not fut.done():
                        fut.set_result(msg)
                self._stats_waiters.clear()
            elif isinstance(msg, ProfileStatus) and self._profile_waiters:
                fut = self._profile_waiters.pop(0)  # answers come in request order
                if not fut.done():  # (unless that caller timed out)
                    fut.set_result(msg)
            elif isinstance(msg, EngineDead):
                self.fail_all(f"engine died: {msg.reason}")

    async def _watchdog(self) -> None:
        """Ping a silent engine while requests wait on it; no answer in time -> fail_all."""
        tick = min(self._ping_after, self._ping_timeout) / 3
        while True:
            await asyncio.sleep(tick)
            if (
                self.suspended is not None
                or (self.dead and not self._unresponsive)
                or not (self._routes or self._unresponsive)
            ):
                self._ping_sent = None
                continue
            now = time.monotonic()
            if self._ping_sent is None:
                if now - self._last_rx > self._ping_after:
                    self._ping_sent = now
                    await self._send(GetEngineInfo())
            elif now - self._ping_sent > self._ping_timeout:
                self._ping_sent = None  # and ping again: an engine that answers later is alive again
                if not self._unresponsive:
                    self.fail_all(f"engine unresponsive: no reply to a ping within {self._ping_timeout:.0f}s")
                    self._unresponsive = True


def batch_ids(info: EngineInfo, num_prompts: int, n: int, request_id: str) -> list[str]:
    """The ids of a completions batch's generations (`<request_id>-p<j>` with several prompts), once
    prompts x n is within the engine's fan-out bound (ParamError otherwise)."""
    fanout = info.limits.max_fanout
    if num_prompts * n > fanout:
        raise ParamError(
            "n" if num_prompts == 1 else "prompt",
            f"a request may start at most {fanout} generations (prompts x n); this one asks for {num_prompts} x {n}",
        )
    return [request_id] if num_prompts == 1 else [f"{request_id}-p{j}" for j in range(num_prompts)]


def _engine_ids(request_id: str, n: int) -> list[str]:
    """Fresh scheduler ids for a request's n choices: the caller's id (for logs) plus a random
    tag, so an id reused right after an abort never receives the old request's late outputs or
    final abort, and two clients choosing the same id never share a request on the engine."""
    base = f"{request_id}@{uuid.uuid4().hex[:12]}"
    return [base] if n == 1 else [f"{base}-{i}" for i in range(n)]


def _keep_vector(req: _Request, delta: RequestDelta, frames: list) -> RequestDelta:
    """Store the vector the delta's `embedding` names (a copy: the frame is released)."""
    try:
        req.vectors[delta.request_id] = tensor_from_frame(delta.embedding, frames).clone()  # type: ignore[arg-type]
    except DecodeError as e:
        return RequestDelta(delta.request_id, finish_reason="error", error=f"bad embedding frame: {e}", error_code=500)
    return delta


async def _fetch_info(sock: zmq.asyncio.Socket) -> EngineInfo:
    """Ask for EngineInfo once a second until it arrives (the scheduler may start later)."""
    while True:
        await sock.send_multipart(Codec.encode(GetEngineInfo()))
        if await sock.poll(1000, zmq.POLLIN):
            frames = await sock.recv_multipart()
            try:
                msg, _ = _codec.decode(frames)
            except DecodeError as e:
                log.warning("bad_engine_message", error=str(e))
                continue
            if isinstance(msg, EngineInfo):
                return msg
            if isinstance(msg, EngineDead):
                raise EngineDeadError(f"engine died: {msg.reason}")


__all__ = ["AsyncEngineClient", "EmbeddingOutput", "EngineDeadError", "RequestError", "StreamOutput", "SamplingParams"]
