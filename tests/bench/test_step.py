"""`axonserve bench step` runs the real engine around the null model and reports per-step cost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("workers", [1, 2])
def test_bench_step_reports_every_batch(tmp_path, smollm2_dir, workers):
    out = tmp_path / "step.json"
    cmd = [
        sys.executable,
        "-m",
        "axonserve.cli",
        "bench",
        "step",
        "--batches",
        "1,4",
        "--tokens",
        "8",
        "--num-workers",
        str(workers),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:  # >= 8 steps for 8 tokens; a few more when arrivals straddle steps or a step only drops
        assert 8 <= r["steps"] <= 8 + r["batch"] + 2 and r["us_per_step"] > 0
        if sys.platform == "linux":  # CPU time per step of every process (/proc)
            assert {"client", "scheduler", "metrics", *(f"worker-{i}" for i in range(workers))} <= set(
                r["cpu_us_per_step"]
            )
            assert all(v >= 0 for v in r["cpu_us_per_step"].values())
    assert "us/step" in proc.stdout and "CPU µs per step by process" in proc.stdout
