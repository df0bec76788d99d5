"""One real `bench serve` run against `axonserve serve` on the tiny model (subprocess server),
sampling at temperature 1 (the native draw path through HTTP)."""

import json
import subprocess
import sys

from tests.frontends.server import REPO, serve


def test_bench_serve_end_to_end(tiny_llama_dir, tmp_path):
    out = tmp_path / "results.json"
    with serve(tiny_llama_dir, "--max-num-seqs", "8") as srv:
        cmd = [
            sys.executable,
            "-m",
            "axonserve.bench",
            "serve",
            "--base-url",
            srv.base_url,
            "--num-prompts",
            "8",
            "--concurrency",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--vocab-size",
            "49152",
            "--warmup",
            "1",
            "--no-progress",
            "--out",
            str(out),
            "--plot",
            "",
            "--temperature",
            "1.0",
        ]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    s = run["summary"]
    assert run["concurrency"] == 4
    assert (s["completed"], s["failed"]) == (8, 0)
    assert s["total_input_tokens"] == 8 * 16
    assert [q["output_tokens"] for q in run["requests"]] == [8] * 8
    assert s["total_output_tokens"] == 64
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s[key]) >= {"mean", "p50", "p90", "p99"}
        assert s[key]["p50"] > 0
    assert s["output_throughput"] > 0 and s["request_throughput"] > 0
    assert all(q["ttft"] <= q["e2e"] and len(q["itl"]) >= 1 for q in run["requests"])
    assert {"loadavg_start", "loadavg_end", "other_cores"} <= set(run["load"])
    assert "Output token throughput" in r.stdout
