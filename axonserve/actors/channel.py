"""The step's hot path between the scheduler and its worker ranks on one host: multipart
messages over a Unix stream socket that the event loop reads itself.

Why not ZeroMQ here: a libzmq message crosses the sender's and the receiver's I/O threads before
the receiving loop wakes, three thread wake-ups a hop; on this project's 2-vCPU VM a 600-byte
zmq ipc round trip cost 332 µs against 194 on a channel (and 6 for a bare pipe pair), and every step
makes one (its plan out, its result back) on the critical path, and sends its outputs to the
clients (docs/benchmarks.md#fig-bus-channel). The control, stats and side-channel sockets stay on
ZeroMQ, and so do these paths across hosts (tcp://, CURVE) and for the vLLM plugin's rank host.

Addresses `unix://PATH`. The scheduler listens (`ChannelServer`), peers connect (`ChannelClient`,
which connects when the server is there and again to a replacement) and announce themselves with
a hello. Two uses:
- plans and results: a plan goes to every connected rank (as XPUB did; the hello, carrying the
  rank, counts as a SUB's subscription did); a rank's sends while disconnected are dropped (a new
  scheduler has no use for an old one's results);
- the engine socket (`routed`): a client's hello carries its identity, messages arrive as
  [identity, frames...] and `send_multipart([identity, frames...])` answers that client, as a
  ROUTER does with DEALERs; a client queues what it sends while disconnected (a DEALER does too:
  nothing a client sends is lost to a scheduler restart).

Wire: a message is a header (u32 frame count, then one u64 length per frame) and its frames. A
peer that sends more than MAX_FRAMES frames or a frame over the channel's `max_bytes` is
disconnected at the header, before its frames are buffered (libzmq's MAXMSGSIZE behaviour); the
socket's directory is the run directory (0700), so only this user's processes can connect at all.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections import deque
from typing import Any

import structlog

log = structlog.get_logger(__name__)

SCHEME = "unix://"
MAX_FRAMES = 1 << 16  # frames in one message (a plan's images and KV blocks ride as frames)
_COUNT = struct.Struct("<I")
HELLO = b"axonserve-rank"  # a rank's first message: [HELLO, its rank as ASCII digits]
_SMALL = 1 << 16  # messages up to this size are joined into one write


def is_channel(address: str) -> bool:
    return address.startswith(SCHEME)


def channel_path(address: str) -> str:
    return address[len(SCHEME) :]


class ChannelClosed(ConnectionError):
    """The channel was closed locally (teardown)."""


def _header(frames: list[Any]) -> bytes:
    n = len(frames)
    return _COUNT.pack(n) + struct.pack(f"<{n}Q", *(memoryview(f).nbytes for f in frames))


def message_bytes(frames: list[Any]) -> bytes:
    """One message as it travels (a peer written in another language, or a test, sends this)."""
    return _header(frames) + b"".join(frames)


def _write(transport: asyncio.WriteTransport, frames: list[Any]) -> None:
    head = _header(frames)
    if sum(memoryview(f).nbytes for f in frames) <= _SMALL:
        transport.write(head + b"".join(frames))
    else:
        transport.writelines([head, *frames])


class _Conn(asyncio.Protocol):
    """One connection: parses messages as their bytes arrive and hands each to `deliver`."""

    def __init__(self, max_bytes: int, deliver: Any, lost: Any):
        self.max_bytes, self.deliver, self.lost = max_bytes, deliver, lost
        self.transport: asyncio.Transport | None = None
        self.ident = b""  # what its hello announced
        self.buf = bytearray()
        self.lens: tuple[int, ...] | None = None  # the current message's frame lengths (header read)
        self.head = 0  # its header's size
        self.want = _COUNT.size  # bytes the buffer must hold before the next parse

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.lost(self)

    def send(self, frames: list[Any]) -> bool:
        if self.transport is None or self.transport.is_closing():
            return False
        _write(self.transport, frames)
        return True

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _bad(self, why: str) -> None:
        log.warning("channel.peer_dropped", reason=why)
        self.buf.clear()
        self.want = 1 << 62  # parse nothing more from this peer
        self.close()

    def data_received(self, data: bytes) -> None:
        if not self.buf and self.lens is None and self._whole(data):
            return
        self.buf += data
        buf = self.buf
        while len(buf) >= self.want:
            if self.lens is None:
                n = _COUNT.unpack_from(buf)[0]
                if not 0 < n <= MAX_FRAMES:
                    return self._bad(f"{n} frames in a message (1-{MAX_FRAMES})")
                self.head = _COUNT.size + 8 * n
                if len(buf) < self.head:
                    self.want = self.head
                    continue
                lens = struct.unpack_from(f"<{n}Q", buf, _COUNT.size)
                if max(lens) > self.max_bytes:
                    return self._bad(f"a frame of {max(lens)} bytes (limit {self.max_bytes})")
                self.lens, self.want = lens, self.head + sum(lens)
                continue
            with memoryview(buf) as m:
                body = m[self.head : self.want].tobytes()
            del buf[: self.want]
            lens, self.lens, self.want = self.lens, None, _COUNT.size
            self.deliver(self, _split(body, 0, lens))

    def _whole(self, data: bytes) -> bool:
        """The common case, one read holding exactly one message of a few frames: its frames are
        views of `data` (no buffering, no copy). False: anything else (parsed the general way)."""
        if len(data) < _COUNT.size + 8:
            return False
        n = _COUNT.unpack_from(data)[0]
        head = _COUNT.size + 8 * n
        if not 0 < n <= 8 or len(data) < head:
            return False
        lens = struct.unpack_from(f"<{n}Q", data, _COUNT.size)
        if head + sum(lens) != len(data) or max(lens) > self.max_bytes:
            return False
        self.deliver(self, _split(data, head, lens))
        return True


def _split(data: bytes, at: int, lens: tuple[int, ...]) -> list[memoryview]:
    """The frames of a message body as views of `data`, from offset `at`, by their lengths."""
    whole, frames = memoryview(data), []
    for k in lens:
        frames.append(whole[at : at + k])
        at += k
    return frames


class _Inbox:
    """Messages received and not yet taken, and the one task waiting for the next."""

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None
        self.closed = False

    def put(self, item: Any) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> Any:
        while not self.items:
            if self.closed:
                raise ChannelClosed("channel closed")
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()

    async def wait(self, timeout_ms: int) -> bool:
        """Whether a message is waiting, after up to `timeout_ms` for one (zmq's poll)."""
        if not self.items and timeout_ms and not self.closed:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self.waiter), timeout_ms / 1000)
            except asyncio.TimeoutError:
                pass
            finally:
                self.waiter = None
        return bool(self.items)

    def close(self) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def _done() -> asyncio.Future:
    """An awaitable that is already done: sends never wait (unbounded queues, as SNDHWM 0), and a
    caller may await the send or drop it, as with zmq.asyncio."""
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


