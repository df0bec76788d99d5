"""Every actor beats from a thread of its own: an actor whose event loop is blocked (busy, not dead)
keeps sending heartbeats to the supervisor's control socket, and the stall is logged (once, then its
end), not reported as a failure. A real actor and a real ROUTER socket; the block is time.sleep on
the loop, which is what request-sized CPU work on a loop looks like."""

from __future__ import annotations

import time

import pytest
import structlog
import zmq
import zmq.asyncio

from axonserve.actors.runtime import HEARTBEAT_SUFFIX, Actor, supervisor_name
from axonserve.config import ActorSpec, Addresses, EngineConfig
from axonserve.protocol import Codec, Control
from axonserve.protocol.messages import Heartbeat, Ready

BLOCK_S = 1.5


class BlockingActor(Actor):
    kind = "blocking"

    async def run(self) -> None:
        self.blocked = (time.time(), time.time() + BLOCK_S)
        time.sleep(BLOCK_S)  # no await: the loop does nothing else meanwhile
        self.stopping.set()


@pytest.mark.timeout(30)
async def test_a_blocked_loop_still_beats_and_is_logged_as_stalled(tmp_path):
    config = EngineConfig(model="", heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5)
    addresses = Addresses.in_dir(str(tmp_path))
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(addresses.control)
    try:
        with structlog.testing.capture_logs() as logs:
            actor = BlockingActor(ActorSpec(kind="blocking", name="blocking", config=config, addresses=addresses))
            assert await actor.main() == 0
        codec = Codec(Control)
        beats: list[float] = []
        ready = False
        while await router.poll(100):
            frames = await router.recv_multipart()
            msg, _ = codec.decode(frames[1:])
            assert supervisor_name(frames[0]) == "blocking"
            ready |= isinstance(msg, Ready)
            if isinstance(msg, Heartbeat):
                assert frames[0] == b"blocking" + HEARTBEAT_SUFFIX.encode()
                beats.append(msg.t)
    finally:
        router.close(linger=0)
        ctx.term()
    assert ready
    start, end = actor.blocked
    during = [t for t in beats if start + 0.1 < t < end - 0.1]
    assert len(during) >= 0.5 * BLOCK_S / config.heartbeat_interval_s, (len(during), len(beats))
    events = [e["event"] for e in logs]
    assert events.count("event_loop_stalled") == 1, events
    assert "actor_failed" not in events and "actor_crashed" not in events
