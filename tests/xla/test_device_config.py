"""`--device` is resolved and checked when the config is made, in the main venv (no torch-xla):
auto falls back to cpu without torch_neuronx, xla without torch-xla is refused naming how to get
it, and what the XLA runner does not run is refused at start-up (exit 2), not in a step."""

from __future__ import annotations

import subprocess
import sys

import pytest

from axonserve.config import EngineConfig, SpeculativeConfig


def test_auto_is_cpu_without_torch_neuronx(smollm2_dir):
    assert EngineConfig(model=smollm2_dir, device="auto").device == "cpu"
    with pytest.raises(ValueError, match="device 'tpu' is not supported"):
        EngineConfig(model=smollm2_dir, device="tpu")


def test_xla_without_torch_xla_names_the_setup(smollm2_dir):
    cmd = [sys.executable, "-m", "axonserve.cli", "serve", smollm2_dir, "--port", "1", "--device", "xla"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "scripts/setup-xla" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize(
    "kwargs, what",
    [
        (dict(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2)), "speculative decoding"),
        (dict(quantization="int8"), "weight quantization"),
        (dict(kv_cache_dtype="int8"), "an int8 KV cache"),
        (dict(num_scheduler_steps=4), "multi-step decoding"),
        (dict(enable_expert_parallel=True), "expert parallelism"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_xla_refuses_what_it_does_not_run(smollm2_dir, kwargs, what):
    with pytest.raises(ValueError, match=f"--device xla does not support {what}"):
        EngineConfig(model=smollm2_dir, device="xla", **kwargs)
