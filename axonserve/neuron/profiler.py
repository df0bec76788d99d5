"""Per-rank profiler behind vLLM's `/start_profile` and `/stop_profile`.

Each worker rank runs `torch.profiler` between start and stop and writes one Chrome trace,
named like `torch.profiler.tensorboard_trace_handler` names them
(`rank<R>.<time_ns>.pt.trace.json`), so the same file opens in Perfetto/chrome://tracing and in
TensorBoard's profiler plugin. Each engine step is a `step <id>` range in the trace.

On Neuron (model on an XLA device and `torch_neuronx` importable) the Neuron profiler runs
alongside, writing into `<dir>/neuron/rank<R>/` for the Neuron TensorBoard plugin; the
import is lazy, so CPU machines never need torch_neuronx.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import structlog
import torch

log = structlog.get_logger()

NEURON_PROFILER_PORT = 9012  # torch_neuronx's default; rank R uses port + R


class ProfilerStateError(RuntimeError):
    """start while running, or stop while not running (HTTP 409)."""


class RankProfiler:
    def __init__(self, out_dir: str, rank: int, device_type: str = "cpu"):
        self.dir, self.rank, self.device_type = os.path.abspath(out_dir), rank, device_type
        self._prof: torch.profiler.profile | None = None
        self._neuron: Any = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        if self._prof is not None:
            raise ProfilerStateError("the profiler is already running")
        os.makedirs(self.dir, exist_ok=True)
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, with_stack=False)
        prof.start()
        self._prof = prof
        self._neuron = self._start_neuron()
        log.info("profiler.started", dir=self.dir, neuron=self._neuron is not None)

    def trace_path(self, rank: int, stamp: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.{stamp}.pt.trace.json")

    def stop(self, stamp: int = 0) -> list[str]:
        """Stop and write this rank's trace(s); returns the paths written. Ranks given the
        same `stamp` name their files alike (default: now, in ns)."""
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
        prof.stop()
        path = self.trace_path(self.rank, stamp or time.time_ns())
        prof.export_chrome_trace(path)
        files.insert(0, path)
        log.info("profiler.stopped", files=files)
        return files

    def step_scope(self, step_id: int) -> contextlib.AbstractContextManager:
        """A `step <id>` range in the trace while profiling; free otherwise."""
        if self._prof is None:
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
            port=NEURON_PROFILER_PORT + self.rank, profile_type="trace",
            neuron_tensorboard_plugin_dir=self._neuron_dir(), auto_start=True,
        )
        cm.__enter__()
        return cm


def model_device_type(model: torch.nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"
