"""Encoder router actor: places image-encoding work on the encoder pool and caches features.

One ROUTER socket: the scheduler's DEALER sends `EncodeImages` (every image of a request)
and gets one `ImagesEncoded` back with the features of all of them, in order; each encoder's
DEALER announces itself with `Hello`, then takes jobs. Features are cached by image hash
(LRU, bounded in bytes), so a repeated image is never encoded twice (nor while its first
encoding is under way); only the misses of a request go to an encoder, the one with the
fewest jobs in flight. Frames stay raw bytes: this process never imports torch.

Faults: the supervisor tells the router when an encoder dies (an encoder's death does not
stop the engine); its jobs go to another encoder, or fail with 503 when none is left. A job
older than `encode_timeout_s` fails its request (500). The scheduler never waits forever.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq

from axonserve.actors.runtime import Actor
from axonserve.protocol import Codec, TensorRef
from axonserve.protocol.codec import frame_bytes, ref_frame
from axonserve.protocol.messages import EncodeImages, EncoderStats, Hello, ImagesEncoded

_codec = Codec(EncodeImages | ImagesEncoded | Hello)
SCHEDULER = b"scheduler"


class FeatureCache:
    """Image hash -> (feature bytes, [tokens, hidden], dtype); LRU within a byte budget."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.size = 0
        self.items: OrderedDict[str, tuple[bytes, list[int], str]] = OrderedDict()

    def get(self, h: str) -> tuple[bytes, list[int], str] | None:
        item = self.items.get(h)
        if item is not None:
            self.items.move_to_end(h)
        return item

    def put(self, h: str, item: tuple[bytes, list[int], str]) -> None:
        if h in self.items or len(item[0]) > self.capacity:
            return
        self.items[h] = item
        self.size += len(item[0])
        while self.size > self.capacity:
            _, (old, _, _) = self.items.popitem(last=False)
            self.size -= len(old)


@dataclass
class _Job:
    """Images one encoder computes (the misses of the request that created the job)."""

    request_id: str
    misses: list[str]
    pixels: bytes  # the misses' pixel rows
    pixel_ref: TensorRef  # dtype and shape of `pixels`
    encoder: bytes = b""
    started: float = field(default_factory=time.monotonic)


@dataclass
class _Pending:
    """A request waiting for features: its own job's, or another request's job for the
    same image (an image already being encoded is never encoded twice)."""

    hashes: list[str]  # every image of the request, in order
    waiting: set[str]  # hashes whose features are still being computed
    fresh: dict = field(default_factory=dict)  # hash -> features computed for it
    num_cached: int = 0


class EncoderRouter(Actor):
    kind = "router"

    async def setup(self) -> dict:
        self.sock = self.socket(zmq.ROUTER, self.addresses.router, bind=True)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted encoder (same identity) takes over
        self.encoders: dict[bytes, int] = {}  # live encoder identity -> jobs in flight
        self.dead: set[bytes] = set()
        self.last_used: dict[bytes, int] = {}
        self._dispatches = itertools.count()
        self.expected = {f"encoder-{i}".encode() for i in range(self.config.encoder_workers)}
        self.jobs: dict[str, _Job] = {}  # request id -> its job (waiting or on an encoder)
        self.pending: dict[str, _Pending] = {}  # request id -> features still to come
        self.backlog: list[_Job] = []  # no encoder has announced itself yet
        self.cache = FeatureCache(self.config.encoder_cache_mb * 2**20)
        self._stats = EncoderStats()
        return {"encoders": len(self.expected)}

    async def run(self) -> None:
        expiry = asyncio.create_task(self._expire_loop(), name="expire")
        try:
            async for msg, frames, ident in self.messages(self.sock, _codec, "router", routed=True):
                # each message only from the peer that sends it: jobs from the scheduler, features
                # and hellos from an encoder of this engine; anything else is junk
                sender = ident.decode(errors="replace")
                try:
                    if isinstance(msg, EncodeImages) and ident == SCHEDULER:
                        await self._on_request(msg, frames)
                    elif isinstance(msg, ImagesEncoded) and ident in self.expected:
                        await self._on_encoded(ident, msg, frames)
                    elif isinstance(msg, Hello) and ident in self.expected:
                        await self._on_hello(ident)
                    else:
                        self.dropped("router", f"unexpected {type(msg).__name__}", sender=sender)
                except (ValueError, TypeError, IndexError, KeyError) as e:  # well-formed, impossible values
                    self.dropped("router", f"{type(e).__name__}: {e}", sender=sender)
        finally:
            expiry.cancel()

    # ------------------------------------------------------------------ scheduler side

    async def _on_request(self, msg: EncodeImages, frames: list) -> None:
        buf = ref_frame(msg.pixel_values, frames)
        n = len(msg.hashes)
        if isinstance(buf, str) or not n or msg.pixel_values.shape[:1] != [n]:
            why = buf if isinstance(buf, str) else "one row per image expected"
            await self._reply_error(msg.request_id, f"bad pixel values: {why}", 400)
            return
        self._stats.images += n
        row = len(buf) // n
        encoding = {h for j in self.jobs.values() for h in j.misses}
        pending = _Pending(list(msg.hashes), set())
        misses, rows = [], []
        for i, h in enumerate(msg.hashes):
            if self.cache.get(h) is not None or h in pending.waiting:
                continue
            pending.waiting.add(h)
            if h not in encoding:
                misses.append(h)
                rows.append(bytes(buf[i * row : (i + 1) * row]))
        pending.num_cached = n - len(misses)
        self._stats.cache_hits += pending.num_cached
        self.pending[msg.request_id] = pending
        if misses:
            ref = TensorRef(1, msg.pixel_values.dtype, [len(misses), *msg.pixel_values.shape[1:]])
            job = _Job(msg.request_id, misses, b"".join(rows), ref)
            self.jobs[job.request_id] = job
            await self._dispatch(job)
        elif not pending.waiting:
            await self._reply(msg.request_id)

    async def _reply(self, request_id: str) -> None:
        """All features of a request, in image order, as one [sum of tokens, hidden] frame."""
        p = self.pending.pop(request_id)
        parts, shape, dtype = [], [0, 0], "float32"
        for h in p.hashes:
            item = p.fresh.get(h) or self.cache.get(h)
            if item is None:  # evicted between lookup and reply (a cache far too small)
                await self._reply_error(request_id, "image features were evicted before use", 500)
                return
            data, (tokens, hidden), dtype = item
            parts.append(data)
            shape = [shape[0] + tokens, hidden]
        reply = ImagesEncoded(request_id, embeddings=TensorRef(1, dtype, shape), num_cached=p.num_cached)
        await self.sock.send_multipart([SCHEDULER, *Codec.encode(reply, [b"".join(parts)])], copy=False)
        self._publish()

    async def _job_done(self, job: _Job, features: dict | None, error: str = "", code: int = 500) -> None:
        """Features for the job's images (cached, handed to every request waiting on them),
        or its failure (every request waiting on them fails)."""
        for rid, p in list(self.pending.items()):
            got = p.waiting & set(job.misses)
            if not got:
                continue
            if features is None:
                self.pending.pop(rid)
                await self._reply_error(rid, error, code)
                continue
            p.waiting -= got
            p.fresh.update((h, features[h]) for h in got)
            if not p.waiting:
                await self._reply(rid)

    async def _reply_error(self, request_id: str, error: str, code: int) -> None:
        self.log.warning("encode_failed", request_id=request_id, error=error)
        reply = ImagesEncoded(request_id, error=error, error_code=code)
        await self.sock.send_multipart([SCHEDULER, *Codec.encode(reply)], copy=False)

    def _publish(self) -> None:
        if self._stats.images or self._stats.retries:
            self.publish(self._stats)
            self._stats = EncoderStats()

    # ------------------------------------------------------------------ encoder side

    async def _dispatch(self, job: _Job) -> None:
        if not self.encoders:
            if self.expected - self.dead:  # encoders still starting: they announce themselves soon
                self.backlog.append(job)
                return
            self.jobs.pop(job.request_id, None)
            await self._job_done(job, None, "no image encoder is alive", 503)
            return
        # fewest jobs in flight; ties: the one used longest ago (round robin)
        enc = min(self.encoders, key=lambda e: (self.encoders[e], self.last_used.get(e, -1)))
        self.encoders[enc] += 1
        self.last_used[enc] = next(self._dispatches)
        job.encoder, job.started = enc, time.monotonic()
        msg = EncodeImages(job.request_id, job.misses, job.pixel_ref)
        await self.sock.send_multipart([enc, *Codec.encode(msg, [job.pixels])], copy=False)

    async def _on_hello(self, ident: bytes) -> None:
        if ident in self.dead:
            return
        self.encoders.setdefault(ident, 0)
        self.log.info("encoder_joined", encoder=ident.decode(errors="replace"), live=len(self.encoders))
        backlog, self.backlog = self.backlog, []
        for job in backlog:
            await self._dispatch(job)

    async def _on_encoded(self, ident: bytes, msg: ImagesEncoded, frames: list) -> None:
        job = self.jobs.get(msg.request_id)
        if job is None or job.encoder != ident:  # expired, or re-sent elsewhere meanwhile
            return
        del self.jobs[msg.request_id]
        if ident in self.encoders:
            self.encoders[ident] -= 1
        self._stats.encode_s += time.monotonic() - job.started
        ref = msg.embeddings
        buf = ref_frame(ref, frames) if ref is not None else (msg.error or "no features")
        if isinstance(buf, str) or ref is None or len(ref.shape) != 3 or ref.shape[0] != len(job.misses):
            why = buf if isinstance(buf, str) else "bad feature shape"
            await self._job_done(
                job, None, f"encoder {ident.decode(errors='replace')} failed: {why}", msg.error_code or 500
            )
            return
        data = bytes(frame_bytes(buf))
        row = len(data) // len(job.misses)
        features = {}
        for i, h in enumerate(job.misses):
            features[h] = (data[i * row : (i + 1) * row], list(ref.shape[1:]), ref.dtype)
            self.cache.put(h, features[h])
        await self._job_done(job, features)

    async def on_peer_failed(self, name: str, reason: str) -> None:
        """An encoder died for good: its jobs go to the others (or fail when none is left)."""
        await self._lose(name, reason, for_good=True)

    async def on_peer_restarting(self, name: str, reason: str) -> None:
        """An encoder is being replaced: its jobs go to the others, or wait for it (its Hello)."""
        await self._lose(name, reason, for_good=False)

    async def _lose(self, name: str, reason: str, for_good: bool) -> None:
        ident = name.encode()
        if ident not in self.expected:
            return
        if for_good:
            self.dead.add(ident)
        self.encoders.pop(ident, None)
        orphans = [j for j in self.jobs.values() if j.encoder == ident]
        self.log.warning("encoder_lost", encoder=name, reason=reason, live=len(self.encoders), jobs=len(orphans))
        for job in orphans:
            job.encoder = b""
            self._stats.retries += 1
            await self._dispatch(job)

    async def _expire_loop(self) -> None:
        timeout = self.config.encode_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for job in [j for j in self.jobs.values() if now - j.started > timeout]:
                del self.jobs[job.request_id]
                if job in self.backlog:
                    self.backlog.remove(job)
                if job.encoder in self.encoders:
                    self.encoders[job.encoder] -= 1
                await self._job_done(job, None, f"image encoding took longer than {timeout:.0f}s")
