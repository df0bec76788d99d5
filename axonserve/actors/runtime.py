"""Actor base: one process, its own sockets, a readiness handshake, heartbeats, clean shutdown.

Life of an actor (driven by `Actor.main`):
    Hello -> setup() [heavy: load weights, bind sockets] -> Ready(info) -> run() ... -> teardown()
From Ready on, a thread of the actor's own sends its heartbeats to the supervisor, whatever its event
loop is doing: a process that is stopped or dead stops beating (that is what liveness means), a
loop that is merely busy does not (long work is bounded elsewhere: a worker's step by the
scheduler's step timeout; the frontend keeps request-sized work off its loop).
A control task listens to the supervisor the whole time: `Shutdown` stops the actor,
`ActorFailed` about a peer calls `on_peer_failed`, `Configure` delivers facts learned at
start-up (e.g. the KV block count the workers measured) to `self.configured`.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any, ClassVar

import structlog
import zmq
import zmq.asyncio

from axonserve.actors.security import release, secure
from axonserve.config import ActorSpec
from axonserve.protocol import Codec, Control, DecodeError
from axonserve.protocol.messages import (
    ActorAlive,
    ActorFailed,
    ActorRestarted,
    ActorRestarting,
    Configure,
    Heartbeat,
    Hello,
    Ready,
    Shutdown,
)

_control_codec = Codec(Control)
HEARTBEAT_SUFFIX = "#hb"  # identity suffix of an actor's heartbeat-thread socket

# ZMQ_MAXMSGSIZE, the largest frame a socket accepts (libzmq checks each frame of a message;
# a peer that sends a larger one is disconnected, its message dropped, before it is buffered).
# Control, stats and metrics sockets carry small messages (a Ready's facts, a step's counters,
# the Prometheus text): 16 MiB. Data sockets (requests, plans, results, drafts, images, KV
# blocks, snapshots) carry tensor frames; their largest legitimate frame is one of: a request's
# or plan's body (every known token of up to max_num_seqs requests: 256 x 128k tokens x <= 5
# bytes of msgpack = 160 MiB), a request's pixels (max_images_per_request x 3 x side^2 x 4 bytes:
# 48 MiB per 2048 x 2048 image) or image features (tokens x hidden x 4 bytes: 128 MiB per
# image at 4096 tokens x 8192), one KV block (layers x 2 x block_size x kv_heads x head_dim x
# 4 bytes: 16 MiB at 128 layers x 16 x 16 x 128), a snapshot tensor (2048 positions' logits
# over a 128k vocabulary in float32: 1 GiB). Default: max(1 GiB, 128 MiB x max_images_per_request);
# `EngineConfig.max_bus_message_bytes` overrides it.
SMALL_MESSAGE_BYTES = 16 * 2**20
DATA_MESSAGE_BYTES = 2**30
PER_IMAGE_BYTES = 128 * 2**20


def data_message_bytes(config: Any) -> int:
    """The frame-size limit of the data sockets for this engine configuration."""
    override = int(getattr(config, "max_bus_message_bytes", 0) or 0)
    if override > 0:
        return override
    return max(DATA_MESSAGE_BYTES, PER_IMAGE_BYTES * int(getattr(config, "max_images_per_request", 0) or 0))


def bus_socket(ctx: zmq.Context, kind: int, max_bytes: int = DATA_MESSAGE_BYTES) -> Any:
    """Every bus socket is made here: a new socket of `kind` that drops frames over `max_bytes`.
    Bind or connect it with `attach`, which puts CURVE on a tcp:// endpoint."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    return s


def attach(sock: Any, address: str, *, bind: bool = False) -> None:
    """Every bus socket binds or connects here: on tcp:// as a CURVE server (binding) or client
    (`actors/security.py`; no keys: BusKeysMissing), on ipc:// as it is (its 0700 run directory
    keeps other users out)."""
    secure(sock, address, server=bind)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)


def supervisor_name(identity: bytes) -> str:
    """The actor a control-socket identity belongs to (its heartbeat thread included)."""
    return identity.decode(errors="replace").removesuffix(HEARTBEAT_SUFFIX)


