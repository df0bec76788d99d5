"""Engine death seen from HTTP: in-flight requests end with errors within seconds, never hang."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from .server import health, serve

pytestmark = pytest.mark.timeout(240)


def actor_pid(group: int, kind: str) -> int:
    """The pid of the actor process of `kind` inside the server's process group."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            if os.getpgid(int(entry)) == group and f'"kind":"{kind}"' in cmd:
                return int(entry)
        except (OSError, ProcessLookupError):
            continue
    raise LookupError(f"no {kind} actor in process group {group}")


@pytest.mark.parametrize("victim", ["worker", "scheduler"])
async def test_actor_death_fails_in_flight_requests(tiny_llama_dir, victim):
    # fail-stop (--max-restarts 0): healing is tests/integration/test_self_healing.py's
    with serve(tiny_llama_dir, "--max-num-seqs", "4", "--num-kv-blocks", "1024", "--max-restarts", "0") as srv:
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as h:
            plain = asyncio.create_task(h.post("/v1/completions", json=body))
            events: list[str] = []
            async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                lines = resp.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
                        break
                os.kill(actor_pid(srv.proc.pid, victim), signal.SIGKILL)
                killed = time.monotonic()
                async for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
            ended = time.monotonic() - killed
            status = health(srv.base_url)
            r = await asyncio.wait_for(plain, 30)

    assert ended < 10, f"stream took {ended:.1f}s to end after the {victim} died"
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 500 and victim in err["message"]
    assert status in (503, None)  # unhealthy, or already shut down by the supervisor
    assert r.status_code in (500, 503) and "error" in r.json()


async def test_client_disconnect_aborts_on_engine(tiny_llama_dir):
    """With one sequence slot, a follow-up request only runs promptly if the abandoned
    request was aborted (generating its 2000 tokens would take several seconds)."""
    with serve(tiny_llama_dir, "--max-num-seqs", "1", "--num-kv-blocks", "1024") as srv:
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as h:
            async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        break
            t = time.monotonic()
            r = await h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and time.monotonic() - t < 3

            with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up
                await h.post("/v1/completions", json=body, timeout=0.5)
            t = time.monotonic()
            r = await h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and time.monotonic() - t < 3
