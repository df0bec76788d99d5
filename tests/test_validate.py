"""Accuracy debugger: `axonserve validate` passes on a correct model (tiny random Llama and the
real SmolLM2), and when one layer's weights in the served checkpoint are corrupted it exits 1
and names that layer as the first whose hidden states drift from the transformers reference."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import make_tiny_llama
from frontends.server import REPO

from axonserve.validate import load_prompts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny4_dir(tmp_path_factory, smollm2_dir) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny4")), smollm2_dir, seed=4, num_hidden_layers=4)


def validate(*args: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = args[args.index("--report") + 1]
    proc = subprocess.run(
        [sys.executable, "-m", "axonserve.cli", "validate", *args],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    with open(report) as f:
        return proc, json.load(f)


def test_prompt_files(tmp_path):
    (tmp_path / "p.jsonl").write_text('"hello"\n{"prompt": [5, 6, 7]}\n\n')
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    (tmp_path / "p.json").write_text('["a", {"prompt": "b"}]')
    assert load_prompts(str(tmp_path / "p.jsonl")) == ["hello", [5, 6, 7]]
    assert load_prompts(str(tmp_path / "p.txt")) == ["one", "two"]
    assert load_prompts(str(tmp_path / "p.json")) == ["a", "b"]
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError):
        load_prompts(str(tmp_path / "bad.json"))


def test_validate_passes_on_a_correct_model(tiny4_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"The capital of France is"\n{"prompt": [17, 230, 4001, 9, 77, 12, 5]}\n')
    proc, rep = validate(
        tiny4_dir, "--prompts", str(prompts), "--max-tokens", "5", "--report", str(tmp_path / "r.json")
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rep["passed"] and rep["first_divergent_layer"] is None
    assert len(rep["requests"]) == 2 and len(rep["layer_rel_diff"]) == 4
    for r in rep["requests"]:
        assert r["first_mismatch"] is None and r["tokens"] == r["ref_tokens"] and len(r["tokens"]) == 5
        assert r["logits_max_abs"] < 1e-3 and r["top1_agreement"] == 1.0
    assert "PASS: 2 prompts" in proc.stdout


def test_validate_names_the_corrupted_layer(tiny4_dir, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    bad = str(tmp_path / "bad")
    shutil.copytree(tiny4_dir, bad)
    path = f"{bad}/model.safetensors"
    weights = load_file(path)
    key = "model.layers.1.mlp.down_proj.weight"
    weights[key] = torch.randn(weights[key].shape, generator=torch.Generator().manual_seed(1)) * 0.02
    save_file(weights, path, metadata={"format": "pt"})

    proc, rep = validate(bad, "--reference", tiny4_dir, "--max-tokens", "4", "--report", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert not rep["passed"] and rep["first_divergent_layer"] == 1
    tol = rep["tolerances"]["hidden_rtol"]
    assert rep["layer_rel_diff"][0] <= tol < rep["layer_rel_diff"][1]
    assert all(r["first_divergent_layer"] == 1 and not r["passed"] for r in rep["requests"])
    assert "first decoder layer drifting past tolerance: 1" in proc.stdout and "FAIL" in proc.stdout


def test_validate_smollm2(tmp_path):
    proc, rep = validate("--max-tokens", "4", "--report", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rep["passed"] and len(rep["layer_rel_diff"]) == 30
    assert all(r["tokens"] == r["ref_tokens"] for r in rep["requests"])


def test_validate_smollm2_int8_within_its_bound(tmp_path):
    """Weight-only int8 (the AMX kernel for decode batches, oneDNN on the dequantized copy for the
    prompt) is checked against the bf16 transformers reference with the format's own bound."""
    proc, rep = validate("--dtype", "bfloat16", "-q", "int8", "--max-tokens", "8", "--report", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rep["tolerances"]["atol"] == 3.0 and rep["passed"]
    assert all(r["top1_agreement"] >= 0.75 and r["kl_mean"] < 0.05 for r in rep["requests"])


def test_validate_smollm2_int8_activations_within_their_bound(tmp_path):
    """--activation-quantization int8 (the default GGUF's codes times int8 activations, served in
    float32 through the real engine) against transformers on the same weights: the report passes
    with the format's own bound (validate.ACT_TOL) and the greedy tokens mostly agree."""
    import torch

    from axonserve.neuron.layers.quant import panel_kernels
    from axonserve.validate import ACT_TOL

    if panel_kernels(torch.float32) is None:
        pytest.skip("panel kernels need AVX2 + FMA")
    args = ("--activation-quantization", "int8", "--max-tokens", "8", "--report", str(tmp_path / "r.json"))
    proc, rep = validate(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (rep["tolerances"]["atol"], rep["tolerances"]["hidden_rtol"]) == ACT_TOL["int8"] and rep["passed"]
    assert all(r["top1_agreement"] >= 0.75 and r["kl_mean"] < 0.05 for r in rep["requests"])
    assert any(r["logits_max_abs"] > 0.01 for r in rep["requests"])  # the activations were rounded


@pytest.mark.parametrize("flags", [("-q", "fp8"), ("--kv-cache-dtype", "fp8"), ("--kv-cache-dtype", "fp8_e5m2")])
def test_validate_fp8_within_its_bound(tiny4_dir, tmp_path, flags):
    """FP8 weights or an FP8 KV cache against the float32 transformers reference: the report
    passes with the format's own bound (validate.QUANT_TOL / KV_TOL), which it names."""
    from axonserve.validate import KV_TOL, QUANT_TOL

    proc, rep = validate(tiny4_dir, *flags, "--max-tokens", "6", "--report", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bound = QUANT_TOL["fp8"] if flags[0] == "-q" else KV_TOL[flags[1]]
    assert (rep["tolerances"]["atol"], rep["tolerances"]["hidden_rtol"]) == bound and rep["passed"]
    # (no top-1 bar: a random tiny model's near-uniform logits flip on any rounding; SmolLM2's
    # figures are in validate.py's comments)
