"""Sampling on the XLA device (PJRT CPU) keeps the distribution the CPU sampler defines, compiles
once per variant whatever the per-row values, and hashes the same uniforms as the host."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import chi2, chi2_critical

from .conftest import run_in_xla

pytestmark = pytest.mark.timeout(900)


def expected(logits: torch.Tensor, kind: str) -> dict[int, float]:
    """The distribution the CPU sampler (neuron/sampler.py) draws from for the same parameters."""
    from axonserve.neuron.sampler import Sampler
    from axonserve.protocol.messages import SamplingParams

    p = (
        SamplingParams(temperature=0.8)
        if kind == "random"
        else SamplingParams(temperature=1.3, top_k=12, top_p=0.9, min_p=0.02)
    )

    class Row:
        params, token_ids, num_prompt_tokens, generator = p, [1], 1, None

    probs = Sampler([2])._probs(logits[None].clone(), [Row()])[0]
    return {i: float(v) for i, v in enumerate(probs.tolist()) if v > 0}


def test_device_sampler_distribution_compiles_and_uniforms(xla_python):
    out = run_in_xla(xla_python, "sampling_check.py")
    logits = torch.tensor(out["logits"])
    for kind, counts in out["counts"].items():
        n = sum(counts)
        probs = expected(logits, kind)
        observed = Counter({i: c for i, c in enumerate(counts) if c})
        assert set(observed) <= set(probs), f"{kind}: drew tokens the filters remove"
        stat, df = chi2(observed, probs, n)
        assert stat < chi2_critical(df), f"{kind}: chi2 {stat:.1f} with {df} df"
    assert out["compiles"]["after"] == out["compiles"]["before"], out["compiles"]
    assert out["uniforms_equal"]
