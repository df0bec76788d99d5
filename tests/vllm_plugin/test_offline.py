"""vLLM's offline `LLM(..., distributed_executor_backend=AxonExecutor)` on axonserve's ranks:
one run (offline_llm.py in the vLLM venv), checked against transformers."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess

import pytest

from tests.vllm_plugin.conftest import hf_prompt_logprobs, hf_reference, rank_pids, vllm_env, wait_gone

TEXTS = ["The capital of France is", "Once upon a time, in a land far away, there lived", "1, 2, 3, 4,"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def offline(vllm_python, vllm_model, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_model)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    d = tmp_path_factory.mktemp("vllm-offline")
    spec, out, log = d / "spec.json", d / "out.json", d / "vllm.log"
    spec.write_text(
        json.dumps(
            {
                "prompts": prompts,
                "max_tokens": MAX_TOKENS,
                "max_model_len": 256,
                "kv_cache_memory_bytes": 4 << 20,
                "profile_dir": str(d / "traces"),
            }
        )
    )
    script = os.path.join(os.path.dirname(__file__), "offline_llm.py")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [vllm_python, script, vllm_model, str(spec), str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=vllm_env(VLLM_TARGET_DEVICE="cpu"),
            start_new_session=True,
        )
        try:
            rc = proc.wait(600)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    text = log.read_text(errors="replace")
    assert rc == 0, f"offline vLLM run failed (rc={rc}):\n{text[-6000:]}"
    return prompts, json.loads(out.read_text()), text, d


def test_greedy_equals_transformers(offline, hf_model):
    prompts, got, *_ = offline
    for prompt, ids in zip(prompts, got["greedy"]):
        assert ids == hf_reference(hf_model, prompt, MAX_TOKENS)[0]


def test_sample_logprobs_match_transformers(offline, hf_model):
    """logprobs=3: the chosen token and the top 3, each against transformers' log-softmax."""
    prompts, got, *_ = offline
    for prompt, ids, steps in zip(prompts, got["greedy"], got["logprobs"]):
        _, rows = hf_reference(hf_model, prompt, MAX_TOKENS)
        for tok, lp, row in zip(ids, steps, rows):
            top = row.topk(3)
            assert set(lp) == {str(t) for t in top.indices.tolist()} | {str(tok)}
            for t, v in lp.items():
                assert math.isclose(v, float(row[int(t)]), abs_tol=1e-3), (t, v, float(row[int(t)]))


def test_prompt_logprobs_match_transformers(offline, hf_model):
    prompts, got, *_ = offline
    prompt, plp = prompts[0], got["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    rows = hf_prompt_logprobs(hf_model, prompt)
    for i in range(1, len(prompt)):
        want = {prompt[i]} | set(rows[i - 1].topk(2).indices.tolist())
        assert {int(t) for t in plp[i]} == want
        for t, v in plp[i].items():
            assert math.isclose(v, float(rows[i - 1][int(t)]), abs_tol=1e-3)


def test_seeded_sampling_is_reproducible(offline):
    _, got, *_ = offline
    a, b = got["sampled"]
    assert len(a) == 8 and a == b


def test_ranks_stop_with_vllm(offline):
    """The ranks were started for vLLM and are gone once its process exited."""
    *_, log, _ = offline
    pids = rank_pids(log)
    assert len(pids) == 2, log[-3000:]  # the rank host and one rank
    assert not wait_gone(pids), f"still running after vLLM exited: {pids}"
    assert "shutdown_requested" in log, "the rank was not shut down cleanly"


def test_vllm_profiler_calls_reach_the_ranks(offline):
    """llm.start_profile()/stop_profile() -> a torch.profiler trace from the axonserve rank."""
    *_, d = offline
    traces = os.listdir(d / "traces") if (d / "traces").is_dir() else []
    assert any("rank0" in t for t in traces), traces
