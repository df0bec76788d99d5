"""The scheduler's encoder-pool stage: image requests wait here for their features.

With `--encoder-workers N` the scheduler hands an image request's pixels to the encoder router
(multimodal/router.py) instead of queueing it; the router answers with the features (or an
error), and the request then joins the waiting queue carrying the features instead of pixels.
Without a pool the worker ranks encode images themselves (multimodal/worker.py).
"""

from __future__ import annotations

import msgspec
import zmq

from axonserve.engine.request import Request
from axonserve.engine.stage import Core
from axonserve.protocol import Codec, TensorRef
from axonserve.protocol.codec import ref_frame
from axonserve.protocol.messages import EncodeImages, ImagesEncoded, RequestDelta

_codec = Codec(ImagesEncoded)


class EncoderStage:
    def __init__(self, core: Core, actor, address: str):  # noqa: ANN001 - the scheduler actor makes the socket
        self.core = core
        self.sock = actor.socket(zmq.DEALER, address, identity=b"scheduler")
        self.messages = actor.messages
        self.encoding: dict[str, Request] = {}  # request id -> request waiting for its features
        self.cache_hits = 0  # images the router's cache already held

    def takes(self, req: Request) -> bool:
        return req.mm is not None and req.mm.pixel_values is not None

    async def encode(self, req: Request) -> None:
        """Send the request's pixels to the router; it waits here until its features come."""
        assert req.mm is not None and req.mm.pixel_values is not None
        self.encoding[req.request_id] = req
        await self._send(req)

    async def _send(self, req: Request) -> None:
        """The pixels stay with the request until its features come: a restarted router gets them again."""
        assert req.mm is not None and req.mm.pixel_values is not None
        ref = TensorRef(1, req.mm.pixel_values.dtype, req.mm.pixel_values.shape)
        await self.sock.send_multipart(
            Codec.encode(EncodeImages(req.request_id, req.mm.hashes, ref), [req.mm_frames["pixel_values"]]),
            copy=False,
        )

    async def resubmit(self) -> None:
        """The router was replaced: the jobs it held are gone; send every waiting request again."""
        for req in list(self.encoding.values()):
            await self._send(req)

    def abort(self, request_ids: list[str]) -> list[Request]:
        return [r for rid in request_ids if (r := self.encoding.pop(rid, None)) is not None]

    def take_all(self) -> list[Request]:
        reqs = list(self.encoding.values())
        self.encoding.clear()
        return reqs

    async def run(self) -> None:
        """The router's answers: features join their request, which is then queued."""
        async for msg, frames in self.messages(self.sock, _codec, "encoder router"):
            req = self.encoding.pop(msg.request_id, None)
            if req is None:  # aborted (or failed) while encoding
                continue
            self.cache_hits += msg.num_cached
            buf = ref_frame(msg.embeddings, frames) if msg.embeddings is not None else msg.error or "no features"
            if isinstance(buf, str):
                await self.core.emit(
                    [
                        RequestDelta(
                            req.request_id,
                            finish_reason="error",
                            error=f"image encoding failed: {buf}",
                            error_code=msg.error_code or 500,
                        )
                    ]
                )
                continue
            assert req.mm is not None and msg.embeddings is not None
            req.mm = msgspec.structs.replace(req.mm, pixel_values=None, embeddings=msg.embeddings)
            req.mm_frames = {"embeddings": buf}
            await self.core.enqueue(req)
