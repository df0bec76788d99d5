"""Decode-ceiling arithmetic from safetensors headers (no bandwidth measurement here)."""

import torch
from safetensors.torch import save_file

from axonserve.bench.bandwidth import count_params, decode_ceiling


def test_count_params_and_ceiling(tmp_path):
    save_file(
        {"a": torch.zeros(10, 20), "b": torch.zeros(5, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors")
    )
    assert count_params(str(tmp_path)) == 205
    c = decode_ceiling(134_500_000, "bfloat16", 28.0)
    assert c["weight_bytes"] == 269_000_000
    assert abs(c["tok_s_ceiling"] - 28e9 / 269e6) < 1e-9
