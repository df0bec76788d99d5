"""axonserve worker ranks driven from vLLM's executor: start them, talk to them, stop them.

The ranks are the same `WorkerActor` processes axonserve's own engine runs. They are started
by a rank host (rank_host.py: a workers-only `Supervisor` outside vLLM's process tree) that
the executor keeps alive through a lifeline pipe: closing it — `stop`, or the executor's
process dying — makes the host send every rank a clean `Shutdown`. The host reports on a
status socket (its pid, then rank 0's facts and the bus addresses, or a failure).

This object takes the scheduler actor's place on the bus: it binds the XPUB the ranks' SUBs
connect to (one plan reaches every rank) and the PULL that rank 0 pushes results into. A
monitor thread watches the status socket and the host process, so a rank that dies makes
every wait here raise (and vLLM's failure callback fire) instead of hang.

No vLLM import here: this is the bus side of the bridge.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import zmq

from axonserve.actors.runtime import SMALL_MESSAGE_BYTES, attach, bus_socket, data_message_bytes
from axonserve.actors.security import release
from axonserve.config import EngineConfig
from axonserve.protocol import Codec, Control, DecodeError
from axonserve.protocol.messages import ActorFailed, Hello, ProfileAck, Ready, StepResult

log = structlog.get_logger()
_replies = Codec(StepResult | ProfileAck)
_status = Codec(Control)
POLL_S = 0.2  # how often a wait looks at the ranks' health
HELLO_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0  # the host's own escalation (Shutdown, SIGTERM, SIGKILL) takes up to ~11 s


class RanksFailed(RuntimeError):
    """A rank died, hung or answered out of turn: the ranks serve no more."""


def alive(pid: int) -> bool:
    """Running (a zombie, waiting for whoever adopted it to reap it, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class RankGroup:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.ctx = zmq.Context()
        self.run_dir = tempfile.mkdtemp(prefix="axonserve-vllm-")
        self.status = self._socket(zmq.PULL, f"ipc://{self.run_dir}/status")
        self.pub: zmq.Socket | None = None
        self.pull: zmq.Socket | None = None
        self.host_pid = 0
        self.rank_pids: list[int] = []
        self._lifeline: int | None = None  # write end; the host reads EOF when it closes
        self._failure: str | None = None
        self._on_failure: Callable[[str], None] | None = None
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.extra_frames: list[Any] = []  # the last reply's tensor frames

    # ------------------------------------------------------------------ life

    def start(self, on_failure: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Spawn the host and its ranks; wait until each rank loaded and subscribed. Returns rank
        0's Ready facts. Raises RanksFailed (everything stopped) otherwise."""
        t0 = time.monotonic()
        self._on_failure = on_failure
        try:
            self._spawn_host()
            hello = self._status_msg(HELLO_TIMEOUT_S, "the rank host's hello")
            if not isinstance(hello, Hello):
                raise RanksFailed(f"the rank host said {hello!r:.200} before hello")
            self.host_pid = hello.pid
            ready = self._status_msg(self.config.ready_timeout_s + 30, "the ranks to load")
            if isinstance(ready, ActorFailed):
                raise RanksFailed(ready.reason)
            if not isinstance(ready, Ready):
                raise RanksFailed(f"the rank host said {ready!r:.200} instead of ready")
            info = dict(ready.info)
            self.rank_pids = [int(p) for p in info.pop("pids")]  # type: ignore[union-attr]
            self.pub = self._socket(zmq.XPUB, str(info.pop("plan")))
            self.pull = self._socket(zmq.PULL, str(info.pop("result")))
            self._wait_subscribers(self.config.num_workers)
        except BaseException:
            self.stop("start-up failed")
            raise
        self._monitor = threading.Thread(target=self._watch, name="axonserve-ranks-monitor", daemon=True)
        self._monitor.start()
        log.info(
            "vllm_plugin.ranks_ready",
            ranks=self.config.num_workers,
            seconds=round(time.monotonic() - t0, 2),
            num_kv_blocks=info.get("num_kv_blocks"),
            host_pid=self.host_pid,
            rank_pids=self.rank_pids,
            run_dir=self.run_dir,
        )
        return info

    def stop(self, reason: str = "vllm executor shutdown") -> None:
        """Close the lifeline (the host shuts every rank down), wait for them to exit. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        pids = [p for p in (*self.rank_pids, self.host_pid) if p]
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in filter(alive, pids):  # the host did not manage: ours to end
            log.warning("vllm_plugin.rank_killed", pid=p)
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._monitor is not None:
            self._monitor.join(5)
        release(self.ctx)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("vllm_plugin.ranks_stopped", reason=reason)

    @property
    def failure(self) -> str | None:
        return self._failure

    # ------------------------------------------------------------------ bus

    def send(self, msg: Any) -> None:
        self._check()
        assert self.pub is not None
        self.pub.send_multipart(Codec.encode(msg), copy=False)

    def recv(self, what: str, timeout: float | None = None) -> StepResult | ProfileAck:
        """Rank 0's next reply; RanksFailed when a rank fails or none comes within `timeout`."""
        assert self.pull is not None
        timeout = self.config.step_timeout_s if timeout is None else timeout  # a long step is work, not a hang
        deadline = time.monotonic() + timeout
        while True:
            while not self.pull.poll(int(POLL_S * 1000)):
                self._check()
                if time.monotonic() > deadline:
                    raise RanksFailed(f"axonserve rank 0 gave no reply for {what} in {timeout:.0f}s")
            frames = self.pull.recv_multipart(copy=False)
            try:
                reply, self.extra_frames = _replies.decode(frames)
            except DecodeError as e:  # junk from whoever reached the socket: dropped, the wait goes on
                log.warning("vllm_plugin.bad_reply", what=what, error=str(e)[:300])
                continue
            return reply

    # ------------------------------------------------------------------ internals

    def _socket(self, kind: int, address: str) -> zmq.Socket:
        small = kind == zmq.PULL and address.endswith("/status")
        s = bus_socket(self.ctx, kind, SMALL_MESSAGE_BYTES if small else data_message_bytes(self.config))
        s.setsockopt(zmq.LINGER, 0)
        if kind == zmq.XPUB:
            s.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per rank
            s.setsockopt(zmq.SNDHWM, 0)
        else:
            s.setsockopt(zmq.RCVHWM, 0)
        attach(s, address, bind=True)  # a tcp bus needs its keys here too (BusKeysMissing otherwise)
        return s

    def _spawn_host(self) -> None:
        read, self._lifeline = os.pipe()
        cmd = [
            sys.executable,
            "-m",
            "axonserve.frontends.vllm_plugin.rank_host",
            msgspec.json.encode(self.config).decode(),
            f"ipc://{self.run_dir}/status",
            str(read),
        ]
        try:
            proc = subprocess.Popen(cmd, pass_fds=(read,), stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(read)
        proc.wait(HELLO_TIMEOUT_S)  # the first process forks the host and exits at once

    def _status_msg(self, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            while not self.status.poll(int(POLL_S * 1000)):
                if self.host_pid and not alive(self.host_pid):
                    raise RanksFailed(f"the rank host (pid {self.host_pid}) exited while waiting for {what}")
                if time.monotonic() > deadline:
                    raise RanksFailed(f"timed out after {timeout:.0f}s waiting for {what}")
            try:
                msg, _ = _status.decode(self.status.recv_multipart())
            except DecodeError as e:
                log.warning("vllm_plugin.bad_status", error=str(e)[:300])
                continue
            return msg

    def _wait_subscribers(self, n: int) -> None:
        """Plans published before a rank's SUB is connected would be lost: wait for each."""
        assert self.pub is not None
        seen, deadline = 0, time.monotonic() + self.config.ready_timeout_s
        while seen < n:
            if self.pub.poll(int(POLL_S * 1000)):
                if self.pub.recv()[:1] == b"\x01":
                    seen += 1
                continue
            if time.monotonic() > deadline:
                raise RanksFailed(f"only {seen} of {n} axonserve ranks subscribed to the plan socket")

    def _check(self) -> None:
        if self._failure is not None:
            raise RanksFailed(self._failure)
        if self._stop.is_set():
            raise RanksFailed("axonserve's ranks were stopped")

    def _watch(self) -> None:
        """Monitor thread (sole user of the status socket after start): a failure report or a
        vanished host marks the ranks failed, once."""
        while not self._stop.is_set() and self._failure is None:
            reason = None
            try:
                if self.status.poll(int(POLL_S * 1000)):
                    msg, _ = _status.decode(self.status.recv_multipart())
                    if isinstance(msg, ActorFailed):
                        reason = f"axonserve {msg.name} failed: {msg.reason}"
            except DecodeError as e:  # junk: dropped
                log.warning("vllm_plugin.bad_status", error=str(e)[:300])
                continue
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            if reason is None and not alive(self.host_pid) and not self._stop.is_set():
                reason = f"the axonserve rank host (pid {self.host_pid}) exited"
            if reason is not None:
                self._failure = reason
                log.error("vllm_plugin.ranks_failed", reason=reason)
                if self._on_failure is not None:
                    self._on_failure(reason)
