"""`bench compare --repeat`: interleaving, per-round ratios, medians with their range."""

from __future__ import annotations

from axonserve.bench.repeat import aggregate, l3_bytes, repeat_table, round_order


def _run(conc: int, tok_s: float, ttft: float, itl: float) -> dict:
    return {
        "concurrency": conc,
        "summary": {"output_throughput": tok_s, "ttft_ms": {"p50": ttft}, "itl_ms": {"p50": itl}},
    }


def test_rounds_alternate_the_engines_order():
    names = ["axonserve", "vllm", "llamacpp"]
    assert [round_order(names, r)[0] for r in range(4)] == ["axonserve", "llamacpp", "axonserve", "llamacpp"]
    assert round_order(names, 1) == ["llamacpp", "vllm", "axonserve"]


def test_ratios_are_taken_within_a_round_then_summarised():
    # round 2 is a slow hour for both engines: per-round ratios stay 2.0, 2.0, 1.5
    rounds = [
        [
            {"engine": "axonserve", "runs": [_run(32, 800, 300, 40)]},
            {"engine": "vllm", "runs": [_run(32, 400, 600, 80)]},
        ],
        [
            {"engine": "vllm", "runs": [_run(32, 200, 900, 160)]},
            {"engine": "axonserve", "runs": [_run(32, 400, 450, 80)]},
        ],
        [
            {"engine": "axonserve", "runs": [_run(32, 600, 500, 60)]},
            {"engine": "vllm", "runs": [_run(32, 400, 500, 70)]},
        ],
    ]
    rows = aggregate(rounds)
    assert [(r["engine"], r["concurrency"], r["n"]) for r in rows] == [("axonserve", 32, 3), ("vllm", 32, 3)]
    ours, vllm = rows
    assert ours["out tok/s"] == (600, 400, 800)
    assert ours["axon÷ out tok/s"] == (1.0, 1.0, 1.0)
    assert vllm["out tok/s"] == (400, 200, 400)
    assert vllm["axon÷ out tok/s"] == (2.0, 1.5, 2.0)  # the median of per-round ratios, not 600 / 400
    assert vllm["axon÷ TTFT p50 ms"] == (0.5, 0.5, 1.0)
    text = repeat_table(rows, [{"in_l3_gbps": 40.0, "dram_gbps": 10.0, "l3_ratio": 4.0, "loadavg": [1.5, 1, 1]}])
    assert "| vllm | 32 | 3 | 400.0 [200.0, 400.0] | 2.00 [1.50, 2.00] |" in text
    assert "| 1 | 1.50 | 40.0 | 10.0 | 4.0 |" in text


def test_a_failed_engine_or_missing_level_leaves_no_ratio():
    rounds = [[{"engine": "axonserve", "runs": [_run(1, 50, 20, 20)]}, {"engine": "vllm", "error": "boom", "runs": []}]]
    rows = aggregate(rounds)
    assert [r["engine"] for r in rows] == ["axonserve"]
    rounds = [[{"engine": "axonserve", "runs": []}, {"engine": "vllm", "runs": [_run(64, 500, 20, 20)]}]]
    (row,) = aggregate(rounds)
    assert row["out tok/s"] == (500, 500, 500) and "axon÷ out tok/s" not in row
    assert "| - |" in repeat_table([row], [])


def test_l3_size_is_read():
    assert l3_bytes() >= 2**20
