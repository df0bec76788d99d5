"""Translation, executor RPCs, platform plugin and version guard against vLLM's real objects.

They need vLLM, so they run in the vLLM venv (inside_vllm.py, one subprocess for all); each
check is its own test here, reported from that run.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.vllm_plugin.conftest import vllm_env

CHECKS = [
    "plan_sequence",
    "logprobs_output",
    "sampling_params",
    "executor_rpcs",
    "unsupported_features",
    "plugin_entry_point",
    "version_guard",
]


@pytest.fixture(scope="module")
def inside_run(vllm_python, vllm_model) -> str:
    script = os.path.join(os.path.dirname(__file__), "inside_vllm.py")
    r = subprocess.run(
        [vllm_python, script, vllm_model, *CHECKS],
        capture_output=True,
        text=True,
        timeout=600,
        env=vllm_env(VLLM_TARGET_DEVICE="cpu"),
        check=False,
    )
    return r.stdout + r.stderr


@pytest.mark.parametrize("check", CHECKS)
def test_inside_vllm(inside_run, check):
    assert f"ok {check}\n" in inside_run, inside_run[-6000:]
