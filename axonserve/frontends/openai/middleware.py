"""Pure ASGI middleware for the HTTP edge: API-key auth, a request body size limit, the access log.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so `http.disconnect` still reaches the
handlers, which is how a client that goes away gets its engine request aborted.
"""

from __future__ import annotations

import hmac
import json
import os
import time
from contextvars import ContextVar
from typing import Any, Awaitable, Callable

import structlog

log = structlog.get_logger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

API_KEY_ENV = ("AXONSERVE_API_KEY", "VLLM_API_KEY")


def api_key_from_env() -> str | None:
    """The key set by `--api-key` (the CLI exports it, so it never sits on a command line)."""
    for name in API_KEY_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return None


async def send_error(send: Send, status: int, message: str, type_: str, headers: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# routes that stay open with an API key: probes and the schema (vLLM guards only /v1/*; we also
# guard /tokenize, /detokenize and the profiler, which run templates or write to disk)
PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics", "/ping", "/openapi.json"})


class ApiKeyAuth:
    """Every route but `PUBLIC_PATHS` needs `Authorization: Bearer <key>`. CORS preflights
    (OPTIONS) pass."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self._key = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in PUBLIC_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._key):
                await send_error(
                    send,
                    401,
                    "Unauthorized: missing or invalid API key",
                    "AuthenticationError",
                    [(b"www-authenticate", b"Bearer")],
                )
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse request bodies over `max_bytes` with 413 before any handler parses them.

    A declared Content-Length is checked up front; a chunked body is buffered up to the
    limit and then replayed, after which `receive` is the client's again (disconnects)."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send)
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # client left before sending the whole body
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(send)
                return
            if not msg.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)

    async def _too_large(self, send: Send) -> None:
        await send_error(
            send, 413, f"request body is larger than the limit of {self.max_bytes} bytes", "RequestTooLargeError"
        )


# The access record of the HTTP request being served (set by AccessLog, filled by handlers).
access_record: ContextVar[dict[str, Any] | None] = ContextVar("axonserve_access", default=None)
QUIET_PATHS = ("/health", "/metrics")


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
        token = access_record.set(rec)

        async def send_status(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                rec["status"] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            access_record.reset(token)
            t0 = rec.pop("t0")
            fields = {k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}
            emit = log.debug if scope["path"] in QUIET_PATHS else log.info
            emit(
                "access",
                method=scope["method"],
                path=scope["path"],
                seconds=round(time.perf_counter() - t0, 4),
                **fields,
            )


def note_access(**fields: Any) -> None:
    rec = access_record.get()
    if rec is not None:
        rec.update(fields)
