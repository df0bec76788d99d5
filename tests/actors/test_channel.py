"""The plan/result channel (actors/channel.py) on real Unix sockets: framing however the bytes
arrive, broadcast, the hello, reconnecting to a replaced server, and the bounds that drop a peer.
The engine's own use of it runs in every integration test (tests/actors/test_bus_hardening.py
sends it junk on a live server)."""

from __future__ import annotations

import asyncio
import os
import socket
import struct

import pytest

from axonserve.actors.channel import (
    HELLO,
    MAX_FRAMES,
    ChannelClient,
    ChannelClosed,
    ChannelServer,
    message_bytes,
)

LIMIT = 1 << 22
WAIT = 10.0


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "plan")


async def _server(path: str) -> ChannelServer:
    return await ChannelServer(path, LIMIT).start()


async def _raw(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_unix_connection(path), WAIT)


async def test_broadcast_and_replies_keep_their_frames(path):
    server = await _server(path)
    clients = [ChannelClient(path, r, LIMIT).start() for r in range(2)]
    try:
        joined = sorted([await asyncio.wait_for(server.wait_join(), WAIT) for _ in clients])
        assert joined == [b"0", b"1"]
        big = os.urandom(3 << 20)  # over the one-write size: sent as a vector
        plan = [b"plan", b"", big]
        await server.send_multipart(plan)
        for c in clients:
            got = await asyncio.wait_for(c.recv_multipart(), WAIT)
            assert [bytes(f) for f in got] == plan
        await clients[0].send_multipart([b"result", memoryview(b"tensor")])
        got = await asyncio.wait_for(server.recv_multipart(), WAIT)
        assert [bytes(f) for f in got] == [b"result", b"tensor"]
        assert not await server.poll(0)
    finally:
        for c in clients:
            c.close()
        server.close()


async def test_messages_split_and_coalesced_across_reads(path):
    server = await _server(path)
    _, w = await _raw(path)
    try:
        msgs = [[b"a" * 5], [b"", b"bc"], [os.urandom(70_000), b"d"]]
        wire = message_bytes([HELLO, b"0"]) + b"".join(message_bytes(m) for m in msgs)
        w.write(wire[:3])  # a header in pieces
        await w.drain()
        await asyncio.sleep(0.05)
        for i in range(3, len(wire), 9_999):
            w.write(wire[i : i + 9_999])
        await w.drain()
        assert await asyncio.wait_for(server.wait_join(), WAIT) == b"0"
        for m in msgs:
            got = await asyncio.wait_for(server.recv_multipart(), WAIT)
            assert [bytes(f) for f in got] == m
        w.write(message_bytes([b"x"]) + message_bytes([b"y"]))  # two messages in one write
        await w.drain()
        assert [bytes(f) for f in await asyncio.wait_for(server.recv_multipart(), WAIT)] == [b"x"]
        assert [bytes(f) for f in await asyncio.wait_for(server.recv_multipart(), WAIT)] == [b"y"]
    finally:
        w.close()
        server.close()


@pytest.mark.parametrize(
    "hello,bad",
    [
        (False, message_bytes([b"not a hello"])),
        (True, struct.pack("<IQ", 1, LIMIT + 1)),
        (True, struct.pack("<I", MAX_FRAMES + 1)),
        (True, struct.pack("<I", 0)),
    ],
    ids=["no-hello", "frame-over-limit", "too-many-frames", "no-frames"],
)
async def test_a_peer_breaking_a_bound_is_dropped(path, hello, bad):
    server = await _server(path)
    good = ChannelClient(path, 0, LIMIT).start()
    r, w = await _raw(path)
    try:
        await asyncio.wait_for(server.wait_join(), WAIT)
        w.write((message_bytes([HELLO, b"1"]) if hello else b"") + bad)
        await w.drain()
        assert await asyncio.wait_for(r.read(1), WAIT) == b""  # disconnected
        await server.send_multipart([b"still serving"])
        assert [bytes(f) for f in await asyncio.wait_for(good.recv_multipart(), WAIT)] == [b"still serving"]
        assert not await server.poll(0)
    finally:
        w.close()
        good.close()
        server.close()


async def test_a_rank_reconnects_to_a_replaced_server(path):
    server = await _server(path)
    client = ChannelClient(path, 0, LIMIT).start()
    try:
        assert await asyncio.wait_for(server.wait_join(), WAIT) == b"0"
        server.close()  # the scheduler died: its replacement binds the same path
        deadline = asyncio.get_running_loop().time() + WAIT
        while client.conn is not None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        await client.send_multipart([b"to nobody"])  # dropped, counted
        assert client.dropped == 1
        server = await _server(path)
        assert await asyncio.wait_for(server.wait_join(), WAIT) == b"0"
        await server.send_multipart([b"plan"])
        assert [bytes(f) for f in await asyncio.wait_for(client.recv_multipart(), WAIT)] == [b"plan"]
        await client.send_multipart([b"result"])
        assert [bytes(f) for f in await asyncio.wait_for(server.recv_multipart(), WAIT)] == [b"result"]
    finally:
        client.close()
        server.close()


async def test_closing_ends_a_waiting_receive(path):
    server = await _server(path)
    waiting = asyncio.ensure_future(server.recv_multipart())
    await asyncio.sleep(0.01)
    server.close()
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(waiting, WAIT)
    with socket.socket(socket.AF_UNIX) as s:  # nobody listens any more
        assert s.connect_ex(path) != 0


async def test_routed_replies_reach_one_client_and_a_client_queues_until_connected(path):
    early = ChannelClient(path, b"c-early", LIMIT, queue=True).start()  # before the server listens
    await early.send_multipart([b"sent while nobody listened"])
    await asyncio.sleep(0.05)
    server = await ChannelServer(path, LIMIT, routed=True).start()
    late = ChannelClient(path, b"c-late", LIMIT, queue=True).start()
    try:
        got = await asyncio.wait_for(server.recv_multipart(), WAIT)
        assert [bytes(f) for f in got] == [b"c-early", b"sent while nobody listened"]
        await late.send_multipart([b"hi"])
        got = await asyncio.wait_for(server.recv_multipart(), WAIT)
        assert [bytes(f) for f in got] == [b"c-late", b"hi"]
        await server.send_multipart([b"c-late", b"for late"])
        await server.send_multipart([b"c-nobody", b"dropped"])  # no such client: dropped
        await server.send_multipart([b"c-early", b"for early"])
        assert [bytes(f) for f in await asyncio.wait_for(late.recv_multipart(), WAIT)] == [b"for late"]
        assert [bytes(f) for f in await asyncio.wait_for(early.recv_multipart(), WAIT)] == [b"for early"]
        assert not await late.poll(50) and not await early.poll(0)
        await server.send_multipart([b"c-late", b"polled"])
        assert await late.poll(int(WAIT * 1000))
    finally:
        early.close()
        late.close()
        server.close()
