"""The frontend actor: an OpenAI-compatible HTTP server in its own process.

It is a client of the scheduler like any other (`AsyncEngineClient`), plus uvicorn. When
the supervisor reports a dead peer, in-flight HTTP requests end with errors at once (SSE
error chunks for streams) and /health turns 503, so load balancers and clients see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import uvicorn
import zmq

from axonserve.actors.runtime import SMALL_MESSAGE_BYTES, Actor
from axonserve.frontends.client import AsyncEngineClient
from axonserve.frontends.dp_client import DataParallelClient
from axonserve.frontends.openai.server import build_app
from axonserve.protocol import Codec
from axonserve.protocol.messages import GetMetrics, MetricsText, RestartStats

_metrics_codec = Codec(MetricsText)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the actor runtime owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


class FrontendActor(Actor):
    kind = "frontend"

    client: AsyncEngineClient | DataParallelClient | None = None
    _server: _Server | None = None
    _serve_task: asyncio.Task[None] | None = None

    async def setup(self) -> dict[str, Any]:
        engines = self.addresses.engines or [self.addresses.engine]
        kw = dict(timeout=self.config.ready_timeout_s, model_hint=self.config.model)
        if len(engines) > 1:  # data parallel: one client per engine, each request routed to one
            self.client = await DataParallelClient.connect(engines, **kw)
        else:
            self.client = await AsyncEngineClient.connect(engines[0], **kw)
        self._metrics_sock = self.socket(zmq.DEALER, self.addresses.metrics, max_bytes=SMALL_MESSAGE_BYTES)
        self._metrics_lock = asyncio.Lock()
        self.app = build_app(self.client, self.config, metrics=self._fetch_metrics)
        # Bind here so a busy port fails setup with OSError (uvicorn would sys.exit).
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.create_server((self.config.host, self.config.port), family=family)
        port = sock.getsockname()[1]
        cfg = uvicorn.Config(
            self.app,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=2,
            timeout_keep_alive=30,
        )
        self._server = _Server(cfg)
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]), name="uvicorn")
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise RuntimeError("HTTP server stopped during start-up")
            await asyncio.sleep(0.02)
        self.log.info("http_listening", host=self.config.host, port=port)
        return {"host": self.config.host, "port": port}

    async def _fetch_metrics(self) -> str:
        """Ask the metrics actor for its exposition (one query at a time: replies are ordered)."""
        async with self._metrics_lock:
            await self._metrics_sock.send_multipart(Codec.encode(GetMetrics()))
            frames = await asyncio.wait_for(self._metrics_sock.recv_multipart(), 5.0)
        msg, _ = _metrics_codec.decode(frames)
        return msg.text

    async def run(self) -> None:
        assert self._serve_task is not None
        stop = asyncio.create_task(self.stopping.wait())
        await asyncio.wait({stop, self._serve_task}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if self._serve_task.done() and not self.stopping.is_set():
            self._serve_task.result()
            raise RuntimeError("HTTP server exited unexpectedly")

    async def on_peer_failed(self, name: str, reason: str) -> None:
        msg = f"engine failure: {name}: {reason}"
        if getattr(self, "app", None) is not None:
            self.app.state.unhealthy = msg
        if self.client is not None:
            self.client.fail_all(msg)

    async def on_peer_restarting(self, name: str, reason: str) -> None:
        """/health turns 503 until the replacement is ready; a scheduler's clients wait for it."""
        if getattr(self, "app", None) is not None:
            self.app.state.restarting[name] = reason
        if name.startswith("scheduler") and self.client is not None:
            self.client.for_scheduler(name).suspend(f"{name} restarting: {reason}")

    async def on_peer_restarted(self, name: str, seconds: float, info: dict) -> None:
        if getattr(self, "app", None) is not None:
            self.app.state.restarting.pop(name, None)
        if name.startswith("scheduler") and self.client is not None:
            n = await self.client.for_scheduler(name).resume()
            self.publish(RestartStats(actor="", seconds=0.0, requests_resumed=n))

    async def teardown(self) -> None:
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._serve_task), 3.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                self._server.force_exit = True
                self._serve_task.cancel()
        if self.client is not None:
            self.client.close()