class ChannelServer:
    """The scheduler's end. Plans: to every connected rank; results (and any rank's other
    replies) from all of them in arrival order. `routed` (the engine socket): messages as
    [identity, frames...] from every client, replies to one client by its identity."""

    def __init__(self, path: str, max_bytes: int, routed: bool = False):
        self.path, self.max_bytes, self.routed = path, max_bytes, routed
        self.peers: set[_Conn] = set()  # connected and announced
        self.by_ident: dict[bytes, _Conn] = {}  # routed: a client's connection by its identity
        self.inbox, self.joins = _Inbox(), _Inbox()
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> ChannelServer:
        if os.path.exists(self.path):  # a predecessor's (a restarted scheduler): ranks reconnect to ours
            os.unlink(self.path)
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(lambda: _Conn(self.max_bytes, self._deliver, self._lost), self.path)
        return self

    def _deliver(self, conn: _Conn, frames: list) -> None:
        if conn in self.peers:
            self.inbox.put([conn.ident, *frames] if self.routed else frames)
        elif len(frames) == 2 and frames[0] == HELLO:
            self.peers.add(conn)
            conn.ident = bytes(frames[1])
            if self.routed:
                self.by_ident[conn.ident] = conn  # (a reconnecting client: its new connection)
            else:
                self.joins.put(conn.ident)
        else:
            conn._bad("no hello")

    def _lost(self, conn: _Conn) -> None:
        self.peers.discard(conn)
        if self.by_ident.get(conn.ident) is conn:
            del self.by_ident[conn.ident]

    async def wait_join(self) -> bytes:
        """The next rank to connect (its announced rank), as XPUB reported a subscription."""
        return await self.joins.get()

    def send_multipart(self, frames: list[Any], copy: bool = False) -> asyncio.Future:
        """A plan to every rank; routed: frames[1:] to the client named by frames[0] (dropped
        when it is not connected, as a ROUTER without ROUTER_MANDATORY does)."""
        if self.routed:
            conn = self.by_ident.get(bytes(frames[0]))
            if conn is not None:
                conn.send(frames[1:])
        else:
            for conn in list(self.peers):
                conn.send(frames)
        return _done()

    async def recv_multipart(self, copy: bool = False) -> list:
        return await self.inbox.get()

    async def poll(self, timeout: int = 0, flags: int = 0) -> bool:
        return await self.inbox.wait(timeout)

    def close(self, linger: int | None = None) -> None:
        self.inbox.close()
        self.joins.close()
        for conn in list(self.peers):
            conn.close()
        if self.server is not None:
            self.server.close()
            self.server = None


