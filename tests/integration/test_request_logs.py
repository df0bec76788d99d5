"""Request-bound logs: with `--log-format json`, every engine line about a request carries its
id (scheduler admission and finish at debug level, the frontend's access line, a worker's
failed step), and
every line of an actor process carries the actor's name (and a worker's rank), including lines
logged while the model loads on its own thread."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from frontends.server import serve
from structlog.testing import capture_logs

RID = "logs-req-1"


def json_lines(path: str) -> list[dict]:
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            start = line.find("{")  # tqdm may share a line with a log record
            if start < 0:
                continue
            try:
                rec = json.loads(line[start:])
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "event" in rec:
                out.append(rec)
    return out


def wait_for_events(path: str, want: set[tuple[str, str, str]], timeout: float) -> list[dict]:
    """Log records once every (actor, event, request id) in `want` is there (or at timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = json_lines(path)
        have = {(x.get("actor"), x["event"], x.get("request_id")) for x in lines}
        if want <= have or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_served_request_id_is_on_every_engine_line_about_it(tiny_llama_dir):
    # 10 blocks of 4 tokens: two 34-token requests cannot both fit, so one is preempted
    args = ("--num-kv-blocks", "10", "--block-size", "4", "--log-format", "json", "--log-level", "debug")
    with serve(tiny_llama_dir, *args) as srv, httpx.Client(base_url=srv.base_url, timeout=120) as http:

        def body(rid: str, n: int, **kw) -> dict:
            return {
                "model": tiny_llama_dir,
                "prompt": [7, 8, 9, 10],
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "request_id": rid,
            } | kw

        r = http.post("/v1/completions", json=body(RID, 3))
        assert r.status_code == 200, r.text
        with http.stream("POST", "/v1/completions", json=body("logs-abort", 30, stream=True)) as r:
            next(r.iter_lines())  # then hang up: the frontend aborts the request
        # two prompts in one request: both are admitted at once, then outgrow the 10 blocks
        r = http.post("/v1/completions", json=body("logs-p", 30, prompt=[[7, 8, 9, 10], [11, 12, 13, 14]]))
        assert r.status_code == 200, r.text
        want = {
            ("scheduler", "request.added", RID),
            ("scheduler", "request.finished", RID),
            ("frontend", "access", RID),
            ("scheduler", "request.finished", "logs-abort"),
        }
        lines = wait_for_events(srv.log_path, want, 30)

    have = {(x.get("actor"), x["event"], x.get("request_id")) for x in lines}
    assert want <= have, sorted(e for e in have if e[2])
    finished = {x["request_id"]: x for x in lines if x["event"] == "request.finished"}
    assert finished[RID]["finish_reason"] == "length" and finished[RID]["level"] == "debug"
    assert finished["logs-abort"]["finish_reason"] == "abort" and finished["logs-abort"]["level"] == "info"
    preempted = [x for x in lines if x["event"] == "request.preempted"]
    assert preempted and {x["request_id"] for x in preempted} <= {"logs-p-p0", "logs-p-p1"}
    assert all(x["actor"] == "scheduler" for x in preempted)

    actor_lines = [x for x in lines if x.get("actor") not in (None, "launcher")]
    by_actor = {x["actor"] for x in actor_lines}
    assert {"scheduler", "worker-0", "metrics", "frontend"} <= by_actor, by_actor
    worker = [x for x in lines if x.get("actor") == "worker-0"]
    assert all(x.get("rank") == 0 for x in worker), [x for x in worker if x.get("rank") != 0]
    # logged on the model-loading thread: still bound to the actor
    assert {"model.loaded", "runner.ready"} <= {x["event"] for x in worker}
    # only the launcher process logs without an actor of its own
    unbound = [x for x in lines if "actor" not in x]
    assert not unbound, unbound[:3]


def test_failed_step_names_its_requests(tiny_llama_dir, monkeypatch):
    import structlog

    from axonserve.config import EngineConfig
    from axonserve.neuron import model_runner
    from axonserve.neuron.model_runner import ModelRunner
    from axonserve.protocol.messages import CachedRequestData, StepPlan

    # a fresh logger proxy: one used before under a caching configuration (an in-process
    # `axonserve ...` command in another test) would bypass capture_logs
    monkeypatch.setattr(model_runner, "log", structlog.get_logger())

    runner = ModelRunner(EngineConfig(model=tiny_llama_dir, num_kv_blocks=8, block_size=4))
    with capture_logs() as logs:
        res = runner.execute(StepPlan(7, cached=[CachedRequestData("ghost-1")], num_scheduled_tokens=[1]))
    assert res.error and "ghost-1" in res.error
    failed = [x for x in logs if x["event"] == "runner.step_failed"]
    assert failed and failed[0]["request_ids"] == ["ghost-1"] and failed[0]["step_id"] == 7
