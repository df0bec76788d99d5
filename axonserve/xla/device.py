"""torch-xla device set-up: import (naming how to get it), persistent compile cache, compile counters.

Everything here runs in the worker process before the model touches the device: PJRT reads
PJRT_DEVICE at first use, and XLA's persistent cache must be initialised before any computation.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog

log = structlog.get_logger()

MISSING = (
    "--device xla needs torch-xla: run ./scripts/setup-xla (builds .venv-xla with torch 2.9.0 and torch-xla "
    "2.9.0) and serve from .venv-xla/bin/axonserve; on Trainium/Inferentia install the `neuron` extra's "
    "torch-neuronx and neuronx-cc from the AWS Neuron repository (README: Running on Trainium/Inferentia)"
)


def on_neuron() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_neuronx") is not None


def import_xla() -> ModuleType:
    """torch_xla, with PJRT_DEVICE chosen first: NEURON when torch-neuronx is installed, else CPU
    (an explicit PJRT_DEVICE, say TPU, is kept)."""
    os.environ.setdefault("PJRT_DEVICE", "NEURON" if on_neuron() else "CPU")
    try:
        import torch_xla
    except ImportError as e:
        raise ImportError(f"{MISSING} ({e})") from e
    if on_neuron():
        import torch_neuronx  # noqa: F401 - registers the Neuron PJRT plugin

    return torch_xla


def xla_device():
    return import_xla().device()


def pjrt_device() -> str:
    return os.environ.get("PJRT_DEVICE", "")


def cache_key(config: Any, model_config: Any, buckets: dict[str, list[int]]) -> str:
    """The persistent cache's subdirectory for one engine shape: a graph compiled for another model,
    dtype, bucket set, TP degree, PJRT device or torch-xla version is never reused."""
    import torch_xla

    model_json = Path(model_config.path, "config.json")
    parts = {
        "model": hashlib.sha256(model_json.read_bytes()).hexdigest() if model_json.exists() else config.model,
        "dtype": config.dtype,
        "block_size": config.block_size,
        "buckets": buckets,
        "tp": config.num_workers,
        "pjrt": pjrt_device(),
        "torch_xla": torch_xla.__version__,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    name = Path(config.model.rstrip("/")).name or "model"
    return f"{name}-{config.dtype}-tp{config.num_workers}-{digest}"


def init_compile_cache(root: str, key: str, rank: int) -> Path:
    """XLA's persistent compile cache in root/key/rank<r> (and on Neuron the compiler's NEFF cache in
    root/key/neuron, unless NEURON_COMPILE_CACHE_URL names one). Never deleted: entries are keyed by the
    graph's hash inside a directory keyed by everything else. Must run before any XLA computation."""
    import torch_xla.runtime as xr

    base = Path(root or Path.home() / ".cache" / "axonserve" / "xla") / key
    path = base / f"rank{rank}"
    path.mkdir(parents=True, exist_ok=True)
    xr.initialize_cache(str(path), readonly=False)
    if on_neuron():
        os.environ.setdefault("NEURON_COMPILE_CACHE_URL", str(base / "neuron"))
    (base / "key.json").write_text(json.dumps({"key": key, "created": time.time()}))
    return path


@dataclass
class CompileCounter:
    """XLA's own counters (torch_xla.debug.metrics), read as deltas: how many graphs were compiled
    (and how long each took), and what the persistent cache did."""

    seen: int = 0  # CompileTime samples already reported
    cache: dict[str, int] = field(default_factory=dict)

    CACHE_COUNTERS = ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheDeserializeFailure")

    def compiles(self) -> list[float]:
        """Seconds of each compilation since the last call."""
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        if data is None:
            return []
        count, samples = data[0], data[2]
        new = count - self.seen
        self.seen = count
        return [ns / 1e9 for _, ns in samples[-new:]] if new > 0 else []

    def total(self) -> int:
        import torch_xla.debug.metrics as met

        return int(met.counter_value("UncachedCompile") or 0)

    def cache_deltas(self) -> dict[str, int]:
        """Persistent-cache hits, misses and load failures since the last call. PJRT CPU finds its
        entries but cannot deserialize them (load failures); a hit needs a device that can."""
        import torch_xla.debug.metrics as met

        out = {}
        for name in self.CACHE_COUNTERS:
            v = int(met.counter_value(name) or 0)
            out[name] = v - self.cache.get(name, 0)
            self.cache[name] = v
        return out
