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
