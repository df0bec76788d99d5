"""Per-rank profiler behind vLLM's `/start_profile` and `/stop_profile`.

Each worker rank runs `torch.profiler` between start and stop and writes one Chrome trace,
named like `torch.profiler.tensorboard_trace_handler` names them
(`rank<R>.<time_ns>.pt.trace.json`), so the same file opens in Perfetto/chrome://tracing and in
TensorBoard's profiler plugin. Each engine step is a `step <id>` range in the trace.

Traces are bounded on disk: recording stops by itself after `max_steps` steps (a trace grows with
the steps it holds), and each rank keeps only its newest `max_traces` traces. Writing a trace
happens on a thread (to a temporary name, renamed when complete), so a slow export never holds
up the step loop or the scheduler's wait for the stop acknowledgement.

On Neuron (model on an XLA device and `torch_neuronx` importable) the Neuron profiler runs
alongside, writing into `<dir>/neuron/rank<R>/` for the Neuron TensorBoard plugin; the
import is lazy, so CPU machines never need torch_neuronx.
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
import time
from typing import Any

import structlog
import torch

log = structlog.get_logger()

NEURON_PROFILER_PORT = 9012  # torch_neuronx's default; rank R uses port + R


class ProfilerStateError(RuntimeError):
    """start while running, or stop while not running (HTTP 409)."""


class RankProfiler:
    def __init__(self, out_dir: str, rank: int, device_type: str = "cpu", max_steps: int = 200, max_traces: int = 16):
        self.dir, self.rank, self.device_type = os.path.abspath(out_dir), rank, device_type
        self.max_steps, self.max_traces = max_steps, max_traces
        self._prof: torch.profiler.profile | None = None
        self._recording = False  # False after max_steps: the trace is held until stop
        self._steps = 0
        self._neuron: Any = None
        self._exports: list[threading.Thread] = []

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        if self._prof is not None:
            raise ProfilerStateError("the profiler is already running")
        os.makedirs(self.dir, exist_ok=True)
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, with_stack=False
        )
        prof.start()
        self._prof, self._recording, self._steps = prof, True, 0
        self._neuron = self._start_neuron()
        log.info("profiler.started", dir=self.dir, neuron=self._neuron is not None)

    def trace_path(self, rank: int, stamp: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.{stamp}.pt.trace.json")

    def stop(self, stamp: int = 0) -> list[str]:
        """Stop and write this rank's trace(s) on a thread; returns the paths they will have
        (each appears, complete, when written). Ranks given the same `stamp` name their files
        alike (default: now, in ns)."""
        prof, self._prof = self._prof, None
        if prof is None:
            raise ProfilerStateError("the profiler is not running")
        files = []
        if self._neuron is not None:
            neuron, self._neuron = self._neuron, None
            try:
                neuron.__exit__(None, None, None)
                files.append(self._neuron_dir())
            except Exception as e:  # noqa: BLE001 - the torch trace still gets written
                log.warning("profiler.neuron_stop_failed", error=repr(e))
        if self._recording:
            prof.stop()
        self._recording = False
        path = self.trace_path(self.rank, stamp or time.time_ns())
        self._exports = [t for t in self._exports if t.is_alive()]
        t = threading.Thread(target=self._export, args=(prof, path), name=f"profile-export-{self.rank}", daemon=True)
        t.start()
        self._exports.append(t)
        files.insert(0, path)
        log.info("profiler.stopped", files=files, steps=self._steps)
        return files

    def wait_exports(self, timeout: float | None = None) -> None:
        """Let running trace exports finish (shutdown)."""
        for t in self._exports:
            t.join(timeout)

    def _export(self, prof: torch.profiler.profile, path: str) -> None:
        tmp = path + ".partial"
        try:
            t0 = time.perf_counter()
            prof.export_chrome_trace(tmp)
            os.replace(tmp, path)
            log.info(
                "profiler.exported",
                path=path,
                mb=round(os.path.getsize(path) / 2**20, 1),
                seconds=round(time.perf_counter() - t0, 2),
            )
        except Exception as e:  # noqa: BLE001 - a lost trace, never a lost engine
            log.error("profiler.export_failed", path=path, error=repr(e))
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._prune()

    def _prune(self) -> None:
        """Keep this rank's newest `max_traces` traces."""
        mine = glob.glob(os.path.join(self.dir, f"rank{self.rank}.*.pt.trace.json"))
        mine.sort(key=lambda p: int(os.path.basename(p).split(".")[1]))
        for old in mine[: -self.max_traces]:
            with contextlib.suppress(OSError):
                os.unlink(old)
                log.info("profiler.pruned", path=old)

    def step_scope(self, step_id: int) -> contextlib.AbstractContextManager:
        """A `step <id>` range in the trace while profiling; free otherwise. After `max_steps`
        steps the profiler stops recording (the trace waits for /stop_profile)."""
        if not self._recording:
            return contextlib.nullcontext()
        self._steps += 1
        if self._steps > self.max_steps:
            assert self._prof is not None
            self._prof.stop()
            self._recording = False
            log.warning("profiler.step_limit", steps=self.max_steps)
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"step {step_id}")

    def _neuron_dir(self) -> str:
        return os.path.join(self.dir, "neuron", f"rank{self.rank}")

    def _start_neuron(self) -> Any:
        """The Neuron profiler context when running on Neuron, else None."""
        if self.device_type != "xla":
            return None
        try:
            import torch_neuronx.experimental.profiler as neuron_profiler  # type: ignore[import-not-found]
        except ImportError:
            log.info("profiler.neuron_unavailable", why="torch_neuronx is not installed")
            return None
        os.makedirs(self._neuron_dir(), exist_ok=True)
        cm = neuron_profiler.profile(
            port=NEURON_PROFILER_PORT + self.rank,
            profile_type="trace",
            neuron_tensorboard_plugin_dir=self._neuron_dir(),
            auto_start=True,
        )
        cm.__enter__()
        return cm


def model_device_type(model: torch.nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"
