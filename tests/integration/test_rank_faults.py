"""One rank of a 2-rank (tensor-parallel) engine dies or hangs mid-generation: the stream ends with
an error chunk naming the failure, /health turns 503, every process exits and the launcher's exit
code is non-zero.

A hang is SIGSTOP: the stopped rank sends nothing, and its peer blocks inside a gloo collective
until the collective timeout (`dist_timeout_s`, 15 s) makes it fail with CollectiveError; the
worker then reports itself failed, and the supervisor SIGKILLs the stopped rank at shutdown."""

from __future__ import annotations

import os
import signal

import pytest
from frontends.server import health, serve

from .test_faults import session_pids, stream_until_error, wait_until


def worker_pid(sid: int, rank: int) -> int:
    for pid, cmd in session_pids(sid).items():
        if "axonserve.actors.entry" in cmd and f'"name":"worker-{rank}"' in cmd:
            return pid
    raise AssertionError(f"no worker-{rank} process in session {sid}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "sig, rank",
    [
        (signal.SIGKILL, 1),
        (signal.SIGSTOP, 1),
        (signal.SIGSTOP, 0),
    ],
    ids=["rank1-dies", "rank1-hangs", "rank0-hangs"],
)
def test_rank_fault_mid_generation_fails_requests_and_stops_engine(tiny_llama_dir, sig, rank):
    args = ("--num-kv-blocks", "512", "--max-model-len", "2048", "--tensor-parallel-size", "2", "--max-restarts", "0")
    with serve(tiny_llama_dir, *args) as srv:
        sid = srv.proc.pid
        body = {
            "model": tiny_llama_dir,
            "prompt": "Once upon a time",
            "max_tokens": 1900,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        victim = None

        def fault() -> None:
            nonlocal victim
            victim = worker_pid(sid, rank)
            os.kill(victim, sig)

        error = stream_until_error(srv.base_url, body, fault, read_timeout=60)
        assert victim is not None, "the stream ended before the fault"
        assert error is not None, "the stream must end with an error chunk, not silently"
        assert "worker" in error["message"], error
        if sig == signal.SIGSTOP:
            assert "died or hung" in error["message"] or "heartbeat" in error["message"], error
        wait_until(lambda: health(srv.base_url) in (503, None), 30, "/health 503")
        assert srv.proc.wait(60) != 0
        wait_until(lambda: not session_pids(sid), 20, "all actor processes (the stopped rank too) to exit")
