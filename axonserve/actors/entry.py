"""Child-process entry: `python -m axonserve.actors.entry '<ActorSpec JSON>'`.

Sets up logging and parent-death handling, then runs one actor on uvloop. SIGINT is ignored
(the supervisor owns Ctrl-C and stops children in order); SIGTERM requests a clean stop; if
the supervisor dies, the kernel sends SIGTERM (PR_SET_PDEATHSIG), so no actor is orphaned.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys

import msgspec
import structlog

from axonserve.actors.runtime import Actor
from axonserve.actors.security import BusKeysMissing, check
from axonserve.config import ActorSpec
from axonserve.logs import setup_logging

PR_SET_PDEATHSIG = 1


def quiet_openmp(environ: dict | os._Environ = os.environ) -> None:
    """OpenMP threads sleep when they wait (OMP_WAIT_POLICY=PASSIVE) unless the user chose a
    policy or a spin count. libgomp's default spins: a team whose member lost its core to another
    process (the frontend, the scheduler, a load generator: every core is shared on a small box)
    spins away whole time slices at each of a step's hundreds of parallel regions. A 32-row
    decode step ran 5-8x slower beside one busy process (docs/benchmarks.md#fig-omp-wait). The
    native kernels' loops run on their own pool (ops/csrc/thread_pool.h), which spins briefly
    and does not wait for a member that lost its core; OpenMP is left with oneDNN's and torch's
    ops. Read when libgomp loads, with torch: set before any actor imports it."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    if os.getppid() != parent_pid:  # parent already gone before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def actor_class(kind: str) -> type[Actor]:
    """The class of an actor kind, imported here, in the process that runs it, and nowhere else: a
    worker never imports the HTTP stack, a frontend loads no model code."""
    if kind == "scheduler":
        from axonserve.engine.scheduler_actor import SchedulerActor

        return SchedulerActor
    if kind == "worker":
        from axonserve.neuron.worker import WorkerActor

        return WorkerActor
    if kind == "metrics":
        from axonserve.actors.metrics import MetricsActor

        return MetricsActor
    if kind == "snapshot":
        from axonserve.actors.snapshot import SnapshotSink

        return SnapshotSink
    if kind == "drafter":
        from axonserve.speculative.drafter import DrafterActor

        return DrafterActor
    if kind == "router":
        from axonserve.multimodal.router import EncoderRouter

        return EncoderRouter
    if kind == "encoder":
        from axonserve.multimodal.encoder import EncoderActor

        return EncoderActor
    if kind == "frontend":
        from axonserve.frontends.openai.actor import FrontendActor

        return FrontendActor
    raise ValueError(f"unknown actor kind {kind!r}")


async def _run(spec: ActorSpec) -> int:
    actor = actor_class(spec.kind)(spec)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, actor.stopping.set)
    return await actor.main()


def main() -> None:
    quiet_openmp()
    spec = msgspec.json.decode(sys.argv[1], type=ActorSpec)
    _die_with_parent(int(os.environ.get("AXONSERVE_PARENT_PID", os.getppid())))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(spec.config.log_format, spec.config.log_level, actor=spec.name)
    try:
        check(spec.addresses)  # a tcp bus and no keys: never run unauthenticated
    except BusKeysMissing as e:
        structlog.get_logger().error("bus_keys_missing", error=str(e))
        os._exit(2)
    try:
        import uvloop

        code = uvloop.run(_run(spec))
    except KeyboardInterrupt:
        code = 0
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown (torch threads); sockets are already closed


if __name__ == "__main__":
    main()
