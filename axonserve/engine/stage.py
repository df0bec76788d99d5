"""What a side channel of the scheduler (a stage) may ask of the engine core.

Stages — the encoder pool (multimodal/stage.py), the prefill engine of P/D disaggregation
(engine/disagg.py), the draft-model drafter (speculative/stage.py) and the profiler
(engine/profiling.py) — each own their sockets and task. They reach the core only through
this interface, never through the scheduler actor's internals, so the core's step loop stays
one screen and a stage can be read (and tested) on its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import structlog

    from axonserve.config import EngineConfig
    from axonserve.engine.request import Request
    from axonserve.engine.scheduler import Scheduler
    from axonserve.protocol.messages import RequestDelta


class Core(Protocol):
    config: "EngineConfig"
    sched: "Scheduler"  # read-only for stages, except the drafts they hand to running requests
    log: "structlog.typing.FilteringBoundLogger"
    dead: asyncio.Event  # set once the engine has failed: waits on peers end

    async def enqueue(self, req: "Request") -> None:
        """Into the waiting queue (checked and admitted already): it runs from the next step."""

    async def emit(self, deltas: list["RequestDelta"]) -> None:
        """Outputs to the requests' clients (a finishing delta ends its request's ownership)."""

    async def fail(self, reason: str) -> None:
        """The engine can serve no more: every request ends with an error, clients are told."""

    async def reply(self, ident: bytes, msg: Any) -> None:
        """A message to one client (by its identity)."""

    async def broadcast(self, msg: Any) -> None:
        """A message to every worker rank, on the plan socket (between steps only)."""

    async def await_reply(self, what: str, timeout: float, want: Callable[[Any], str | None]) -> Any:
        """Rank 0's next reply that `want` accepts (returns None for it); None when the engine
        failed meanwhile (timeout or death)."""


async def recv_before(sock: Any, deadline: float, *stop_on: asyncio.Event) -> list | None:
    """The next message's frames from `sock`; None when the monotonic `deadline` passes or one of
    `stop_on` is set first (the engine died, the peer is being restarted)."""
    recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
    stops = [asyncio.ensure_future(e.wait()) for e in stop_on]
    try:
        done, _ = await asyncio.wait(
            {recv, *stops}, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for stop in stops:
            stop.cancel()
    if recv not in done:
        recv.cancel()
        return None
    return recv.result()
