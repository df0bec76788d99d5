"""An encoder of the pool dying mid-request: its job moves to the other encoder and the
request still succeeds (same output); with no encoder left, image requests fail at once
with a clear 503 while text requests and /health keep working. Never a hang."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from frontends.server import serve
from frontends.test_openai_api import _error, _metric
from integration.test_faults import session_pids, wait_until

from multimodal.test_chat_images import as_parts, post_chat, reference


def encoder_pids(sid: int) -> dict[str, int]:
    out = {}
    for pid, cmd in session_pids(sid).items():
        for name in ("encoder-0", "encoder-1"):
            if "axonserve.actors.entry" in cmd and f'"name":"{name}"' in cmd:
                out[name] = pid
    return out


def chat(http: httpx.Client, parts: tuple) -> httpx.Response:
    return post_chat(http, as_parts(parts))


@pytest.mark.timeout(240)
def test_encoder_death_retries_then_fails_clearly(tiny_llava_dir):
    args = (
        "--encoder-workers",
        "2",
        "--served-model-name",
        "m",
        "--num-kv-blocks",
        "400",
        "--block-size",
        "4",
        "--max-model-len",
        "256",
        "--threads",
        "1",
        "--max-restarts",  # encoders lost for good (the pool shrinks): test_self_healing.py restarts them
        "0",
    )
    with serve(tiny_llava_dir, *args) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as http:
        pids = encoder_pids(srv.proc.pid)
        assert set(pids) == {"encoder-0", "encoder-1"}
        os.kill(pids["encoder-0"], signal.SIGSTOP)  # hung mid-job: whatever it takes never comes back
        cases = [("First: ", 31), ("Second: ", 32)]
        results: dict[int, httpx.Response] = {}

        def send(i: int) -> None:
            results[i] = chat(http, cases[i])

        threads = []
        for i in range(2):  # round robin: one of the two lands on the stopped encoder
            threads.append(threading.Thread(target=send, args=(i,)))
            threads[-1].start()
            time.sleep(0.5)
        wait_until(lambda: len(results) == 1, 20, "the request on the live encoder")
        os.kill(pids["encoder-0"], signal.SIGKILL)  # dies with a job in flight
        for t in threads:
            t.join(60)
        assert len(results) == 2
        for i, r in results.items():
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == reference(tiny_llava_dir, cases[i])
        wait_until(lambda: _metric(http, "axonserve:mm_encode_retries_total") >= 1, 10, "the retry counted")

        os.kill(pids["encoder-1"], signal.SIGKILL)  # no encoder left
        t0 = time.monotonic()
        r = chat(http, ("Third: ", 33))
        assert "no image encoder is alive" in _error(r, 503)["message"]
        assert time.monotonic() - t0 < 10
        text = chat(http, ("Only text now.",))
        assert text.status_code == 200 and text.json()["choices"][0]["message"]["content"]
        assert http.get("/health").status_code == 200


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", ["encoder-0", "router"])
def test_encoder_or_router_killed_is_restarted_and_requests_succeed(tiny_llava_dir, victim):
    """Self-healing: a killed encoder (its job goes to the other, or waits for its replacement) or
    the router (the scheduler sends its waiting image requests again) is replaced; every image chat
    in flight still gets transformers' answer, and the pool is whole again afterwards."""
    args = ("--encoder-workers", "2", "--served-model-name", "m", "--num-kv-blocks", "400", "--block-size", "4",
            "--max-model-len", "256", "--threads", "1", "--heartbeat-timeout", "4")  # fmt: skip
    cases = [("First: ", 41), ("Second: ", 42), ("Third: ", 43), ("Fourth: ", 44)]
    with serve(tiny_llava_dir, *args) as srv, httpx.Client(base_url=srv.base_url, timeout=120) as http:
        sid = srv.proc.pid
        pid = next(p for p, cmd in session_pids(sid).items() if f'"name":"{victim}"' in cmd)
        os.kill(pid, signal.SIGSTOP)  # its jobs stall ...
        results: dict[int, httpx.Response] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, chat(http, cases[i]))) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)  # ... then it dies with them in flight
        for t in threads:
            t.join(120)
        assert sorted(results) == [0, 1, 2, 3]
        for i, r in results.items():
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == reference(tiny_llava_dir, cases[i])
        wait_until(lambda: any(f'"name":"{victim}"' in c for c in session_pids(sid).values()), 30, "a replacement")
        assert chat(http, (45, "Again.")).status_code == 200
        assert http.get("/health").status_code == 200
