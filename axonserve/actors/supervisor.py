"""Supervisor: starts every actor process, knows who is alive, stops them all.

Start-up: spawn workers, scheduler (and frontend) at once -> each says Hello, loads, says
Ready -> once every worker is Ready the scheduler is sent `Configure` (KV block count and
limits the workers measured) -> all Ready: serving. A process that exits, misses heartbeats
or reports a failure marks the whole engine failed: every survivor is told (in-flight
requests end with errors, /health turns 503), then after a short grace everything stops
and the supervisor's exit code is non-zero. Children die with the supervisor (PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import msgspec
import structlog
import zmq
import zmq.asyncio

from axonserve.actors.runtime import SMALL_MESSAGE_BYTES, bus_socket, supervisor_name
from axonserve.config import ActorSpec, Addresses, EngineConfig
from axonserve.protocol import Codec, Control, DecodeError
from axonserve.protocol.messages import (
    ActorFailed,
    Configure,
    Heartbeat,
    Hello,
    Ready,
    Shutdown,
)

log = structlog.get_logger()
_codec = Codec(Control)
IMAGE_INFO = ("image_token_id", "image_tokens", "image_size", "hidden_size")
RUN_DIR_ENV = "AXONSERVE_RUN_DIR"  # where the run directory (the ipc:// bus sockets) is made; default: $TMPDIR
SECRET_ENV = ("AXONSERVE_API_KEY", "VLLM_API_KEY")  # only the frontend, which checks it, inherits these


class StartupError(RuntimeError):
    pass


class StartupCancelled(StartupError):
    """A stop was requested (SIGTERM/SIGINT) before every actor was ready: a clean stop."""


@dataclass
class _Child:
    spec: ActorSpec
    proc: subprocess.Popen
    ready: bool = False
    info: dict = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Supervisor:
    def __init__(self, config: EngineConfig, *, frontend: bool = True, workers_only: bool = False):
        """workers_only: start just the worker ranks (no scheduler, metrics actor or frontend);
        a foreign driver, e.g. vLLM's executor, binds their plan and result sockets."""
        self.config = config
        self.with_frontend = frontend and not workers_only
        self.workers_only = workers_only
        # 0700 (mkdtemp): other local users cannot reach the ipc:// sockets inside
        self.run_dir = tempfile.mkdtemp(prefix="axonserve-", dir=os.environ.get(RUN_DIR_ENV) or None)
        dist_port = 0
        while config.num_workers > 1 and dist_port in (0, config.port):  # not the HTTP port
            dist_port = free_port()
        self.addresses = Addresses.in_dir(self.run_dir, dist_port)
        if workers_only:  # nobody binds these: stats and snapshots stay off
            self.addresses.stats = self.addresses.metrics = self.addresses.snapshot = ""
        self.children: dict[str, _Child] = {}
        self.failure: tuple[str, str] | None = None
        self._failed = asyncio.Event()
        self.stop_requested = False
        self._all_ready = asyncio.Event()
        self._configured: set[str] = set()  # schedulers sent their Configure
        self._stopped = False
        self._tasks: list[asyncio.Task] = []
        self._junk = 0  # undecodable control messages dropped

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Spawn every actor and wait until all are Ready; StartupError otherwise."""
        t0 = time.monotonic()
        if self.config.role == "decode" and (self.config.num_workers > 1 or self.config.bucketing):
            raise StartupError(
                "--role decode needs one worker rank per pool and no bucketing: moving "
                "tensor-parallel shards or bucketed steps' KV is not implemented"
            )
        self.ctx = zmq.asyncio.Context()
        self.control = bus_socket(self.ctx, zmq.ROUTER, SMALL_MESSAGE_BYTES)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.control.bind(self.addresses.control)
        specs = [
            ActorSpec(kind="worker", name=f"worker-{r}", config=self.config, addresses=self.addresses, rank=r)
            for r in range(self.config.num_workers)
        ]
        if not self.workers_only:
            specs.append(ActorSpec(kind="scheduler", name="scheduler", config=self.config, addresses=self.addresses))
            specs.append(ActorSpec(kind="metrics", name="metrics", config=self.config, addresses=self.addresses))
        spec_cfg = self.config.speculative
        if spec_cfg is not None and spec_cfg.uses_drafter and not self.workers_only:
            specs.append(ActorSpec(kind="drafter", name="drafter", config=self.config, addresses=self.addresses))
        if self.config.role == "decode" and not self.workers_only:
            specs += self._prefill_pool()
        if self.config.encoder_workers and not self.workers_only:  # multimodal: the encoder pool
            specs.append(ActorSpec(kind="router", name="router", config=self.config, addresses=self.addresses))
            specs += [
                ActorSpec(kind="encoder", name=f"encoder-{i}", config=self.config, addresses=self.addresses)
                for i in range(self.config.encoder_workers)
            ]
        if self.config.snapshot:  # tensor snapshots: the sink that writes them to disk
            specs.append(ActorSpec(kind="snapshot", name="snapshot", config=self.config, addresses=self.addresses))
        if self.with_frontend:
            specs.append(ActorSpec(kind="frontend", name="frontend", config=self.config, addresses=self.addresses))
        for spec in specs:
            self.children[spec.name] = _Child(spec, self._spawn(spec))
        self._tasks = [
            asyncio.create_task(self._control_loop(), name="supervisor-control"),
            asyncio.create_task(self._watch_loop(), name="supervisor-watch"),
        ]
        ready = asyncio.ensure_future(self._all_ready.wait())
        failed = asyncio.ensure_future(self._failed.wait())
        done, _ = await asyncio.wait(
            {ready, failed},
            timeout=self.config.ready_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        ready.cancel()
        failed.cancel()
        if not self._all_ready.is_set() and self.stop_requested and self.failure is None:
            await self.stop("stop requested")
            raise StartupCancelled("stop requested during startup")
        if not self._all_ready.is_set():
            why = self.failure[1] if self.failure else "timed out waiting for actors to be ready"
            who = self.failure[0] if self.failure else ",".join(n for n, c in self.children.items() if not c.ready)
            await self.stop("startup failed")
            raise StartupError(f"{who}: {why}")
        log.info(
            "engine_ready", seconds=round(time.monotonic() - t0, 2), actors=len(self.children), **self.engine_facts()
        )

    def _prefill_pool(self) -> list[ActorSpec]:
        """P/D: a second engine (scheduler + worker ranks) that only prefills, on its own
        sockets; the decode scheduler is its client."""
        d = self.run_dir
        cfg = msgspec.structs.replace(self.config, role="prefill", encoder_workers=0)
        port = 0
        while cfg.num_workers > 1 and port in (0, cfg.port):
            port = free_port()
        addrs = msgspec.structs.replace(
            self.addresses,
            engine=f"ipc://{d}/prefill-engine",
            plan=f"ipc://{d}/prefill-plan",
            result=f"ipc://{d}/prefill-result",
            dist_init=f"tcp://127.0.0.1:{port}" if port else "",
            snapshot="",
            router="",
            prefill="",
        )
        self.addresses.prefill = addrs.engine
        return [
            ActorSpec(kind="worker", name=f"prefill-worker-{r}", config=cfg, addresses=addrs, rank=r)
            for r in range(cfg.num_workers)
        ] + [ActorSpec(kind="scheduler", name="prefill-scheduler", config=cfg, addresses=addrs)]

    def engine_facts(self) -> dict:
        s = self.children.get("scheduler")
        return dict(s.info) if s else {}

    def _spawn(self, spec: ActorSpec) -> subprocess.Popen:
        """The spec (config and addresses, never a secret: the API key is not in EngineConfig)
        goes on argv; the environment is inherited, the API key by the frontend only."""
        env = dict(os.environ, AXONSERVE_PARENT_PID=str(os.getpid()))
        if spec.kind != "frontend":
            for name in SECRET_ENV:
                env.pop(name, None)
        cmd = [sys.executable, "-m", "axonserve.actors.entry", msgspec.json.encode(spec).decode()]
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)

    # ------------------------------------------------------------------ monitor

    async def wait(self) -> int:
        """Serve until stopped (0) or until an actor fails (1, after the grace period)."""
        await self._failed.wait()
        if self.failure is None:
            await self.stop("stop requested")
            return 0
        await asyncio.sleep(self.config.failure_grace_s)
        await self.stop("actor failure")
        return 1

    async def _control_loop(self) -> None:
        while True:
            frames = await self.control.recv_multipart()
            name = supervisor_name(frames[0])
            try:
                msg, _ = _codec.decode(frames[1:])
            except DecodeError as e:
                self._junk += 1
                if self._junk <= 10 or self._junk % 100 == 0:  # a flood of junk must not flood the log
                    log.warning("bad_control_message", sender=name, error=str(e)[:300], dropped=self._junk)
                continue
            child = self.children.get(name)
            if child is None:
                log.warning("unknown_actor", sender=name)
                continue
            child.last_seen = time.monotonic()
            if isinstance(msg, Ready):
                child.ready, child.info = True, dict(msg.info)
                await self._on_ready()
            elif isinstance(msg, ActorFailed):
                await self._on_failure(msg.name, msg.reason)
            elif not isinstance(msg, (Hello, Heartbeat)):
                log.warning("unexpected_control_message", sender=name, type=type(msg).__name__)

    async def _on_ready(self) -> None:
        configured = self._configured
        for sched in [c for c in self.children.values() if c.spec.kind == "scheduler"]:
            # each scheduler's workers: the ranks on its plan socket (P/D: two engines)
            workers = [
                c
                for c in self.children.values()
                if c.spec.kind == "worker" and c.spec.addresses.plan == sched.spec.addresses.plan
            ]
            if sched.spec.name not in configured and all(w.ready for w in workers) and not sched.ready:
                configured.add(sched.spec.name)
                await self._configure(sched.spec.name, workers)
        if all(c.ready for c in self.children.values()):
            self._all_ready.set()

    async def _configure(self, name: str, workers: list[_Child]) -> None:
        """Facts the workers measured (KV blocks, limits, image sizes) -> their scheduler."""
        w0 = workers[0].info
        info = {
            "num_kv_blocks": min(int(w.info["num_kv_blocks"]) for w in workers),
            "max_model_len": int(w0["max_model_len"]),
            "eos_token_ids": list(w0["eos_token_ids"]),
            "vocab_size": int(w0["vocab_size"]),
            **{k: w0[k] for k in IMAGE_INFO if k in w0},  # vision-language models
            # XLA: rank 0's start-up compiles (its step results report the later ones)
            "compile_s": [float(x) for x in w0.get("compile_s", [])],
            "compile_cache_hits": int(w0.get("compile_cache_hits", 0)),
        }
        await self._send(name, Configure(info))

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for name, c in list(self.children.items()):  # a lost encoder leaves the dict
                code = c.proc.poll()
                if code is not None:
                    await self._on_failure(name, f"process exited with code {code}")
                elif c.ready and now - c.last_seen > self.config.heartbeat_timeout_s:
                    await self._on_failure(name, f"no heartbeat for {now - c.last_seen:.1f}s")

    async def _on_failure(self, name: str, reason: str) -> None:
        if self._stopped or self.failure is not None or self._failed.is_set():
            return
        child = self.children.get(name)
        if child is not None and child.spec.kind == "encoder" and self._all_ready.is_set():
            await self._lose_encoder(name, child, reason)
            return
        self.failure = (name, reason)
        log.error("actor_failed", failed=name, reason=reason)
        for other, c in self.children.items():
            if other != name and c.proc.poll() is None:
                await self._send(other, ActorFailed(name, reason))
        self._failed.set()

    async def _lose_encoder(self, name: str, child: _Child, reason: str) -> None:
        """A pool member, not the engine: the router re-places its work, serving goes on."""
        log.error("encoder_lost", failed=name, reason=reason)
        del self.children[name]
        if child.proc.poll() is None:  # stopped or hung: it must not come back
            child.proc.kill()
            await asyncio.to_thread(child.proc.wait, 5)
        await self._send("router", ActorFailed(name, reason))

    async def _send(self, name: str, msg) -> None:
        try:
            await self.control.send_multipart([name.encode(), *Codec.encode(msg)])
        except zmq.ZMQError as e:
            log.warning("control_send_failed", to=name, error=str(e))

    # ------------------------------------------------------------------ stop

    def request_stop(self) -> None:
        """Signal handler entry: stop serving, exit code 0 (also during startup)."""
        self.stop_requested = True
        self._failed.set()

    async def stop(self, reason: str = "shutdown", timeout: float = 5.0) -> None:
        """Ask every actor to stop; escalate to SIGTERM then SIGKILL. Idempotent."""
        self._stopped = True
        live = [c for c in self.children.values() if c.proc.poll() is None]
        for c in live:
            await self._send(c.spec.name, Shutdown(reason))
        await self._reap(live, timeout, None)
        await self._reap(live, 3.0, signal.SIGTERM)
        await self._reap(live, 3.0, signal.SIGKILL)
        for t in self._tasks:
            t.cancel()
        if hasattr(self, "ctx"):
            self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("engine_stopped", reason=reason)

    @staticmethod
    async def _reap(children: list[_Child], timeout: float, sig: int | None) -> None:
        alive = [c for c in children if c.proc.poll() is None]
        if not alive:
            return
        if sig is not None:
            for c in alive:
                try:
                    c.proc.send_signal(sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in alive):
            await asyncio.sleep(0.05)
