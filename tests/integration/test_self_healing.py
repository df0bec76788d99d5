"""Self-healing end to end: a killed or hung actor is replaced and no request is lost.

Each test streams concurrent greedy completions through the real server, injects the fault after
the first tokens, and checks every stream ends with HTTP 200 and finish_reason "length", its text
equal to the same request's text without the fault (served first, on the same server); /health is
200 again afterwards, and /metrics counts the restart. A restart storm past --max-restarts ends in
the fail-stop of tests/integration/test_faults.py."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
from frontends.server import health, serve

from .test_faults import actor_pid, session_pids, wait_until
from .test_rank_faults import worker_pid

N_TOKENS = 300  # long enough that every stream is still running when the fault comes
PROMPTS = [f"Story {i}: once upon a time, in a land of {i} rivers," for i in range(16)]


def body(prompt: str, stream: bool = True) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": N_TOKENS,
        "min_tokens": N_TOKENS,
        "temperature": 0,
        "stream": stream,
    }


def completions(base_url: str, prompts: list[str]) -> list[str]:
    with httpx.Client(base_url=base_url, timeout=120) as http:
        out = []
        for p in prompts:
            r = http.post("/v1/completions", json=body(p, stream=False))
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
        return out


class Streams:
    """Concurrent streamed completions; `first_tokens` is set once every stream has its first chunks."""

    def __init__(self, base_url: str, prompts: list[str]):
        self.base_url = base_url
        self.tokens_before = metric(base_url, "vllm:generation_tokens_total")
        self.texts: list[str] = [""] * len(prompts)
        self.finish: list[str | None] = [None] * len(prompts)
        self.status: list[int] = [0] * len(prompts)
        self.errors: list[str] = []
        self.chunks = [0] * len(prompts)
        self.times: list[list[float]] = [[] for _ in prompts]  # each chunk's arrival (monotonic)
        self.threads = [
            threading.Thread(target=self._run, args=(base_url, i, p), daemon=True) for i, p in enumerate(prompts)
        ]
        for t in self.threads:
            t.start()

    def _run(self, base_url: str, i: int, prompt: str) -> None:
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(10, read=120)) as http,
                http.stream("POST", base_url + "/v1/completions", json=body(prompt)) as r,
            ):
                self.status[i] = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        self.errors.append(data["error"]["message"])
                        return
                    choice = data["choices"][0]
                    self.texts[i] += choice["text"]
                    self.chunks[i] += 1
                    self.times[i].append(time.monotonic())
                    self.finish[i] = choice.get("finish_reason") or self.finish[i]
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.errors.append(repr(e))

    def started(self, n: int = 8) -> bool:
        """Every stream has its first chunk and the engine has made n tokens for each on average:
        judged by the server's own count, since a client thread starved of CPU reads its chunks late,
        in a burst (the fault must come while the engine generates, not after)."""
        made = metric(self.base_url, "vllm:generation_tokens_total") - self.tokens_before
        return all(self.chunks) and made >= n * len(self.chunks)

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a stream never ended"


def metric(base_url: str, name: str, labels: str = "") -> float:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if labels in m[1]:
            total += float(m[2])
    return total


def assert_healed(srv, streams: Streams, want: list[str], actor: str, t_fault: float, in_flight: float = 0.5) -> float:
    """Every stream finished whole and equal to the no-fault text; returns the seconds from the
    fault to the first token any stream received after it (printed with the time to the last)."""
    streams.join(180)
    assert not streams.errors, streams.errors
    spans = [(round(ts[0] - t_fault, 2), round(ts[-1] - t_fault, 2), len(ts)) if ts else None for ts in streams.times]
    # client threads start and read late under load, so some streams may be done before the fault;
    # at least `in_flight` of them must still be running for the test to test anything
    running = sum(bool(ts) and ts[-1] > t_fault for ts in streams.times)
    assert running >= in_flight * len(streams.times), f"too few streams in flight at the fault: {spans}"
    # per stream: the end of its longest silence around the fault (the pause), from the fault
    ends = []
    for ts in streams.times:
        gaps = [(b - a, b) for a, b in zip(ts, ts[1:]) if b > t_fault]
        if gaps:
            ends.append(max(gaps)[1] - t_fault)
    ends.sort()
    resumed = ends[len(ends) // 2] if ends else float("nan")
    last = max(t for ts in streams.times for t in ts) - t_fault
    print(f"\n{actor}: streams resumed {resumed:.2f} s after the fault (median; max {max(ends, default=0):.2f}),"
          f" all done {last:.2f} s after")  # fmt: skip
    assert not streams.errors, streams.errors
    assert streams.status == [200] * len(want)
    assert streams.finish == ["length"] * len(want), streams.finish
    assert streams.texts == want
    wait_until(lambda: health(srv.base_url) == 200, 60, "/health 200 again (the replacement ready)")
    wait_until(
        lambda: metric(srv.base_url, "axonserve:actor_restarts_total", f'actor="{actor}"') >= 1, 20, "restart counted"
    )
    return resumed


def serve_tiny(model_dir: str, *args: str):
    return serve(
        model_dir,
        "--served-model-name", "tiny",
        "--num-kv-blocks", "512",
        "--max-model-len", "512",
        "--heartbeat-timeout", "4",
        *args,
    )  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "tp, rank, sig",
    [(1, 0, signal.SIGKILL), (2, 1, signal.SIGKILL), (2, 1, signal.SIGSTOP)],
    ids=["worker-killed", "tp2-rank1-killed", "tp2-rank1-hung"],
)
def test_worker_fault_heals_and_loses_nothing(tiny_llama_dir, tp, rank, sig):
    prompts = PROMPTS if tp == 1 else PROMPTS[:6]
    with serve_tiny(tiny_llama_dir, "--tensor-parallel-size", str(tp)) as srv:
        want = completions(srv.base_url, prompts)
        sid = srv.proc.pid
        old = {worker_pid(sid, r) for r in range(tp)}
        streams = Streams(srv.base_url, prompts)
        wait_until(streams.started, 60, "every stream's first tokens")
        os.kill(worker_pid(sid, rank), sig)
        t_fault = time.monotonic()
        seconds = assert_healed(srv, streams, want, "workers", t_fault)
        new = {worker_pid(sid, r) for r in range(tp)}
        assert not new & old, "the whole rank group is replaced"
        wait_until(lambda: metric(srv.base_url, "axonserve:requests_resumed_total") >= 1, 20, "resumes counted")
        log = srv.log_tail(400_000)
    m = re.search(r"actor\.restarted .*seconds=(\S+)", log)
    assert m, log[-3000:]
    print(f"{tp=} rank {rank} {signal.Signals(sig).name}: restart {m[1]} s, streams resumed {seconds:.2f} s")


@pytest.mark.timeout(300)
def test_scheduler_killed_streams_resume_without_gap(tiny_llama_dir):
    """The client resubmits each in-flight request as a continuation: no token twice, none lost."""
    prompts = PROMPTS[:8]
    with serve_tiny(tiny_llama_dir) as srv:
        want = completions(srv.base_url, prompts)
        sid = srv.proc.pid
        old_worker = worker_pid(sid, 0)
        streams = Streams(srv.base_url, prompts)
        wait_until(streams.started, 60, "every stream's first tokens")
        os.kill(actor_pid(sid, "scheduler"), signal.SIGKILL)
        t_fault = time.monotonic()
        assert_healed(srv, streams, want, "scheduler", t_fault)
        assert worker_pid(sid, 0) == old_worker, "a scheduler restart keeps the ranks (and their model)"
        wait_until(lambda: metric(srv.base_url, "axonserve:requests_resumed_total") >= 1, 20, "resumes counted")
        assert completions(srv.base_url, prompts[:1]) == want[:1]  # and new requests run


@pytest.mark.timeout(240)
def test_metrics_actor_killed_generation_unaffected(tiny_llama_dir):
    with serve_tiny(tiny_llama_dir) as srv:
        want = completions(srv.base_url, PROMPTS[:4])
        sid = srv.proc.pid
        streams = Streams(srv.base_url, PROMPTS[:4])
        wait_until(streams.started, 60, "every stream's first tokens")
        os.kill(actor_pid(sid, "metrics"), signal.SIGKILL)
        t_fault = time.monotonic()
        # (counters reset: it counts its own restart; generation never waits on it, so the streams may
        # all be done by the time it dies: nothing to require in flight)
        assert_healed(srv, streams, want, "metrics", t_fault, in_flight=0)


@pytest.mark.timeout(300)
def test_restart_storm_past_the_limit_fails_stop(tiny_llama_dir):
    with serve_tiny(tiny_llama_dir, "--max-restarts", "1") as srv:
        sid = srv.proc.pid
        first = worker_pid(sid, 0)
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: metric(srv.base_url, "axonserve:actor_restarts_total") >= 1, 60, "the first restart")
        streams = Streams(srv.base_url, PROMPTS[:2])
        wait_until(streams.started, 60, "every stream's first tokens")
        os.kill(worker_pid(sid, 0), signal.SIGKILL)  # the second within the window: fail-stop
        streams.join(60)
        assert len(streams.errors) == 2, streams.errors
        assert all("restarts within" in e for e in streams.errors), streams.errors
        wait_until(lambda: health(srv.base_url) in (503, None), 20, "/health 503")
        assert srv.proc.wait(60) != 0
        wait_until(lambda: not session_pids(sid), 20, "all actor processes to exit")


@pytest.mark.timeout(300)
def test_drafter_killed_steps_go_without_drafts(tiny_llama_dir):
    """Drafts are optional: while the drafter is replaced the steps decode plainly, and greedy text
    is the same with or without them."""
    spec = json.dumps({"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3})
    with serve_tiny(tiny_llama_dir, "--speculative-config", spec) as srv:
        want = completions(srv.base_url, PROMPTS[:4])
        streams = Streams(srv.base_url, PROMPTS[:4])
        wait_until(streams.started, 60, "every stream's first tokens")
        os.kill(actor_pid(srv.proc.pid, "drafter"), signal.SIGKILL)
        assert_healed(srv, streams, want, "drafter", time.monotonic())
        assert completions(srv.base_url, PROMPTS[:1]) == want[:1]


@pytest.mark.timeout(240)
def test_offline_llm_survives_a_scheduler_kill(tiny_llama_dir):
    """The offline API's client hears the in-process supervisor (its listeners) and resumes too."""
    from axonserve.config import EngineConfig
    from axonserve.frontends.offline import LLM
    from axonserve.protocol.messages import SamplingParams

    # long enough that the kill lands mid-generation (200 tokens took ~1 s on a fast hour: the kill came too late)
    params = SamplingParams(temperature=0, max_tokens=480, min_tokens=480)
    prompts = PROMPTS[:8]
    config = EngineConfig(model=tiny_llama_dir, num_kv_blocks=1024, max_model_len=512, heartbeat_timeout_s=4.0)
    with LLM(config=config) as llm:
        want = [o.outputs[0].text for o in llm.generate(prompts, params)]
        me = os.getpid()
        sched = next(
            pid
            for pid, cmd in session_pids(os.getsid(0)).items()
            if '"kind":"scheduler"' in cmd and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1] == str(me)
        )
        killer = threading.Timer(1.0, os.kill, (sched, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        got = llm.generate(prompts, params)
        killer.join()
        assert time.monotonic() - t0 > 1.0, "generation ended before the kill: the test tests nothing"
        assert [o.outputs[0].text for o in got] == want
        assert all(o.outputs[0].finish_reason == "length" for o in got)