class ChannelClient:
    """A peer's end (a rank, or an engine client): messages from the scheduler, its own to it.
    Connects once the scheduler listens and again whenever it is replaced; what it sends while
    no scheduler is connected is dropped (a rank) or queued for the next one (`queue`: a client).
    `ident`: what the hello announces (a rank's number, a client's identity)."""

    RETRY_S = 0.02

    def __init__(self, path: str, ident: int | bytes, max_bytes: int, queue: bool = False):
        self.path, self.max_bytes, self.queue = path, max_bytes, queue
        self.ident = ident if isinstance(ident, bytes) else str(ident).encode()
        self.conn: _Conn | None = None
        self.inbox = _Inbox()
        self.pending: list[list[bytes]] = []  # queue: sent while disconnected, for the next connection
        self.dropped = 0
        self._task: asyncio.Task | None = None
        self._closed = False

    def start(self) -> ChannelClient:
        self._task = asyncio.get_running_loop().create_task(self._connect())
        return self

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                _, conn = await loop.create_unix_connection(
                    lambda: _Conn(self.max_bytes, lambda _c, f: self.inbox.put(f), self._lost), self.path
                )
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(self.RETRY_S)
                continue
            conn.send([HELLO, self.ident])
            for frames in self.pending:
                conn.send(frames)
            self.pending.clear()
            self.conn = conn
            return

    def _lost(self, conn: _Conn) -> None:
        if conn is self.conn:
            self.conn = None
            if not self._closed:
                self._task = asyncio.get_running_loop().create_task(self._connect())

    async def recv_multipart(self, copy: bool = False) -> list:
        return await self.inbox.get()

    def send_multipart(self, frames: list[Any], copy: bool = False) -> asyncio.Future:
        if self.conn is None or not self.conn.send(frames):
            if self.queue and not self._closed:
                self.pending.append([bytes(f) for f in frames])  # (the caller's buffers may change)
            else:
                self.dropped += 1
        return _done()

    async def poll(self, timeout: int = 0, flags: int = 0) -> bool:
        return await self.inbox.wait(timeout)

    def close(self, linger: int | None = None) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        if self.conn is not None:
            self.conn.close()
        self.inbox.close()
