"""A busy actor is not a dead one: a request whose chat template burns CPU for several heartbeat
timeouts (rendered on the frontend's template pool, allowed by --trust-request-chat-template and a
long --chat-template-timeout) neither stalls other requests' streams nor gets any actor declared
dead and replaced: every actor beats from a thread of its own (actors/runtime.py), and the frontend
keeps request-sized work off its event loop."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import threading
import time

import httpx
import pytest
from frontends.server import health, serve

from .test_faults import session_pids

HEARTBEAT_TIMEOUT_S = 3
RENDER_S = 15.0  # the slow template's render, calibrated here; the server's may run slower (shared CPUs)
INNER = 10_000


def burner(outer: int) -> str:
    """A chat template that loops outer x INNER times (no output: the output bound is not hit;
    the sandbox's deadline is checked at every call), then renders the last message."""
    return (
        f"{{%- for i in range({outer}) %}}{{%- for j in range({INNER}) %}}{{%- set x = i * j %}}"
        "{%- endfor %}{%- endfor %}{{ messages[-1]['content'] }}"
    )


def calibrated_outer(model_dir: str, seconds: float) -> int:
    """Outer iterations for a render of about `seconds` through the server's own render path."""
    from axonserve.frontends.chat_template import render_bounded
    from axonserve.frontends.tokenizer import Tokenizer

    tok = Tokenizer.load(model_dir)
    msgs = [{"role": "user", "content": "hi"}]
    outer = 100
    while True:
        t0 = time.perf_counter()
        asyncio.run(
            render_bounded(functools.partial(tok.encode_chat, msgs, chat_template=burner(outer)), 60.0, 1 << 20)
        )
        took = time.perf_counter() - t0
        if took > 0.5:
            return min(100_000, math.ceil(outer * seconds / took))
        outer *= 4


def stream_completion(base_url: str) -> tuple[int, float]:
    """(text chunks, seconds) of one streamed completion of 8 tokens, which must end with [DONE]."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True, "stream": True, "temperature": 0}
    t0, chunks, done = time.monotonic(), 0, False
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=httpx.Timeout(20)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert "error" not in data, data
                chunks += bool(data["choices"] and data["choices"][0]["text"])
    assert done
    return chunks, time.monotonic() - t0


def actor_pids(sid: int) -> dict[int, str]:
    return {pid: cmd for pid, cmd in session_pids(sid).items() if "axonserve.actors.entry" in cmd}


@pytest.mark.timeout(150)
def test_cpu_heavy_chat_template_is_not_a_dead_frontend(tiny_llama_dir):
    outer = calibrated_outer(tiny_llama_dir, RENDER_S)
    args = (
        "--trust-request-chat-template",
        "--chat-template-timeout", "60",
        "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
        "--max-model-len", "512",
        "--num-kv-blocks", "256",
        "--log-level", "warning",
    )  # fmt: skip
    with serve(tiny_llama_dir, *args) as srv:
        before = actor_pids(srv.proc.pid)
        kinds = {k for k in ("frontend", "scheduler", "worker") if any(f'"kind":"{k}"' in c for c in before.values())}
        assert kinds == {"frontend", "scheduler", "worker"}, before
        slow: dict = {}

        def slow_request() -> None:
            body = {
                "messages": [{"role": "user", "content": "hello"}],
                "chat_template": burner(outer),
                "max_tokens": 4,
                "temperature": 0,
            }
            t0 = time.monotonic()
            r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120)
            slow.update(status=r.status_code, body=r.text, seconds=time.monotonic() - t0)

        t = threading.Thread(target=slow_request, daemon=True)
        t.start()
        rounds = 0
        while t.is_alive():
            chunks, took = stream_completion(srv.base_url)
            assert chunks >= 1 and took < 15, (chunks, took)
            assert health(srv.base_url, timeout=5) == 200
            rounds += 1
            time.sleep(0.5)
        t.join()
        assert slow["status"] == 200, slow
        assert slow["seconds"] > 2 * HEARTBEAT_TIMEOUT_S, f"the render ({slow['seconds']:.1f} s) is too short to test"
        assert rounds >= 3, rounds  # others were served all along
        assert health(srv.base_url) == 200
        assert actor_pids(srv.proc.pid) == before, "an actor was restarted or died"
        assert srv.proc.poll() is None
