"""CPU the OpenAI frontend process spends per generated token while streaming (issue 33).

`python scripts/frontend_cpu.py --tree /work/main --tree . [--runs 3] [--streams 32] [--tokens 512]`

One `axonserve serve` per source tree (PYTHONPATH=tree) serves the null model (bench/step.py: the
real scheduler, worker, bus and frontend, a model that costs nothing) side by side; the runs go
interleaved (run i of every tree before run i+1 of any), so load from other work on the machine
falls on all trees alike. A run streams `--streams` concurrent /v1/completions (temperature 1:
the null model's flat logits give random ids of the 512-token vocabulary, ordinary text pieces,
so the detokenizer and the SSE chunks do real work; `ignore_eos`, `max_tokens`) and reads every
server process's CPU time (Linux /proc: user + system) before and after. Prints, per tree, CPU
µs per generated token of the frontend (and of the other processes): median and range. Wall
times on a shared machine are noise; CPU per token is what this compares.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from axonserve.bench.step import NULL_VOCAB, _cpu_s, make_null_model  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (Linux /proc)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _actor_names(pid: int) -> dict[str, int]:
    """The serve process's actors by name ("frontend", "scheduler", ...) from their argv spec."""
    names = {}
    for c in _children(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"axonserve.actors.entry" in argv:
            spec = json.loads(argv[argv.index(b"axonserve.actors.entry") + 1])
            names[spec.get("name") or spec["kind"]] = c
    return names


class Server:
    def __init__(self, tree: str, model: str, streams: int, tokens: int):
        self.tree, self.port = os.path.abspath(tree), _free_port()
        env = dict(os.environ, PYTHONPATH=self.tree)
        cmd = [sys.executable, "-m", "axonserve.cli", "serve", model, "--port", str(self.port)]
        cmd += ["--served-model-name", "null", "--max-num-seqs", str(streams), "--log-level", "warning"]
        cmd += ["--num-kv-blocks", str(streams * (tokens // 16 + 4))]
        self.proc = subprocess.Popen(cmd, cwd=self.tree, env=env, stdout=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        self.actors: dict[str, int] = {}

    async def ready(self, session: aiohttp.ClientSession, timeout: float = 180.0) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                async with session.get(f"{self.url}/health") as r:
                    if r.status == 200:
                        self.actors = _actor_names(self.proc.pid)
                        return
            except aiohttp.ClientError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server of {self.tree} exited ({self.proc.returncode})")
            await asyncio.sleep(0.5)
        raise TimeoutError(f"server of {self.tree} not ready")

    def cpu(self) -> dict[str, float]:
        return {name: _cpu_s(pid) or 0.0 for name, pid in self.actors.items()}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _stream(session: aiohttp.ClientSession, url: str, i: int, tokens: int) -> tuple[int, int]:
    """One streaming completion; returns (generated tokens from usage, SSE events)."""
    body = {
        "model": "null",
        "prompt": [1 + (7 * i + j) % (NULL_VOCAB - 1) for j in range(8)],
        "max_tokens": tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events, generated = 0, 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                events += 1
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    generated = chunk["usage"]["completion_tokens"]
    return generated, events


async def _run(server: Server, session: aiohttp.ClientSession, streams: int, tokens: int) -> dict:
    c0 = server.cpu()
    res = await asyncio.gather(*(_stream(session, server.url, i, tokens) for i in range(streams)))
    c1 = server.cpu()
    generated = sum(g for g, _ in res)
    per_token = {k: (c1[k] - c0[k]) / generated * 1e6 for k in c0}
    return {"generated": generated, "events": sum(e for _, e in res), "cpu_us_per_token": per_token}


async def main(args: argparse.Namespace) -> None:
    from axonserve.neuron.model_source import resolve_model

    with tempfile.TemporaryDirectory(prefix="axonserve-null-") as d:
        model = make_null_model(d, resolve_model("SmolLM2-135M-Instruct"))
        servers = [Server(t, model, args.streams, args.tokens) for t in args.tree]
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
                for s in servers:
                    await s.ready(session)
                    await _run(s, session, args.streams, 32)  # warm-up
                results: dict[str, list[dict]] = {s.tree: [] for s in servers}
                for i in range(args.runs):
                    for s in servers:
                        r = await _run(s, session, args.streams, args.tokens)
                        results[s.tree].append(r)
                        cells = " ".join(f"{k}={v:.1f}" for k, v in sorted(r["cpu_us_per_token"].items()))
                        print(f"run {i} {s.tree}: {r['generated']} tokens, {r['events']} events; CPU µs/token {cells}")
        finally:
            for s in servers:
                s.stop()
    print(f"CPU µs per generated token ({args.streams} streams x {args.tokens} tokens, {args.runs} runs):")
    for tree, runs in results.items():
        for name in sorted(runs[0]["cpu_us_per_token"]):
            vs = [r["cpu_us_per_token"][name] for r in runs]
            print(f"  {tree:<24} {name:>10}: median {statistics.median(vs):7.1f}  range {min(vs):.1f}-{max(vs):.1f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="a source tree to serve from (repeatable)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=512)
    asyncio.run(main(ap.parse_args()))
