"""Prefill/decode disaggregation, scheduler side.

A decode engine (`role="decode"`) hands every new generate request to a prefill engine (a
scheduler with its own worker pool, `role="prefill"`) as a one-token `kv_export` request.
The prefill worker computes the prompt, samples the first token and sends the prompt's KV
with it, block by block as extra frames, through its scheduler to the decode scheduler
(`RequestDelta.kv`). The decode scheduler streams the first token to the client at once,
then queues the request with that KV attached: its worker imports the blocks and decoding
continues there (engine/scheduler.py `_admit_head`, neuron/kv_transfer.py).

Limits (checked, a 400): structured outputs (the grammar state would have to move too).
Seeded sampling stays seeded but the decode worker's generator starts fresh after token 1.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

from axonserve.engine.request import Request
from axonserve.engine.stage import Core
from axonserve.protocol import Codec, DecodeError, EngineToClient, TensorRef
from axonserve.protocol.codec import ref_frame
from axonserve.protocol.messages import (
    AbortRequest,
    AddRequest,
    EngineDead,
    KVBlocks,
    Outputs,
    RequestDelta,
    StepResult,
)

_codec = Codec(EngineToClient)


class PrefillStage:
    """The decode scheduler's client of the prefill engine: a stage of the engine core."""

    def __init__(self, core: Core, actor, address: str):  # noqa: ANN001 - the scheduler actor makes the socket
        self.core = core
        self.sock = actor.socket(zmq.DEALER, address, identity=f"{actor.name}-decode".encode())
        self.messages = actor.messages
        self.waiting: dict[str, Request] = {}  # request id -> request being prefilled
        self.dead: str | None = None

    def takes(self, req: Request) -> bool:
        """A new generate request is prefilled there (one back from there carries its KV)."""
        return req.kv is None and req.pooling is None

    @staticmethod
    def check(req: Request) -> str | None:
        if req.params.structured_outputs is not None:
            return "structured outputs are not supported with disaggregated prefill (--role decode)"
        return None

    async def send(self, req: Request) -> None:
        """Prefill there: one token, the prompt's KV back with it (images travel along)."""
        params = msgspec.structs.replace(req.params, max_tokens=1, min_tokens=0)
        mm, frames = req.mm, []
        if mm is not None:
            refs = {}
            for name, buf in req.mm_frames.items():
                frames.append(buf)
                ref = getattr(mm, name)
                refs[name] = TensorRef(len(frames), ref.dtype, ref.shape)
            mm = msgspec.structs.replace(mm, **refs)
        self.waiting[req.request_id] = req
        msg = AddRequest(req.request_id, req.token_ids, params, priority=req.priority, mm=mm, kv_export=True)
        await self.sock.send_multipart(Codec.encode(msg, frames), copy=False)

    async def abort(self, request_ids: list[str]) -> list[Request]:
        """Stop prefilling these; returns those that were there."""
        gone = [r for r in (self.waiting.pop(rid, None) for rid in request_ids) if r is not None]
        if gone:
            await self.sock.send_multipart(Codec.encode(AbortRequest([r.request_id for r in gone])), copy=False)
        return gone

    def take_all(self) -> list[Request]:
        reqs = list(self.waiting.values())
        self.waiting.clear()
        return reqs

    async def run(self) -> None:
        """The prefill engine's answers: first tokens (with KV) and failures."""
        async for msg, frames in self.messages(self.sock, _codec, "prefill engine"):
            if isinstance(msg, EngineDead):
                self.dead = f"prefill engine died: {msg.reason}"
                for req in self.take_all():
                    await self._fail(req, self.dead, 503)
            elif isinstance(msg, Outputs):
                for d in msg.deltas:
                    req = self.waiting.pop(d.request_id, None)
                    if req is not None:
                        await self._prefilled(req, d, frames)

    async def _prefilled(self, req: Request, d: RequestDelta, frames: list) -> None:
        if not d.new_token_ids or d.kv is None:
            why = d.error or f"prefill ended without a token ({d.finish_reason})"
            await self._fail(req, f"prefill failed: {why}", d.error_code or 500)
            return
        bufs = [ref_frame(ref, frames) for ref in d.kv.blocks]
        bad = next((b for b in bufs if isinstance(b, str)), None)
        if bad is not None:
            await self._fail(req, f"prefill sent bad KV: {bad}", 500)
            return
        await self._first_token(req, d, KVBlocks(d.kv.num_tokens, d.kv.blocks), bufs)

    async def _first_token(self, req: Request, d: RequestDelta, kv: KVBlocks, bufs: list) -> None:
        """The prefill engine's first token goes out now; the request then decodes here on the
        prompt's imported KV (its images are no longer needed: never recomputed)."""
        sched, now = self.core.sched, time.monotonic()
        _, done = req.append_tokens(d.new_token_ids[:1], sched.cfg.eos_token_ids)
        req.t_first = req.t_last = now
        req.num_cached_tokens = d.num_cached_tokens  # the prefill engine's prefix-cache hit
        sched.ttft.append(now - req.t_arrival)
        sched.generation_tokens += 1
        delta = RequestDelta(
            req.request_id,
            d.new_token_ids[:1],
            logprobs=d.logprobs,
            prompt_logprobs=d.prompt_logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )
        if done:
            delta.finish_reason, delta.stop_reason = req.finish_reason, req.stop_reason
        await self.core.emit([delta])  # before any later token of it can leave
        if not done:
            req.kv, req.kv_frames = kv, {"blocks": bufs}
            req.mm, req.mm_frames = None, {}
            await self.core.enqueue(req)

    async def _fail(self, req: Request, why: str, code: int) -> None:
        await self.core.emit([RequestDelta(req.request_id, finish_reason="error", error=why, error_code=code)])


def exported_kv(result: StepResult, frames: list) -> dict[str, tuple[KVBlocks, list[memoryview]]]:
    """Prefill engine: the KV its worker exported this step, by request id (raw block frames)."""
    out = {}
    for kv in result.kv_exports:
        bufs = [ref_frame(ref, frames) for ref in kv.blocks]
        bad = next((b for b in bufs if isinstance(b, str)), None)
        if bad is not None:
            raise DecodeError(f"exported KV of {kv.request_id}: {bad}")
        out[kv.request_id] = (kv, bufs)
    return out


def attach_kv(delta: RequestDelta, kv: tuple[KVBlocks, list[Any]], frames: list[Any]) -> None:
    """Put a request's exported KV on its delta: its block frames join the message's frames."""
    blocks, bufs = kv
    refs = []
    for ref, buf in zip(blocks.blocks, bufs):
        frames.append(buf)
        refs.append(TensorRef(len(frames), ref.dtype, ref.shape))
    delta.kv = KVBlocks(blocks.num_tokens, refs)
