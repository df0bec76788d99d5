"""Run `axonserve serve` as a real subprocess for HTTP tests (importable by any test).

    with serve(model_dir, "--max-num-seqs", "16") as srv:
        openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")

The whole process group is killed on exit (SIGTERM, then SIGKILL), so no actor survives a
failing test. Its output goes to a log file whose tail is shown if start-up fails; the file
is kept only when the block raised.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from axonserve.actors.supervisor import free_port
from axonserve.bench.servers import http_status, stop_group

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Served:
    base_url: str
    proc: subprocess.Popen
    log_path: str

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


def health(base_url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of /health, or None when nothing answers."""
    return http_status(base_url + "/health", timeout)


@contextlib.contextmanager
def serve(
    model_dir: str, *args: str, start_timeout: float = 180.0, python: str | None = None, env: dict | None = None
) -> Iterator[Served]:
    """python: the interpreter to serve with (another venv's, say .venv-xla's); env: extra variables."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="axonserve-", suffix=".log", delete=False)
    cmd = [python or sys.executable, "-m", "axonserve.cli", "serve", model_dir, "--port", str(port), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    served = Served(f"http://127.0.0.1:{port}", proc, log.name)
    failed = True
    try:
        deadline = time.monotonic() + start_timeout
        while health(served.base_url) != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{served.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not healthy in {start_timeout}s:\n{served.log_tail()}")
            time.sleep(0.2)
        yield served
        failed = False
    finally:
        stop_group(proc)
        log.close()
        if not failed:
            os.unlink(log.name)