class Actor:
    kind: ClassVar[str] = ""

    def __init__(self, spec: ActorSpec):
        self.spec = spec
        self.name = spec.name
        self.config = spec.config
        self.addresses = spec.addresses
        self.ctx = zmq.asyncio.Context()
        self.log = structlog.get_logger().bind(actor=self.name)
        if spec.kind == "worker":  # on every line of this process, module loggers included
            structlog.contextvars.bind_contextvars(rank=spec.rank)
        self.stopping = asyncio.Event()
        self.configured: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._control = self.socket(
            zmq.DEALER, self.addresses.control, identity=self.name.encode(), max_bytes=SMALL_MESSAGE_BYTES
        )
        self._stats_sock: zmq.Socket | None = None  # sync socket: NOBLOCK sends return at once
        if self.addresses.stats:
            self._stats_sock = bus_socket(zmq.Context.shadow(self.ctx.underlying), zmq.PUSH, SMALL_MESSAGE_BYTES)
            self._stats_sock.setsockopt(zmq.LINGER, 0)
            self._stats_sock.setsockopt(zmq.SNDHWM, 10_000)
            attach(self._stats_sock, self.addresses.stats)
        self.stats_dropped = 0
        self._loop_tick = time.monotonic()  # the event loop's last heartbeat tick (_heartbeat_loop)

    # ------------------------------------------------------------------ overridables

    async def setup(self) -> dict[str, Any]:
        """Bind sockets, load what is heavy. Returns facts for the Ready message."""
        return {}

    async def run(self) -> None:
        """The actor's work; returns when done. Default: wait for shutdown."""
        await self.stopping.wait()

    async def on_peer_failed(self, name: str, reason: str) -> None:
        """A peer died or hung (told by the supervisor)."""

    async def on_peer_restarting(self, name: str, reason: str) -> None:
        """A peer (or "workers": the rank group) died or hung and is being replaced."""

    async def on_peer_restarted(self, name: str, seconds: float, info: dict[str, Any]) -> None:
        """A peer's replacement is ready."""

    async def teardown(self) -> None:
        """Release resources; sockets are closed by the runtime afterwards."""

    # ------------------------------------------------------------------ helpers

    def socket(
        self,
        kind: int,
        address: str,
        *,
        bind: bool = False,
        identity: bytes | None = None,
        max_bytes: int | None = None,
    ) -> zmq.asyncio.Socket:
        """A bus socket bound or connected to `address`; `max_bytes`: its frame-size limit
        (default: the data sockets', `data_message_bytes`)."""
        s = bus_socket(self.ctx, kind, max_bytes or data_message_bytes(self.config))
        s.setsockopt(zmq.LINGER, 2000)  # a final message (e.g. "dead") still leaves on close
        if identity is not None:
            s.setsockopt(zmq.IDENTITY, identity)
        if kind in (zmq.PUB, zmq.XPUB, zmq.PUSH, zmq.DEALER, zmq.ROUTER):
            s.setsockopt(zmq.SNDHWM, 0)
        if kind in (zmq.SUB, zmq.PULL, zmq.DEALER, zmq.ROUTER):
            s.setsockopt(zmq.RCVHWM, 0)
        attach(s, address, bind=bind)
        return s

    async def messages(self, sock: zmq.asyncio.Socket, codec: Codec, what: str, routed: bool = False):
        """Decoded messages from `sock` forever: (message, frames[, sender identity]). Junk is
        logged and dropped. `routed`: a ROUTER socket or a routed channel (frame 0 is the sender; frames start
        after it, so TensorRef indexes stay relative to the body)."""
        while True:
            frames = await sock.recv_multipart(copy=False)
            sender = (frames[0].bytes if hasattr(frames[0], "bytes") else bytes(frames[0])) if routed else b""
            if routed:
                frames = frames[1:]
            try:
                msg, _ = codec.decode(frames)
            except DecodeError as e:
                self.dropped(what, e, sender=sender.decode(errors="replace"))
                continue
            yield (msg, frames, sender) if routed else (msg, frames)

    def dropped(self, what: str, error: Any, **kw: Any) -> None:
        """Log a message dropped as junk; `what` names the socket. Rate-limited per socket (each
        of the first 10, then every 100th) so that a flood of junk cannot flood the log."""
        counts = self.__dict__.setdefault("_junk", {})
        n = counts[what] = counts.get(what, 0) + 1
        if n <= 10 or n % 100 == 0:
            self.log.warning("bad_message", what=what, error=str(error)[:300], dropped=n, **kw)

    def publish(self, event: Any) -> None:
        """Send a stats event without ever waiting: under back-pressure it is dropped, counted."""
        if self._stats_sock is None:
            return
        try:
            self._stats_sock.send_multipart(Codec.encode(event), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.stats_dropped += 1

    async def send_control(self, msg: Any) -> None:
        await self._control.send_multipart(Codec.encode(msg), copy=False)

    async def report_failure(self, reason: str) -> None:
        """Tell the supervisor this actor cannot go on; it will notify peers and stop us."""
        self.log.error("actor_failed", reason=reason)
        try:
            await asyncio.wait_for(self.send_control(ActorFailed(self.name, reason)), 1.0)
        except Exception:  # noqa: BLE001 - best effort while dying
            pass

    # ------------------------------------------------------------------ runtime

    async def main(self) -> int:
        """Run the actor's whole life; returns the process exit code."""
        await self.send_control(Hello(self.name, os.getpid()))
        control_task = asyncio.create_task(self._control_loop(), name="control")
        code = 0
        beats = threading.Event()  # set: the heartbeat thread stops
        beater: threading.Thread | None = None
        try:
            setup = asyncio.create_task(self.setup(), name="setup")
            await _first(setup, self.stopping)
            if self.stopping.is_set():
                setup.cancel()
                return 0
            info = setup.result()
            await self.send_control(Ready(self.name, info))
            self.log.info("ready", **{k: v for k, v in info.items() if not isinstance(v, list)})
            self._loop_tick = time.monotonic()  # setup may have taken long: not a stall
            hb = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
            beater = threading.Thread(target=self._beat_in_thread, args=(beats,), name="heartbeat", daemon=True)
            beater.start()
            run = asyncio.create_task(self.run(), name="run")
            await _first(run, self.stopping)
            if run.done() and run.exception() is not None:
                raise run.exception()  # type: ignore[misc]
            run.cancel()
            hb.cancel()
            self._loop_tick = float("inf")  # no more ticks from here on, and no stall either
        except Exception as e:  # noqa: BLE001 - an actor reports, then dies with non-zero
            self.log.exception("actor_crashed")
            await self.report_failure(f"{type(e).__name__}: {e}")
            code = 1
        finally:
            control_task.cancel()
            try:
                await asyncio.wait_for(self.teardown(), 5.0)
            except Exception:  # noqa: BLE001
                self.log.exception("teardown_failed")
            beats.set()  # beating through teardown; its socket must close before the context
            if beater is not None:
                await asyncio.to_thread(beater.join, 2.0)
            self.close()
        return code

    def close(self) -> None:
        """Close every socket and the context (the sync stats socket is not tracked by it)."""
        if self._stats_sock is not None:
            self._stats_sock.close(linger=0)
            self._stats_sock = None
        release(self.ctx)  # its ZAP thread's sockets would hold the context's term
        self.ctx.destroy(linger=1000)

    async def _control_loop(self) -> None:
        while True:
            frames = await self._control.recv_multipart()
            try:
                msg, _ = _control_codec.decode(frames)
            except DecodeError as e:
                self.log.warning("bad_control_message", error=str(e))
                continue
            if isinstance(msg, Shutdown):
                self.log.info("shutdown_requested", reason=msg.reason)
                self.stopping.set()
            elif isinstance(msg, ActorFailed):
                self.log.warning("peer_failed", peer=msg.name, reason=msg.reason)
                try:
                    await self.on_peer_failed(msg.name, msg.reason)
                except Exception:  # noqa: BLE001
                    self.log.exception("on_peer_failed_error")
            elif isinstance(msg, Configure):
                if not self.configured.done():
                    self.configured.set_result(msg.info)
            elif isinstance(msg, (ActorRestarting, ActorRestarted)):
                try:
                    if isinstance(msg, ActorRestarting):
                        await self.on_peer_restarting(msg.name, msg.reason)
                    else:
                        await self.on_peer_restarted(msg.name, msg.seconds, dict(msg.info))
                except Exception:  # noqa: BLE001
                    self.log.exception("on_peer_restart_error", peer=msg.name)
            else:
                self.log.warning("unexpected_control_message", type=type(msg).__name__)

    async def _heartbeat_loop(self) -> None:
        """The loop's side: `ActorAlive` on the stats bus, and the tick the heartbeat thread reads
        to tell a stalled loop (logged, not fatal) from a busy one."""
        pid = os.getpid()
        while True:
            self._loop_tick = time.monotonic()
            self.publish(ActorAlive(self.name, pid, self.stats_dropped))
            await asyncio.sleep(self.config.heartbeat_interval_s)

    def _beat_in_thread(self, stop: threading.Event) -> None:
        """Heartbeats on a socket of this thread (zmq sockets are single-threaded) until `stop`.
        A loop that has not ticked for heartbeat_timeout_s is logged once (and its end), never
        reported as a failure: only a process that cannot run this thread is dead."""
        sock = bus_socket(zmq.Context.shadow(self.ctx.underlying), zmq.DEALER, SMALL_MESSAGE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, (self.name + HEARTBEAT_SUFFIX).encode())
        attach(sock, self.addresses.control)
        stalled = False
        try:
            while True:
                try:
                    sock.send_multipart(Codec.encode(Heartbeat(self.name, time.time())), flags=zmq.NOBLOCK)
                except zmq.Again:  # the supervisor is not reading: nothing to tell it
                    pass
                lag = time.monotonic() - self._loop_tick
                if not stalled and lag > self.config.heartbeat_timeout_s:
                    self.log.warning("event_loop_stalled", seconds=round(lag, 1))
                    stalled = True
                elif stalled and lag <= self.config.heartbeat_timeout_s:
                    self.log.info("event_loop_resumed")
                    stalled = False
                if stop.wait(self.config.heartbeat_interval_s):
                    return
        except zmq.ZMQError as e:  # the context is going away: the actor is shutting down
            self.log.info("heartbeat_thread_stopped", error=str(e))
        finally:
            sock.close()


async def _first(task: asyncio.Task, event: asyncio.Event) -> None:
    """Wait until `task` finishes or `event` is set."""
    waiter = asyncio.create_task(event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
