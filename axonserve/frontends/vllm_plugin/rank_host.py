"""The rank host: `python -m axonserve.frontends.vllm_plugin.rank_host CONFIG STATUS LIFELINE_FD`.

A small process that runs a workers-only `Supervisor` (it spawns, watches and stops the worker
ranks) on behalf of vLLM's executor. It detaches from the executor's process tree first (a
double fork: its parent exits at once, so it is re-parented away) because vLLM's API server
SIGKILLs EngineCore's whole process tree on shutdown without a grace period, which would kill
the ranks mid-shutdown. Instead the host holds the read end of a pipe whose write end lives
only in the executor: when the executor shuts down, or its process dies in any way, the pipe
reads EOF and the host stops every rank with a clean `Shutdown`, then exits. Nothing outlives
the executor, and nothing is killed without being asked first.

It reports to the executor on STATUS (PUSH): `Hello` (its pid), `Ready` (rank 0's facts, the
plan/result addresses to bind, the rank pids) and `ActorFailed` (start-up failure or a rank
that died later). It imports no vLLM.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys

import msgspec
import zmq
import zmq.asyncio

from axonserve.actors.runtime import SMALL_MESSAGE_BYTES, attach, bus_socket
from axonserve.actors.supervisor import StartupError, Supervisor
from axonserve.config import EngineConfig
from axonserve.logs import setup_logging
from axonserve.protocol import Codec
from axonserve.protocol.messages import ActorFailed, Hello, Ready

NAME = "rank-host"


async def host(config: EngineConfig, status_address: str, lifeline_fd: int) -> int:
    loop = asyncio.get_running_loop()
    ctx = zmq.asyncio.Context()
    status = bus_socket(ctx, zmq.PUSH, SMALL_MESSAGE_BYTES)
    status.setsockopt(zmq.LINGER, 2000)
    attach(status, status_address)

    async def report(msg) -> None:
        await status.send_multipart(Codec.encode(msg))

    await report(Hello(NAME, os.getpid()))
    sup = Supervisor(config, workers_only=True)
    gone = asyncio.Event()  # the executor closed the lifeline, or this host was asked to stop

    def on_lifeline() -> None:
        if not os.read(lifeline_fd, 4096):  # EOF: the executor shut down or died
            loop.remove_reader(lifeline_fd)
            gone.set()
            sup.request_stop()

    loop.add_reader(lifeline_fd, on_lifeline)
    loop.add_signal_handler(signal.SIGTERM, lambda: (gone.set(), sup.request_stop()))
    try:
        await sup.start()
    except StartupError as e:
        if gone.is_set():  # the executor went away during start-up: nothing to report
            _remove_run_dir(status_address)
            return 0
        await report(ActorFailed(NAME, f"axonserve ranks failed to start: {e}"))
        return 1
    w0 = sup.children["worker-0"]
    info = dict(
        w0.info, plan=sup.addresses.plan, result=sup.addresses.result, pids=[c.proc.pid for c in sup.children.values()]
    )
    await report(Ready(NAME, info))
    watch = asyncio.create_task(_report_failure(sup, report))
    code = await sup.wait()  # a failed rank: grace, then all stop (1); the lifeline closed (0)
    watch.cancel()
    status.close()
    ctx.term()
    if gone.is_set():
        _remove_run_dir(status_address)
    return code


def _remove_run_dir(status_address: str) -> None:
    """The executor's socket directory: an executor that was SIGKILLed cannot remove it."""
    shutil.rmtree(os.path.dirname(status_address.removeprefix("ipc://")), ignore_errors=True)


async def _report_failure(sup: Supervisor, report) -> None:
    """Tell the executor at once (vLLM then fails its requests), not after the grace period."""
    while sup.failure is None:
        await asyncio.sleep(0.1)
    await report(ActorFailed(*sup.failure))


def main() -> None:
    config = msgspec.json.decode(sys.argv[1], type=EngineConfig)
    status_address, lifeline_fd = sys.argv[2], int(sys.argv[3])
    if os.fork() > 0:  # leave the executor's process tree (see the module docstring)
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(config.log_format, config.log_level, actor=NAME)
    try:
        import uvloop

        code = uvloop.run(host(config, status_address, lifeline_fd))
    except KeyboardInterrupt:
        code = 0
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
