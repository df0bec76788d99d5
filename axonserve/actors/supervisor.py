"""Supervisor: starts every actor process, knows who is alive, replaces the dead, stops them all.

Start-up: spawn workers, scheduler (and frontend) at once -> each says Hello, loads, says
Ready -> once every worker is Ready the scheduler is sent `Configure` (KV block count and
limits the workers measured) -> all Ready: serving.

Self-healing: a process that exits, misses heartbeats or is reported failed (a worker rank by
the scheduler's step timeout) is replaced, and every survivor is told (`ActorRestarting`, then
`ActorRestarted` once the replacement is Ready) so work that depends on it pauses instead of
failing. A worker rank takes its whole rank group with it (their collective group is broken, and
KV is sharded across them); the scheduler resumes its requests on the new group. A scheduler is
replaced alone (the ranks and their loaded model stay), and its clients resubmit what was in
flight. Metrics, snapshot sink, encoders, router and drafter restart in place. Past
`max_restarts` within `restart_window_s`, and for the frontend and a P/D prefill engine, a
failure marks the whole engine failed as before: every survivor is told (in-flight requests end
with errors, /health turns 503), then after a short grace everything stops and the supervisor's
exit code is non-zero. Children die with the supervisor (PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import structlog
import zmq
import zmq.asyncio

from axonserve.actors import security
from axonserve.actors.runtime import SMALL_MESSAGE_BYTES, attach, bus_socket, supervisor_name
from axonserve.config import ActorSpec, Addresses, EngineConfig, engine_suffix, free_ports
from axonserve.protocol import Codec, Control, DecodeError
from axonserve.protocol.messages import (
    ActorFailed,
    ActorRestarted,
    ActorRestarting,
    Configure,
    Heartbeat,
    Hello,
    Ready,
    RestartStats,
    Shutdown,
)

log = structlog.get_logger()
_codec = Codec(Control)
IMAGE_INFO = ("image_token_id", "image_tokens", "image_size", "hidden_size")
RUN_DIR_ENV = "AXONSERVE_RUN_DIR"  # where the run directory (the ipc:// bus sockets) is made; default: $TMPDIR
SECRET_ENV = ("AXONSERVE_API_KEY", "VLLM_API_KEY")  # only the frontend, which checks it, inherits these
RESTART_IN_PLACE = ("metrics", "snapshot", "encoder", "router", "drafter")  # nothing depends on their state


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


def _bare_host(url_host: str) -> str:
    """tcp://1.2.3.4 or tcp://[::1] -> 1.2.3.4 or ::1."""
    return url_host.removeprefix("tcp://").strip("[]")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (tcp://[v6]:port hosts may come with their brackets)."""
    return free_ports(host.strip("[]"), 1)[0]


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
        # (a foreign driver binds the ranks' plan and result sockets with ZeroMQ; it has no engine socket)
        self.addresses = Addresses.in_dir(self.run_dir, dist_port, channel=not workers_only)
        # a tcp bus (actors on other machines can reach it): CURVE on every socket, keys per launch,
        # handed to children in their environment (`bus_env`), never on argv
        self.bus_keys: security.BusKeys | None = None
        if config.bus_transport == "tcp":
            self.addresses = Addresses.tcp(config.bus_host, dist_init=config.num_workers > 1, avoid={config.port})
            self.bus_keys = security.launch_keys()
            log.info(
                "bus",
                transport="tcp",
                curve=True,
                **{k: v for k, v in msgspec.structs.asdict(self.addresses).items() if v},
            )
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
        self.ray = None  # the Ray backend's executor (distributed/ray_executor.py), made at start
        self._restarts: deque[float] = deque()  # when each restart began (within restart_window_s)
        # event name ("workers" or an actor's) -> (start, cause, the actors replaced)
        self.restarting: dict[str, tuple[float, str, list[str]]] = {}
        self.num_restarts = 0
        # in-process clients (the offline LLM's) hear what the frontend actor hears: restarts, failure
        self.listeners: list = []

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
        self.control.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a replacement takes over its predecessor's identity
        attach(self.control, self.addresses.control, bind=True)
        self._stats = None
        if self.addresses.stats:  # restart counts for the metrics actor
            self._stats = bus_socket(zmq.Context.shadow(self.ctx.underlying), zmq.PUSH, SMALL_MESSAGE_BYTES)
            self._stats.setsockopt(zmq.LINGER, 0)
            attach(self._stats, self.addresses.stats)
        specs = []
        for i in range(self.config.data_parallel_size):  # each engine: its ranks and its scheduler
            cfg, addrs, sfx = self._engine(i)
            specs += [
                ActorSpec(kind="worker", name=f"worker-{r}{sfx}", config=cfg, addresses=addrs, rank=r)
                for r in range(self.config.num_workers)
            ]
            if not self.workers_only:
                specs.append(ActorSpec(kind="scheduler", name=f"scheduler{sfx}", config=cfg, addresses=addrs))
        self.addresses.engines = [s.addresses.engine for s in specs if s.kind == "scheduler"]
        if not self.workers_only:
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
        if self.config.distributed_executor_backend == "ray" and not self.ray:
            from axonserve.distributed.ray_executor import RayExecutor

            ranks = sum(s.kind == "worker" for s in specs)
            cfg = self.config
            self.ray = await asyncio.to_thread(RayExecutor, ranks, cfg.ray_placement_strategy, cfg.ray_cpus_per_worker)
        await self._start_children(specs)
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

    def _engine(self, i: int) -> tuple[EngineConfig, Addresses, str]:
        """Data-parallel engine i's config, addresses (its own client, plan, result and rendezvous
        endpoints: engine 0 has the launch's own) and name suffix."""
        if i == 0:
            return self.config, self.addresses, ""
        a = self.addresses

        def other(url: str, name: str) -> str:
            if not url:
                return url
            if url.startswith(("ipc://", "unix://")):
                return f"{url.split('://', 1)[0]}://{self.run_dir}/{name}-dp{i}"
            host = url.rsplit(":", 1)[0]  # tcp://host:port -> the same host, a free port
            return f"{host}:{free_port(_bare_host(host))}"

        addrs = msgspec.structs.replace(
            a,
            engine=other(a.engine, "engine"),
            plan=other(a.plan, "plan"),
            result=other(a.result, "plan" if a.result == a.plan else "result"),
            dist_init=other(a.dist_init, "dist") if a.dist_init else "",
        )
        return msgspec.structs.replace(self.config, data_parallel_rank=i), addrs, engine_suffix(i)

    def _prefill_pool(self) -> list[ActorSpec]:
        """P/D: a second engine (scheduler + worker ranks) that only prefills, on its own
        sockets; the decode scheduler is its client."""
        d = self.run_dir
        cfg = msgspec.structs.replace(self.config, role="prefill", encoder_workers=0)
        port = 0
        while cfg.num_workers > 1 and port in (0, cfg.port):
            port = free_port()
        own = {
            "engine": f"ipc://{d}/prefill-engine",
            "plan": f"unix://{d}/prefill-plan",
            "result": f"unix://{d}/prefill-plan",
            "dist_init": f"tcp://127.0.0.1:{port}" if port else "",
        }
        if self.config.bus_transport == "tcp":
            t = Addresses.tcp(
                cfg.bus_host, dist_init=cfg.num_workers > 1, avoid={cfg.port, *self.addresses.tcp_ports()}
            )
            own = {"engine": t.engine, "plan": t.plan, "result": t.result, "dist_init": t.dist_init}
        addrs = msgspec.structs.replace(
            self.addresses,
            **own,
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

    @property
    def bus_env(self) -> dict[str, str]:
        """What a child's environment needs to join this launch's bus (its CURVE keys on a tcp bus)."""
        return self.bus_keys.env() if self.bus_keys is not None else {}

    def _spawn(self, spec: ActorSpec) -> subprocess.Popen:
        """The spec (config and addresses, never a secret: the API key is not in EngineConfig)
        goes on argv; the environment is inherited, the API key by the frontend only, the bus keys
        (a tcp bus's, `bus_env`) by every child."""
        env = dict(os.environ, AXONSERVE_PARENT_PID=str(os.getpid()))
        if spec.kind != "frontend":
            for name in SECRET_ENV:
                env.pop(name, None)
        env.pop(security.KEYS_ENV, None)
        env.update(self.bus_env)
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
            elif isinstance(msg, Hello) and child.spec.kind == "scheduler" and self._all_ready.is_set():
                await self._on_ready()  # a replacement scheduler: its ranks are ready, configure it now
            elif not isinstance(msg, (Hello, Heartbeat)):
                log.warning("unexpected_control_message", sender=name, type=type(msg).__name__)

    async def _on_ready(self) -> None:
        await self._finish_restarts()
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
        # a replacement scheduler numbers its steps apart from its predecessor's: a result of the old
        # scheduler's last plan that a rank still delivers can never pass for one of the new plans
        facts = {**self._worker_facts(workers), "step_base": self.num_restarts << 32}
        await self._send(name, Configure(facts))

    @staticmethod
    def _worker_facts(workers: list[_Child]) -> dict:
        w0 = workers[0].info
        return {
            "num_kv_blocks": min(int(w.info["num_kv_blocks"]) for w in workers),
            "max_model_len": int(w0["max_model_len"]),
            "eos_token_ids": list(w0["eos_token_ids"]),
            "vocab_size": int(w0["vocab_size"]),
            "kv_window": int(w0.get("kv_window") or 0),  # sliding-window models (engine/sliding_window.py)
            **{k: w0[k] for k in IMAGE_INFO if k in w0},  # vision-language models
            # XLA: rank 0's start-up compiles (its step results report the later ones)
            "compile_s": [float(x) for x in w0.get("compile_s", [])],
            "compile_cache_hits": int(w0.get("compile_cache_hits", 0)),
        }

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
        if any(name in members for _, _, members in self.restarting.values()):
            return  # being replaced already (a rank group's other ranks die with it)
        child = self.children.get(name)
        group = self._restart_group(child) if child is not None and self._all_ready.is_set() else None
        if group is not None and self._may_restart():
            await self._restart(*group, f"{name}: {reason}")
            return
        if child is not None and child.spec.kind == "encoder" and self._all_ready.is_set():
            await self._lose_encoder(name, child, reason)  # a pool member, not the engine
            return
        if group is not None:
            reason += f" (and {self.config.max_restarts} restarts within {self.config.restart_window_s:g} s already)"
        self.failure = (name, reason)
        log.error("actor_failed", failed=name, reason=reason)
        await self._tell_all(ActorFailed(name, reason), skip=[name])
        self._failed.set()

    async def _lose_encoder(self, name: str, child: _Child, reason: str) -> None:
        """No restart left for it: the router re-places its work, serving goes on without it."""
        log.error("encoder_lost", failed=name, reason=reason)
        del self.children[name]
        if child.proc.poll() is None:  # stopped or hung: it must not come back
            child.proc.kill()
            await asyncio.to_thread(child.proc.wait, 5)
        await self._send("router", ActorFailed(name, reason))

    # ------------------------------------------------------------------ restart

    def _restart_group(self, child: _Child) -> tuple[str, list[str]] | None:
        """(event name, the actors to replace) when `child`'s failure can heal; None: fail-stop.
        The main engine's worker ranks go as a group; a P/D prefill engine and the frontend do not heal."""
        spec = child.spec
        kind, main = spec.kind, spec.addresses.engine in self.addresses.engines  # (not a P/D prefill engine)
        if self.config.max_restarts <= 0:
            return None
        if kind == "worker" and main:
            return "workers" + engine_suffix(spec.config.data_parallel_rank), [
                c.spec.name
                for c in self.children.values()
                if c.spec.kind == "worker" and c.spec.addresses.plan == spec.addresses.plan
            ]
        if (kind == "scheduler" and main) or kind in RESTART_IN_PLACE:
            return child.spec.name, [child.spec.name]
        return None

    def _may_restart(self) -> bool:
        now, window = time.monotonic(), self.config.restart_window_s
        while self._restarts and now - self._restarts[0] > window:
            self._restarts.popleft()
        return len(self._restarts) < self.config.max_restarts

    async def _restart(self, event: str, names: list[str], cause: str) -> None:
        """Stop `names` for good (a hung process too), tell the survivors, start replacements. The
        restart ends when every replacement is Ready (`_finish_restarts`)."""
        t0 = time.monotonic()
        self._restarts.append(t0)
        self.num_restarts += 1
        self.restarting[event] = (t0, cause, names)
        log.warning("actor.restarting", actor=event, cause=cause, replaced=names, restarts=len(self._restarts))
        await self._tell_all(ActorRestarting(event, cause), skip=names)
        old = [self.children[n] for n in names]
        for c in old:
            if c.proc.poll() is None:
                c.proc.kill()
        await asyncio.gather(*(asyncio.to_thread(c.proc.wait, 10) for c in old), return_exceptions=True)
        dist_init = self.addresses.dist_init
        if event.startswith("workers") and self.config.num_workers > 1:  # a fresh rendezvous: the old store died
            host = old[0].spec.addresses.dist_init.rsplit(":", 1)[0]
            dist_init = f"{host}:{free_port(_bare_host(host))}"
        specs = []
        for c in old:
            spec = c.spec
            if event.startswith("workers"):  # the scheduler's pool size is fixed: the new ranks must match it
                blocks = int(self._worker_facts(old)["num_kv_blocks"])
                spec = msgspec.structs.replace(
                    spec,
                    config=msgspec.structs.replace(spec.config, num_kv_blocks=blocks),
                    addresses=msgspec.structs.replace(spec.addresses, dist_init=dist_init),
                )
            if spec.kind == "scheduler":
                self._configured.discard(spec.name)
            specs.append(spec)
        await self._start_children(specs)

    async def _start_children(self, specs: list[ActorSpec]) -> None:
        """Local processes; with the Ray backend the worker ranks in Ray actors instead, each engine's
        ranks in their placement-group bundles (rank 0's node holding their rendezvous)."""
        ranks = [s for s in specs if s.kind == "worker"] if self.ray is not None else []
        for spec in specs:
            if spec not in ranks:
                self.children[spec.name] = _Child(spec, self._spawn(spec))
        engines: dict[str, list[ActorSpec]] = {}
        for spec in ranks:
            engines.setdefault(spec.addresses.plan, []).append(spec)
        for group in engines.values():
            group.sort(key=lambda s: s.rank)
            tp = self.config.num_workers
            base = group[0].config.data_parallel_rank * tp
            hosts = [await asyncio.to_thread(self.ray.host, base + s.rank) for s in group]  # type: ignore[union-attr]
            if tp > 1:  # the rendezvous on rank 0's node, at an address the other nodes reach
                dist = await asyncio.to_thread(self.ray.rendezvous, hosts[0])  # type: ignore[union-attr]
                group = [
                    msgspec.structs.replace(s, addresses=msgspec.structs.replace(s.addresses, dist_init=dist))
                    for s in group
                ]
            for spec, host in zip(group, hosts):
                proc = await asyncio.to_thread(self.ray.spawn, host, spec, self.bus_env)  # type: ignore[union-attr]
                self.children[spec.name] = _Child(spec, proc)

    async def _finish_restarts(self) -> None:
        """Restarts whose replacements are all Ready: tell the survivors, count, log."""
        for event, (t0, cause, names) in list(self.restarting.items()):
            if not all(self.children[n].ready for n in names):
                continue
            del self.restarting[event]
            seconds = time.monotonic() - t0
            workers = event.startswith("workers")
            info = self._worker_facts([self.children[n] for n in names]) if workers else {}
            log.warning("actor.restarted", actor=event, cause=cause, seconds=round(seconds, 2))
            self._publish(RestartStats(actor=event, seconds=seconds))
            await self._tell_all(ActorRestarted(event, seconds, info), skip=names)

    async def _tell_all(self, msg, skip: list[str]) -> None:
        """Every live actor but `skip`, and every in-process listener."""
        for other, c in self.children.items():
            if other not in skip and c.proc.poll() is None:
                await self._send(other, msg)
        for listener in self.listeners:
            try:
                await listener(msg)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the supervisor
                log.exception("listener_failed", message=type(msg).__name__)

    def _publish(self, event) -> None:
        """A stats event for the metrics actor (dropped when it cannot take it)."""
        if self._stats is None:
            return
        try:
            self._stats.send_multipart(Codec.encode(event), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

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
        if getattr(self, "_stats", None) is not None:
            self._stats.close(linger=0)
        if hasattr(self, "ctx"):
            security.release(self.ctx)  # the control socket's ZAP thread, before the context's term
            self.ctx.destroy(linger=0)
        if self.ray is not None:  # no Ray actor or placement group of this launch stays behind
            await asyncio.to_thread(self.ray.shutdown)
            self.ray = None
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
