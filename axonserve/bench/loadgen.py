"""Async load generator: streaming /v1/completions at a fixed concurrency or Poisson rate.

Uses aiohttp (as vLLM's `bench serve` does: its HTTP parser is C) + our own SSE parser (not the
openai client) so each chunk is timestamped when its bytes arrive. The client shares the
machine with the server under test: httpx's pure-Python stack (h11, anyio) took a noticeable share
of a core at 32 streams (docs/benchmarks.md#fig-bench). Output tokens are taken from `usage`
(stream_options.include_usage) when the server sends it, else counted as content chunks.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import aiohttp
import numpy as np

from axonserve.bench.dataset import RequestSpec
from axonserve.bench.sse import SSEParser
from axonserve.bench.stats import RequestResult


def is_loopback(base_url: str) -> bool:
    host = urlparse(base_url).hostname or ""
    if host == "localhost":
        return True
    try:
        return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


@dataclass
class LoadConfig:
    base_url: str  # http://host:port (without /v1)
    model: str
    concurrency: int | None = None  # None: unbounded (rate decides)
    request_rate: float | None = None  # req/s, Poisson arrivals; None: all at once
    max_duration_s: float | None = None
    seed: int = 0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    progress: bool = True
    desc: str = ""


def request_body(cfg: LoadConfig, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:  # vLLM extensions: the stream always runs to max_tokens
        body.update(ignore_eos=True, min_tokens=spec.max_tokens)
    body.update(cfg.extra_body)
    return body


async def send_one(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], prompt_len: int, t0: float
) -> RequestResult:
    res = RequestResult(ok=False, prompt_len=prompt_len)
    parser = SSEParser()
    chunks = 0
    usage_tokens: int | None = None
    last = start = time.perf_counter()
    res.start = start - t0
    try:
        async with client.post(url, json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            async for raw in r.content.iter_any():
                now = time.perf_counter()
                for data in parser.feed(raw):
                    if data.strip() == "[DONE]":
                        continue
                    msg = json.loads(data)
                    if "error" in msg:
                        res.error = str(msg["error"])[:200]
                        return res
                    if msg.get("usage"):
                        usage_tokens = msg["usage"].get("completion_tokens", usage_tokens)
                    choices = msg.get("choices") or ()
                    for c in choices:
                        res.finish_reason = c.get("finish_reason") or res.finish_reason
                    if any(c.get("text") for c in choices):
                        if chunks == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        chunks += 1
                        last = now
        res.e2e = time.perf_counter() - start
        res.output_tokens = usage_tokens if usage_tokens is not None else chunks
        # a stream cut off before its finish_reason is a failure, not a short success
        res.ok = chunks > 0 and res.finish_reason is not None
        if not res.ok:
            res.error = "no output" if chunks == 0 else f"stream ended without finish_reason after {chunks} chunks"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc or "requests", unit="req", disable=not enabled, dynamic_ncols=True, leave=False)


async def run_load(cfg: LoadConfig, specs: list[RequestSpec]) -> tuple[list[RequestResult], float]:
    """Send every spec (arrival order = list order); return results and the run's wall time.

    Requests still running at `max_duration_s` are cancelled and reported as failed; those not
    yet sent by then are not sent at all.
    """
    url = cfg.base_url.rstrip("/") + "/v1/completions"
    rng = np.random.default_rng(cfg.seed)
    sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    connector = aiohttp.TCPConnector(limit=cfg.concurrency or len(specs) or 1)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s, sock_connect=30.0)
    results: list[RequestResult] = []
    bar = _progress(len(specs), cfg.desc, cfg.progress)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as client:
        t0 = time.perf_counter()
        deadline = t0 + cfg.max_duration_s if cfg.max_duration_s else None

        async def one(i: int, spec: RequestSpec) -> None:
            if sem is not None:
                await sem.acquire()
            sent = False
            try:
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                sent = True
                r = await send_one(client, url, request_body(cfg, spec), spec.prompt_len, t0)
                r.index = i
                results.append(r)
                bar.update(1)
            except asyncio.CancelledError:
                if sent:
                    results.append(
                        RequestResult(ok=False, prompt_len=spec.prompt_len, index=i, error="cancelled at max duration")
                    )
                raise
            finally:
                if sem is not None:
                    sem.release()

        tasks: list[asyncio.Task] = []
        for i, spec in enumerate(specs):
            if cfg.request_rate:
                await asyncio.sleep(float(rng.exponential(1.0 / cfg.request_rate)))
            if deadline is not None and time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.create_task(one(i, spec)))
        remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
    bar.close()
    return results, duration
