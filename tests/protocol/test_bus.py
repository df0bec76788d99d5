"""The wire: codec round trips with tensor frames, and junk on any socket is dropped, not fatal."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from axonserve.actors.channel import ChannelClient
from axonserve.actors.supervisor import Supervisor
from axonserve.config import EngineConfig
from axonserve.frontends.client import AsyncEngineClient
from axonserve.protocol import ClientToEngine, Codec, DecodeError, tensor_from_frame, tensor_ref
from axonserve.protocol.messages import AddRequest, SamplingParams, StepPlan, StepResult


def test_codec_round_trip_with_tensor_frames():
    class WithTensor(msgspec.Struct, array_like=True):
        name: str
        ref: object

    for t in (
        torch.arange(12, dtype=torch.float32).view(3, 4),
        torch.ones(5, dtype=torch.bfloat16),
        torch.zeros(0, 2, dtype=torch.int64),
    ):
        frames = Codec.encode(StepResult(step_id=1), [t])
        assert len(frames) == 2
        back = tensor_from_frame(tensor_ref(1, t), [b"", bytes(frames[1])])
        assert back.dtype == t.dtype and torch.equal(back, t)


def test_codec_rejects_malformed():
    codec = Codec(ClientToEngine)
    for junk in (
        [],
        [b""],
        [b"\xff\x00garbage"],
        Codec.encode(StepPlan(step_id=3)),
        [msgspec.msgpack.encode([1, "id", "not-a-list"])],
    ):
        with pytest.raises(DecodeError):
            codec.decode(junk)
    msg, extra = codec.decode(Codec.encode(AddRequest("r", [1, 2], SamplingParams())))
    assert isinstance(msg, AddRequest) and extra == []


@pytest.mark.timeout(120)
async def test_junk_on_engine_and_control_sockets_is_dropped(tiny_llama_dir):
    sup = Supervisor(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, log_level="warning"), frontend=False)
    await sup.start()
    ctx = zmq.asyncio.Context()
    try:
        assert sup.addresses.engine.startswith("unix://")  # the engine socket: a routed channel
        engine_path = sup.addresses.engine.removeprefix("unix://")
        junk_engine = ChannelClient(engine_path, b"c-junk", 1 << 20, queue=True).start()
        junk_control = ctx.socket(zmq.DEALER)
        junk_control.setsockopt(zmq.IDENTITY, b"scheduler")  # even impersonating an actor
        junk_control.connect(sup.addresses.control)
        for frames in (
            [b"\x00"],
            [b"\xc1"],
            [b"hello", b"world"],
            Codec.encode(StepPlan(step_id=99)),
            [msgspec.msgpack.encode([1, "x", [1], "bad-params"])],
        ):
            await junk_engine.send_multipart(frames)
            await junk_control.send_multipart(frames)
        await asyncio.sleep(0.5)
        assert junk_engine.conn is not None and not junk_engine.pending  # (connected: all sent)
        junk_engine.close()
        assert all(c.proc.poll() is None for c in sup.children.values())
        client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=30)
        try:
            toks = []
            async for out in client.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4)):
                toks += out.token_ids
            assert len(toks) == 4
        finally:
            client.close()
    finally:
        ctx.destroy(linger=0)
        await sup.stop("test done")
