"""Worker ranks for real: `--num-workers 2` (tensor parallel over gloo) serves the same greedy
tokens through the OpenAI API as one rank, and each rank is its own process."""

from __future__ import annotations

import httpx
import pytest
from frontends.server import serve

from .test_faults import session_pids


def completion_ids(base_url: str, model: str, logprobs: int | None = 0) -> list[list[int]]:
    out = []
    with httpx.Client(base_url=base_url, timeout=60) as http:
        for prompt in ("Once upon a time", "The capital of France is", "1, 2, 3,"):
            r = http.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": 12,
                    "min_tokens": 12,
                    "temperature": 0,
                    "logprobs": logprobs,
                },
            )
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
    return out


@pytest.mark.timeout(240)
def test_two_ranks_serve_the_same_greedy_text_as_one(tiny_llama_dir):
    args = ("--num-kv-blocks", "128", "--served-model-name", "tiny")
    with serve(tiny_llama_dir, *args) as srv:
        want = completion_ids(srv.base_url, "tiny")
    with serve(tiny_llama_dir, *args, "--num-workers", "2") as srv:
        workers = [c for c in session_pids(srv.proc.pid).values() if '"kind":"worker"' in c]
        assert len(workers) == 2
        got = completion_ids(srv.base_url, "tiny")
    assert got == want


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.timeout(240)
def test_two_ranks_multi_step_serve_the_same_greedy_text_as_one(tiny_llama_dir):
    """Multi-step decoding on two ranks: every forward of a plan broadcasts rank 0's sampled ids,
    so both ranks feed the same tokens back; the text equals one rank's single-step text."""
    args = ("--num-kv-blocks", "128", "--served-model-name", "tiny")
    with serve(tiny_llama_dir, *args) as srv:
        want = completion_ids(srv.base_url, "tiny", logprobs=None)
    with serve(tiny_llama_dir, *args, "--num-workers", "2", "--num-scheduler-steps", "4") as srv:
        got = completion_ids(srv.base_url, "tiny", logprobs=None)
        forwards = metric(srv.base_url, "axonserve:model_forwards_total")
        plans = metric(srv.base_url, "vllm:iteration_tokens_total_count")
    assert got == want
    assert forwards > plans > 0, (forwards, plans)  # plans of several forwards ran
