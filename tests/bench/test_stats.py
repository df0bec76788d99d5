"""The metric definitions on hand-made timings (vLLM's: TTFT, per-gap ITL, per-request TPOT)."""

import math

import numpy as np
import pytest

from axonserve.bench.stats import RequestResult, distribution, summarize


def _req(ttft, gaps, tokens=None, prompt_len=10):
    e2e = ttft + sum(gaps)
    return RequestResult(
        ok=True, prompt_len=prompt_len, output_tokens=tokens or len(gaps) + 1, ttft=ttft, itl=list(gaps), e2e=e2e
    )


def test_tpot_excludes_first_token():
    r = _req(0.5, [0.1, 0.2, 0.3])
    assert r.tpot == pytest.approx(0.6 / 3)
    assert math.isnan(_req(0.5, []).tpot)  # one token: no TPOT
    assert math.isnan(RequestResult(ok=False, prompt_len=1).tpot)


def test_tpot_uses_token_count_not_chunks():
    # 2 chunks but 5 tokens (a server that batches tokens per chunk): TPOT divides by 4
    r = _req(1.0, [0.8], tokens=5)
    assert r.tpot == pytest.approx(0.2)


def test_distribution_percentiles_ms():
    d = distribution([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert d["mean"] == pytest.approx(50.5)
    assert d["p50"] == pytest.approx(np.percentile(np.arange(1, 101), 50))
    assert d["p90"] == pytest.approx(90.1)
    assert d["p99"] == pytest.approx(99.01)
    assert (d["min"], d["max"]) == (pytest.approx(1.0), pytest.approx(100.0))
    assert distribution([])["p50"] is None


def test_summarize_counts_only_completed():
    ok = [_req(0.1, [0.05] * 3), _req(0.3, [0.1] * 3)]
    bad = RequestResult(ok=False, prompt_len=10, error="boom")
    s = summarize([*ok, bad], duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_output_tokens"] == 8
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["total_token_throughput"] == pytest.approx(14.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    # ITL pools every gap of every request: 3 x 50 ms and 3 x 100 ms
    assert s["itl_ms"]["p50"] == pytest.approx(75.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(75.0)
    assert s["errors"] == ["boom"]
