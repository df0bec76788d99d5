"""`--distributed-executor-backend ray`: Ray places the worker ranks and reports their deaths.

Ray is the placer and the failure detector, not the data path. The launcher joins the cluster at
RAY_ADDRESS (or starts a local one), reserves one placement-group bundle per worker rank
(`--ray-placement-strategy` PACK or SPREAD, `--ray-cpus-per-worker` CPUs each) and starts, in each
bundle, a `RankHost` Ray actor that runs the rank's worker actor as its child process: the same
`python -m axonserve.actors.entry <spec>` as the mp backend, with the bus keys in the child's
environment (handed through Ray, never on a command line). Plans and results keep travelling as
msgspec over ZeroMQ, on tcp:// addresses the launcher's node advertises (CURVE-authenticated); the
torch.distributed rendezvous runs on rank 0's node. `RayProc` gives the supervisor the
`subprocess.Popen` surface it watches (poll, kill, wait): a rank whose Ray actor dies (its node
lost, `ray.kill`) reads as an exited process, as fast as the supervisor polls.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import msgspec
import structlog

log = structlog.get_logger()

MISSING = "--distributed-executor-backend ray needs Ray: pip install 'axonserve[ray]'"
NAMESPACE = "axonserve"


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{MISSING} ({e})") from e
    return ray


def _node_address() -> tuple[str, str]:
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankHost:
    """One worker rank on its node: the rank's actor process is this Ray actor's child (it dies with
    it: PR_SET_PDEATHSIG), so killing the Ray actor, or losing its node, ends the rank."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def node(self) -> tuple[str, str]:
        """(Ray node id, IP address) of the node this rank runs on."""
        return _node_address()

    def free_port(self) -> int:
        """A free TCP port on this node's address (rank 0: the torch.distributed rendezvous)."""
        return _free_port(_node_address()[1])

    def start(self, spec_json: str, env: dict[str, str]) -> int:
        child_env = {**os.environ, **env, "AXONSERVE_PARENT_PID": str(os.getpid())}
        cmd = [sys.executable, "-m", "axonserve.actors.entry", spec_json]
        self.proc = subprocess.Popen(cmd, env=child_env, stdin=subprocess.DEVNULL)
        return self.proc.pid

    def wait(self) -> int:
        """Blocks (in Ray's thread pool) until the rank's process exits; its exit code."""
        assert self.proc is not None
        return self.proc.wait()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)


class RayProc:
    """The `subprocess.Popen` surface the supervisor watches, for a rank in a RankHost."""

    def __init__(self, ray: Any, host: Any, pid: int, node_id: str):
        self.ray, self.host, self.pid, self.node_id = ray, host, pid, node_id
        self.returncode: int | None = None
        self._exit = host.wait.remote()

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _ = self.ray.wait([self._exit], timeout=0)
            if ready:
                try:
                    self.returncode = int(self.ray.get(ready[0]))
                except Exception:  # noqa: BLE001 - the Ray actor (or its node) died: the rank is gone
                    self.returncode = -int(signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("ray rank", timeout or 0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self.kill()
            return
        try:
            self.host.signal.remote(int(sig))
        except Exception:  # noqa: BLE001 - already gone
            pass

    def kill(self) -> None:
        try:
            self.ray.kill(self.host, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


class RayExecutor:
    """The launcher's Ray session: the placement group of the worker ranks and their hosts."""

    def __init__(self, num_ranks: int, strategy: str = "PACK", cpus_per_rank: float = 1.0, timeout_s: float = 120.0):
        ray = self.ray = import_ray()
        address = os.environ.get("RAY_ADDRESS") or None
        self._owns_session = not ray.is_initialized()
        if self._owns_session:  # the ranks' output reaches the launcher's, as a local rank's does
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=True, configure_logging=False)
        from ray.util.placement_group import placement_group

        self.pg = placement_group([{"CPU": cpus_per_rank} for _ in range(num_ranks)], strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except Exception as e:
            self.shutdown()
            raise RuntimeError(
                f"Ray could not place {num_ranks} worker ranks of {cpus_per_rank} CPU ({strategy}) within "
                f"{timeout_s:.0f} s: {e}"
            ) from e
        self._host_cls = ray.remote(num_cpus=cpus_per_rank, max_restarts=0, max_concurrency=4)(RankHost)
        self.hosts: dict[int, Any] = {}  # bundle -> its current RankHost
        self.name = f"axonserve-{os.getpid()}"  # this launch's prefix for its Ray actor names
        self._generation = 0
        self.driver_ip = ray.util.get_node_ip_address()
        log.info("ray.placed", ranks=num_ranks, strategy=strategy, cpus_per_rank=cpus_per_rank, address=address)

    def host(self, bundle: int) -> Any:
        """A fresh RankHost in `bundle` (a restarted rank gets a new one in the same bundle)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._generation += 1
        h = self._host_cls.options(
            name=f"{self.name}-rank{bundle}-{self._generation}",  # findable: ray.get_actor(name, NAMESPACE)
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
        ).remote()
        self.hosts[bundle] = h
        return h

    def rendezvous(self, host: Any) -> str:
        """tcp://<node ip>:<free port> on `host`'s node: rank 0's torch.distributed store."""
        ip = self.ray.get(host.node.remote())[1]
        return f"tcp://{ip}:{self.ray.get(host.free_port.remote())}"

    def spawn(self, host: Any, spec: Any, env: dict[str, str]) -> RayProc:
        node_id, ip = self.ray.get(host.node.remote())
        pid = self.ray.get(host.start.remote(msgspec.json.encode(spec).decode(), env))
        log.info("ray.rank_started", actor=spec.name, node=node_id[:12], ip=ip, pid=pid)
        return RayProc(self.ray, host, pid, node_id)

    def shutdown(self) -> None:
        """Kill every rank host and remove the placement group: nothing of this launch stays behind."""
        for h in self.hosts.values():
            try:
                self.ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.hosts.clear()
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - gone with the cluster
            pass
        if self._owns_session:
            self.ray.shutdown()  # (a local cluster it started stops with it)
