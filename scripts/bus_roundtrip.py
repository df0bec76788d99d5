"""Round trip of one small message between two processes, as the step's plan and result make it:
ZeroMQ ipc (PUSH/PULL on zmq.asyncio under uvloop, as the actors ran them), the plan channel
(actors/channel.py) and a pipe pair (the floor: two wake-ups, no event loop). Rounds interleaved;
median [min, max] of µs per round trip and of this side's CPU µs per round trip.

    PYTHONPATH=. python scripts/bus_roundtrip.py --rounds 5 --messages 3000 --bytes 600
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import uvloop
import zmq
import zmq.asyncio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from axonserve.actors.channel import ChannelClient, ChannelServer  # noqa: E402


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _zmq_echo(a_in: str, a_out: str, n: int) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.connect(a_in)
        push.connect(a_out)
        for _ in range(n):
            await push.send_multipart(await pull.recv_multipart(copy=False), copy=False)
        await asyncio.sleep(0.2)
        ctx.destroy(linger=0)

    uvloop.run(main())


def _channel_echo(path: str, n: int) -> None:
    async def main() -> None:
        c = ChannelClient(path, 0, 1 << 30).start()
        for _ in range(n):
            await c.send_multipart(await c.recv_multipart())
        await asyncio.sleep(0.2)
        c.close()

    uvloop.run(main())


def _pipe_echo(r: int, w: int, n: int) -> None:
    for _ in range(n):
        os.write(w, os.read(r, 1 << 16))


def run_zmq(d: str, n: int, msg: bytes) -> tuple[float, float]:
    a_in, a_out = f"ipc://{d}/zin", f"ipc://{d}/zout"
    p = mp.get_context("spawn").Process(target=_zmq_echo, args=(a_in, a_out, n + 1))
    p.start()

    async def main() -> tuple[float, float]:
        ctx = zmq.asyncio.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind(a_in)
        pull.bind(a_out)
        await push.send_multipart([msg])
        await pull.recv_multipart()
        t0, c0 = time.perf_counter(), _cpu()
        for _ in range(n):
            await push.send_multipart([msg], copy=False)
            await pull.recv_multipart(copy=False)
        out = (time.perf_counter() - t0) / n, (_cpu() - c0) / n
        ctx.destroy(linger=0)
        return out

    out = uvloop.run(main())
    p.join(30)
    return out


def run_channel(d: str, n: int, msg: bytes) -> tuple[float, float]:
    path = f"{d}/chan"

    async def main() -> tuple[float, float]:
        server = await ChannelServer(path, 1 << 30).start()
        p = mp.get_context("spawn").Process(target=_channel_echo, args=(path, n + 1))
        p.start()
        await asyncio.wait_for(server.wait_join(), 60)
        await server.send_multipart([msg])
        await server.recv_multipart()
        t0, c0 = time.perf_counter(), _cpu()
        for _ in range(n):
            await server.send_multipart([msg])
            await server.recv_multipart()
        out = (time.perf_counter() - t0) / n, (_cpu() - c0) / n
        await asyncio.to_thread(p.join, 30)
        server.close()
        return out

    return uvloop.run(main())


def run_pipe(n: int, msg: bytes) -> tuple[float, float]:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    p = mp.get_context("fork").Process(target=_pipe_echo, args=(r1, w2, n + 1))
    p.start()
    os.write(w1, msg)
    os.read(r2, 1 << 16)
    t0, c0 = time.perf_counter(), _cpu()
    for _ in range(n):
        os.write(w1, msg)
        os.read(r2, 1 << 16)
    out = (time.perf_counter() - t0) / n, (_cpu() - c0) / n
    p.join(30)
    for fd in (r1, w1, r2, w2):
        os.close(fd)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--bytes", type=int, default=600, help="message size (a 32-request decode plan is ~600 B)")
    a = ap.parse_args()
    msg = os.urandom(a.bytes)
    got: dict[str, list[tuple[float, float]]] = {"zmq ipc (zmq.asyncio)": [], "plan channel": [], "pipe pair": []}
    with tempfile.TemporaryDirectory(prefix="axb-rt-") as d:
        for _ in range(a.rounds):
            got["zmq ipc (zmq.asyncio)"].append(run_zmq(d, a.messages, msg))
            got["plan channel"].append(run_channel(d, a.messages, msg))
            got["pipe pair"].append(run_pipe(a.messages, msg))
    print(f"{a.rounds} rounds x {a.messages} messages of {a.bytes} B")
    print("| transport | round trip µs | this side's CPU µs |")
    print("|---|---|---|")
    for name, rows in got.items():
        rt = [r[0] * 1e6 for r in rows]
        cpu = [r[1] * 1e6 for r in rows]
        print(
            f"| {name} | {statistics.median(rt):.0f} [{min(rt):.0f}, {max(rt):.0f}] "
            f"| {statistics.median(cpu):.0f} [{min(cpu):.0f}, {max(cpu):.0f}] |"
        )


if __name__ == "__main__":
    main()
