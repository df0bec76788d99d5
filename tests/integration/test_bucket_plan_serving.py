"""`axonserve buckets plan` on real traffic: a bucketing server on the CPU backend serves a skewed
workload (mostly short prompts, a few long ones), the planner reads its /metrics and proposes
buckets that pad that traffic less within the same compile budget, and a server started with
`--buckets FILE` serves with exactly those buckets."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import httpx
import pytest
from frontends.server import REPO, serve

from axonserve.engine.bucket_plan import Traffic, current_buckets, plan, read_traffic_json
from axonserve.engine.buckets import BucketConfig, bucket_shapes, read_bucket_file

pytestmark = pytest.mark.timeout(240)
LIMITS = ("--max-model-len", "512", "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--block-size", "16")
ARGS = (*LIMITS, "--num-kv-blocks", "512", "--served-model-name", "tiny", "--threads", "2")


def workload() -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): 40 prompts of 20-40 tokens, 4 of 300-450."""
    rng = random.Random(11)
    short = [([rng.randrange(3, 49152) for _ in range(rng.randint(20, 40))], 8) for _ in range(40)]
    long = [([rng.randrange(3, 49152) for _ in range(rng.randint(300, 450))], 4) for _ in range(4)]
    out = short + long
    rng.shuffle(out)
    return out


async def send_all(base_url: str, jobs: list[tuple[list[int], int]]) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:

        async def one(ids: list[int], n: int) -> dict:
            body = {"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        return await asyncio.gather(*(one(ids, n) for ids, n in jobs))


def buckets_info(base_url: str) -> dict[str, str]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        if fam.name == "axonserve:buckets_info":
            return fam.samples[0].labels
    raise AssertionError("no axonserve:buckets_info in /metrics")


def test_plan_from_served_traffic_and_serve_with_it(tiny_llama_dir, tmp_path):
    traffic_file, bucket_file = tmp_path / "traffic.json", tmp_path / "buckets.json"
    with serve(tiny_llama_dir, "--bucketing", *ARGS) as srv:
        outs = asyncio.run(send_all(srv.base_url, workload()))
        assert all(len(o["choices"][0]["text"]) > 0 or o["usage"]["completion_tokens"] for o in outs)
        info = buckets_info(srv.base_url)
        assert info["decode_len"] == "128,256,512" and info["max_model_len"] == "512"
        metrics = httpx.get(srv.base_url + "/metrics").text
        assert 'axonserve:xla_compiles_total{engine="0",model_name="tiny"} 0.0' in metrics  # exported, none on CPU
        cmd = [sys.executable, "-m", "axonserve.cli", "buckets", "plan", "--from-metrics", srv.base_url]
        cmd += ["--save-json", str(traffic_file), "--out", str(bucket_file)]
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    print(run.stdout)  # the before/after table (pytest -s shows it)
    assert "padded query tokens" in run.stdout

    t: Traffic = read_traffic_json(str(traffic_file))
    assert t.count("step_batch_size", "prefill") and t.count("step_batch_size", "decode")
    jobs = workload()
    prompt, generated = sum(len(ids) for ids, _ in jobs), sum(n - 1 for _, n in jobs)  # the last is never fed back
    prefill = t.sum("step_query_tokens", "prefill")
    assert prefill + t.sum("step_query_tokens", "decode") == prompt + generated  # no prefix hits, no recompute
    # a prompt's last chunk of one token has a decode's shape (and runs as one when bucketing): counted there
    assert prompt - len(jobs) <= prefill <= prompt
    current, t.limits = current_buckets(t, {})
    assert current == BucketConfig.resolve(
        max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512, block_size=16
    )
    p = plan(t, current)
    assert p.waste.graphs <= p.budget == len(bucket_shapes(current, 512))
    assert p.waste.weighted(p.kv_weight) < p.current_waste.weighted(p.kv_weight)
    assert p.waste.query_tokens < p.current_waste.query_tokens
    planned = read_bucket_file(str(bucket_file))
    assert planned == p.buckets.as_dict()

    with serve(tiny_llama_dir, "--buckets", str(bucket_file), *ARGS, "--log-format", "json") as srv:
        out = asyncio.run(send_all(srv.base_url, workload()[:6]))
        assert all(o["usage"]["completion_tokens"] > 0 for o in out)
        info = buckets_info(srv.base_url)
        assert {k: [int(x) for x in info[k].split(",")] for k in planned} == planned
        log = srv.log_tail(200_000)
    ready = [json.loads(line) for line in log.splitlines() if '"runner.ready"' in line]
    assert ready and ready[0]["buckets"] == planned  # the worker runs with the planned buckets
