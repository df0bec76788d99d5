"""Per-request timings and their summary, with vLLM's definitions (`vllm bench serve`).

TTFT: request sent -> first chunk carrying output. ITL: every gap between consecutive output
chunks. TPOT: (E2E - TTFT) / (output_tokens - 1), per request. Percentiles: numpy's linear.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = math.nan  # seconds
    itl: list[float] = field(default_factory=list)  # seconds, one per gap between chunks
    e2e: float = math.nan
    start: float = 0.0  # seconds since the run began
    error: str = ""
    finish_reason: str | None = None
    index: int = -1  # position in the workload (results are kept in completion order)

    @property
    def tpot(self) -> float:
        if not self.ok or self.output_tokens < 2:
            return math.nan
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        d = asdict(self)
        d["tpot"] = None if math.isnan(self.tpot) else self.tpot
        for k in ("ttft", "e2e"):
            d[k] = None if math.isnan(d[k]) else d[k]
        return d


def distribution(values_s: list[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99/min/max in milliseconds (None when there is no sample)."""
    v = np.asarray([x for x in values_s if not math.isnan(x)], dtype=np.float64) * 1e3
    if v.size == 0:
        return {k: None for k in ("mean", *(f"p{p}" for p in PERCENTILES), "min", "max")}
    out = {"mean": float(v.mean())}
    out.update({f"p{p}": float(np.percentile(v, p)) for p in PERCENTILES})
    out.update(min=float(v.min()), max=float(v.max()))
    return out


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """Aggregate figures of one load level; throughput counts completed requests only."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    dur = max(duration_s, 1e-9)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "ttft_ms": distribution([r.ttft for r in done]),
        "tpot_ms": distribution([r.tpot for r in done]),
        "itl_ms": distribution([g for r in done for g in r.itl]),
        "e2e_ms": distribution([r.e2e for r in done]),
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in done)),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }
