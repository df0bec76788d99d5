"""Profiler over HTTP (vLLM's routes): POST /start_profile and /stop_profile on the real server
reach every worker rank through the scheduler; each rank writes a Chrome trace that parses as
JSON and holds the engine steps run while profiling. Without a profile dir the routes are 400.
The per-step timing breakdown is on /metrics as `axonserve:step_phase_seconds{phase=...}`.
"""

from __future__ import annotations

import glob
import json
import os

import httpx
import pytest
from frontends.server import serve
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(300)


def complete(http: httpx.Client, model: str, n: int = 4) -> None:
    body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


def test_profile_routes_write_a_trace_per_rank(tiny_llama_dir, tmp_path):
    prof = tmp_path / "prof"
    args = ("--num-kv-blocks", "64", "--num-workers", "2", "--profile-dir", str(prof))
    with serve(tiny_llama_dir, *args) as srv, httpx.Client(base_url=srv.base_url, timeout=120) as http:
        complete(http, tiny_llama_dir)  # steps before the profile are not in it
        r = http.post("/start_profile")
        assert r.status_code == 200, r.text
        again = http.post("/start_profile")
        assert again.status_code == 409 and "already running" in again.json()["error"]["message"]
        complete(http, tiny_llama_dir)
        r = http.post("/stop_profile")
        assert r.status_code == 200, r.text
        files = r.json()["files"]
        assert http.post("/stop_profile").status_code == 409
        complete(http, tiny_llama_dir)  # still serving
        metrics = http.get("/metrics").text
    phases = {}
    for fam in text_string_to_metric_families(metrics):
        for s in fam.samples:
            if s.name in ("axonserve:step_phase_seconds_count", "axonserve:step_phase_seconds_sum"):
                phases[(s.labels["phase"], s.name.rsplit("_", 1)[1])] = s.value
    num_steps = phases[("schedule", "count")]
    for phase in ("schedule", "send", "forward", "sample", "return", "update", "roundtrip"):
        assert phases[(phase, "count")] == num_steps > 0, phase
    assert phases[("sample", "sum")] > 0 and phases[("forward", "sum")] > 0
    assert phases[("roundtrip", "sum")] >= phases[("forward", "sum")] + phases[("sample", "sum")]
    traces = sorted(glob.glob(str(prof / "rank*.pt.trace.json")))
    assert sorted(files) == traces and [os.path.basename(t).split(".")[0] for t in traces] == ["rank0", "rank1"]
    for path in traces:
        with open(path) as f:
            trace = json.load(f)
        names = {ev.get("name", "") for ev in trace["traceEvents"]}
        steps = [n for n in names if n.startswith("step ")]
        assert steps, f"{path}: no engine step ranges"
        assert any(n.startswith("aten::") for n in names), f"{path}: no operator events"


def test_profile_routes_need_a_profile_dir(tiny_llama_dir, monkeypatch, tmp_path):
    """Only --profile-dir enables the routes: vLLM's environment variable does not (a profiler
    writing to disk is not switched on by a variable someone left in the environment)."""
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "env-prof"))
    with serve(tiny_llama_dir, "--num-kv-blocks", "64") as srv, httpx.Client(base_url=srv.base_url, timeout=60) as http:
        for route in ("/start_profile", "/stop_profile"):
            r = http.post(route)
            assert r.status_code == 400, r.text
            assert "--profile-dir" in r.json()["error"]["message"]
        complete(http, tiny_llama_dir)
    assert not (tmp_path / "env-prof").exists()


def test_profiler_is_guarded_and_bounded(tiny_llama_dir, tmp_path):
    """With --api-key the profiler routes need the key; a start while one runs, or while a command
    is in flight, is refused at once (409, not queued); a trace holds at most --profile-max-steps
    steps and each rank keeps its newest --profile-max-traces traces."""
    prof, key = tmp_path / "prof", "sk-prof"
    args = (
        "--num-kv-blocks",
        "64",
        "--profile-dir",
        str(prof),
        "--api-key",
        key,
        "--profile-max-steps",
        "3",
        "--profile-max-traces",
        "2",
    )
    auth = {"Authorization": f"Bearer {key}"}
    with serve(tiny_llama_dir, *args) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as http:
        for route in ("/start_profile", "/stop_profile"):
            assert http.post(route).status_code == 401
        assert not prof.exists() or not list(prof.iterdir())
        http.headers.update(auth)
        written: list[str] = []
        for _ in range(3):
            assert http.post("/start_profile").status_code == 200
            again = http.post("/start_profile")
            assert again.status_code == 409 and "already running" in again.json()["error"]["message"]
            complete(http, tiny_llama_dir, n=8)  # 8 steps, 3 recorded
            r = http.post("/stop_profile")
            assert r.status_code == 200 and r.json()["status"] == "stopped", r.text
            written += r.json()["files"]
        assert http.get("/health").status_code == 200
        complete(http, tiny_llama_dir)
    kept = sorted(glob.glob(str(prof / "rank0.*.pt.trace.json")))
    assert kept == sorted(written[1:]), (kept, written)  # the oldest was pruned
    assert not glob.glob(str(prof / "*.partial"))
    for path in kept:
        with open(path) as f:
            names = {ev.get("name", "") for ev in json.load(f)["traceEvents"]}
        steps = [n for n in names if n.startswith("step ")]
        assert 1 <= len(steps) <= 3, steps
