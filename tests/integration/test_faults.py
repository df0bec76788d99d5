"""Faults end to end: a dying actor fails in-flight requests (no hang), /health turns 503 and
the launcher exits non-zero; SIGTERM to the launcher leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from frontends.server import health, serve


def session_pids(sid: int) -> dict[int, str]:
    """pid -> cmdline of every live process in session `sid` (the launcher's)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            out[int(d)] = cmd
    return out


def stream_until_error(url: str, body: dict, fault, after: int = 5, read_timeout: float = 30) -> dict | None:
    """Stream a completion, call `fault()` after `after` chunks, return the error chunk's error
    (None if the stream ended without one). The read timeout bounds detection: a hang that
    is never noticed fails the caller here."""
    chunks = 0
    with (
        httpx.Client(timeout=httpx.Timeout(10, read=read_timeout)) as http,
        http.stream("POST", url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return data["error"]
            chunks += 1
            if chunks == after:
                fault()
    return None


def actor_pid(sid: int, kind: str) -> int:
    for pid, cmd in session_pids(sid).items():
        if "axonserve.actors.entry" in cmd and f'"kind":"{kind}"' in cmd:
            return pid
    raise AssertionError(f"no {kind} process in session {sid}")


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", ["worker", "scheduler"])
def test_dead_actor_fails_requests_and_health(tiny_llama_dir, victim):
    # fail-stop (no restarts): tests/integration/test_self_healing.py has the healing
    with serve(tiny_llama_dir, "--num-kv-blocks", "512", "--max-model-len", "2048", "--max-restarts", "0") as srv:
        sid = srv.proc.pid
        body = {
            "model": tiny_llama_dir,
            "prompt": "Once upon a time",
            "max_tokens": 1900,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        t_kill = None

        def kill() -> None:
            nonlocal t_kill
            os.kill(actor_pid(sid, victim), signal.SIGKILL)
            t_kill = time.monotonic()

        error = stream_until_error(srv.base_url, body, kill)
        assert t_kill is not None, "stream ended before the kill"
        assert error is not None, "the stream must end with an error chunk, not silently"
        assert time.monotonic() - t_kill < 10
        assert victim in error["message"] or "engine" in error["message"]
        # health turns 503 while the launcher flushes errors, then everything stops
        wait_until(lambda: health(srv.base_url) in (503, None), 10, "/health 503")
        code = srv.proc.wait(30)
        assert code != 0
        wait_until(lambda: not session_pids(sid), 10, "all actor processes to exit")


@pytest.mark.timeout(120)
def test_sigterm_to_launcher_leaves_no_process(tiny_llama_dir):
    with serve(tiny_llama_dir, "--num-kv-blocks", "64", "--num-workers", "1") as srv:
        sid = srv.proc.pid
        pids = session_pids(sid)
        assert len(pids) >= 4, pids  # launcher, frontend, scheduler, worker
        srv.proc.send_signal(signal.SIGTERM)  # only the launcher, not the group
        assert srv.proc.wait(30) == 0
        wait_until(lambda: not session_pids(sid), 10, "all actor processes to exit")


@pytest.mark.timeout(120)
def test_sigterm_during_startup_is_a_clean_stop(tiny_llama_dir, tmp_path):
    """SIGTERM while the actors still start (they are spawned, not all ready): exit code 0,
    not 'startup failed', and no process left."""
    import subprocess
    import sys

    from frontends.server import REPO, free_port, stop_group

    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "axonserve.cli",
            "serve",
            tiny_llama_dir,
            "--port",
            str(free_port()),
            "--num-kv-blocks",
            "64",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until(lambda: len(session_pids(proc.pid)) >= 3, 60, "actors to be spawned")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        text = (tmp_path / "serve.log").read_text()
        assert code == 0, text[-3000:]
        assert "startup_failed" not in text
        wait_until(lambda: not session_pids(proc.pid), 10, "all actor processes to exit")
    finally:
        stop_group(proc)
        log.close()


@pytest.mark.timeout(120)
def test_sigkill_of_launcher_takes_children_down(tiny_llama_dir):
    with serve(tiny_llama_dir, "--num-kv-blocks", "64") as srv:
        sid = srv.proc.pid
        srv.proc.kill()
        srv.proc.wait(10)
        wait_until(lambda: not session_pids(sid), 15, "orphaned actors to exit")


@pytest.mark.timeout(240)
def test_step_longer_than_heartbeat_timeout_is_not_a_hang(smollm2_dir):
    """A worker's heartbeats come from their own thread: a prefill that blocks its event loop
    for several heartbeat timeouts is work, not a hang (the step timeout bounds it instead)."""
    from axonserve.config import EngineConfig
    from axonserve.frontends.offline import LLM
    from axonserve.protocol.messages import SamplingParams

    config = EngineConfig(
        model=smollm2_dir,
        num_kv_blocks=160,
        max_num_batched_tokens=2048,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=1.0,
    )
    with LLM(config=config) as llm:
        prompt = list(range(1000, 3000))  # one 2000-token prefill step: seconds on 2 cores
        t0 = time.monotonic()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0]
        assert out.outputs[0].finish_reason == "length"
        assert time.monotonic() - t0 > config.heartbeat_timeout_s, "the step must outlast the heartbeat timeout"


@pytest.mark.timeout(120)
def test_worker_failing_at_load_is_reported_cleanly(tiny_llama_dir, tmp_path):
    """A rank that cannot build the model (here: heads that do not split over the ranks) fails
    start-up with its reason; the scheduler, still waiting for its configuration, must not crash."""
    import subprocess
    import sys

    from frontends.server import REPO

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "axonserve.cli",
            "serve",
            tiny_llama_dir,
            "--port",
            "0",
            "--num-kv-blocks",
            "32",
            "-tp",
            "3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "do not split over 3 tensor-parallel ranks" in out
    assert "on_peer_failed_error" not in out, out[-3000:]  # the scheduler took the news without crashing
