"""Fused C++ CPU kernels (csrc/cpu_kernels.cpp), compiled on first use for this machine's CPU.

Built once with torch's JIT extension builder (ninja + the system C++ compiler, `-march=native`)
into ~/.cache/axonserve/native/<hash of source, torch version and CPU flags>, then loaded in
milliseconds by every later process; `scripts/setup` builds it up front. Where it cannot be built
(no compiler) or AXONSERVE_NATIVE=0, `kernels()` returns None and callers use their torch path.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import structlog
import torch

log = structlog.get_logger()

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# -fopenmp: at::parallel_for runs on OpenMP; libgomp.so.1 resolves to the copy torch already loaded
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-fopenmp"]
_state: dict[str, ModuleType | None] = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build_dir() -> Path:
    h = hashlib.sha256()
    headers = sorted(_SOURCE.parent.glob("*.h"))  # included by the one source file
    for part in (
        _SOURCE.read_bytes(),
        *(p.read_bytes() for p in headers),
        torch.__version__.encode(),
        _cpu_flags().encode(),
        " ".join(_FLAGS).encode(),
    ):
        h.update(part)
    root = Path(os.environ.get("AXONSERVE_CACHE_DIR") or Path.home() / ".cache" / "axonserve")
    return root / "native" / h.hexdigest()[:16]


def enabled() -> bool:
    return os.environ.get("AXONSERVE_NATIVE", "1") not in ("0", "false", "no")


def kernels() -> ModuleType | None:
    """The compiled module, or None (disabled, or the build failed: logged once per process)."""
    if "mod" not in _state:
        _state["mod"] = _load() if enabled() else None
    return _state["mod"]


def disable() -> None:
    """No kernels in this process from now on (a worker on the XLA device: they take host tensors)."""
    _state["mod"] = None


def for_dtype(dtype: torch.dtype) -> ModuleType | None:
    """The kernels for a model running in `dtype` (they are written for float32 and bfloat16)."""
    return kernels() if dtype in (torch.float32, torch.bfloat16) else None


_STALE_LOCK_S = 600  # a build lock this old was left by a killed build: torch would wait on it forever


def _load() -> ModuleType | None:
    out = build_dir()
    name = "axonserve_cpu_kernels_" + out.name
    so, ready = out / f"{name}.so", out / "READY"
    try:
        if ready.exists() and so.exists():  # built before: import it directly (no ninja, no lock)
            return _import(name, so)
        from torch.utils import cpp_extension

        try:
            import ninja  # the PyPI package: its binary need not be on PATH (.venv/bin is not, unactivated)

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        out.mkdir(parents=True, exist_ok=True)
        lock = out / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        log.info("native.building", source=str(_SOURCE), dir=str(out))
        mod = cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(out),
            verbose=False,
        )
        ready.touch()
        log.info("native.built", dir=str(out))
        return mod
    except Exception as e:  # no compiler/ninja, a compile error, an unwritable cache: the torch path still works
        log.warning("native.unavailable", error=f"{type(e).__name__}: {str(e)[-400:]}")
        return None


def _import(name: str, path: Path) -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_build(path: str | Path) -> ModuleType:
    """Another checkout's compiled kernels (its .so), beside this one's: the A/B scripts' base."""
    path = Path(path)
    return _import(path.name.split(".")[0], path)


if __name__ == "__main__":  # python -m axonserve.neuron.ops.native: build now (scripts/setup)
    ok = kernels() is not None
    print(f"axonserve native kernels: {'ready in ' + str(build_dir()) if ok else 'unavailable (torch fallback)'}")
    sys.exit(0)
