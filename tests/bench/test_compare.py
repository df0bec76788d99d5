"""`bench compare`'s report: speculation per concurrency level from the counters' growth."""

from __future__ import annotations

from axonserve.bench.compare import spec_summary, table


def test_each_level_reports_its_own_accepted_length():
    before = {"num_drafts": 100.0, "num_draft_tokens": 800.0, "num_accepted_tokens": 160.0, "pos0": 90.0, "pos1": 70.0}
    after = {
        "num_drafts": 150.0,
        "num_draft_tokens": 1200.0,
        "num_accepted_tokens": 240.0,
        "pos0": 130.0,
        "pos1": 110.0,
    }
    level = spec_summary({k: v - before.get(k, 0.0) for k, v in after.items()})
    assert level == {
        "verifications": 50,
        "draft_tokens": 400,
        "accepted_tokens": 80,
        "mean_accepted_length": 2.6,
        "acceptance_by_position": [0.8, 0.8],
    }
    assert spec_summary({}) == {} and spec_summary({"num_drafts": 0.0}) == {}
    summary = {
        "output_throughput": 120.0,
        "request_throughput": 1.0,
        "ttft_ms": {"p50": 20.0},
        "itl_ms": {"p50": 18.0},
        "tpot_ms": {"p50": 7.5},
        "completed": 8,
        "failed": 0,
    }
    runs = [{"concurrency": 1, "summary": summary, "spec_decode": level}, {"concurrency": 8, "summary": summary}]
    rows = table([{"engine": "axonserve", "runs": runs}]).splitlines()
    assert "accepted len" in rows[0]
    assert "| 2.60 |" in rows[2] and "| 2.60 |" not in rows[3]
