"""Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norm) and Qwen3-MoE (top-k experts, dense and
sparse layers) equal transformers: logits for any prefill chunking, greedy tokens in mixed batches,
all through the real loading path from tiny random checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import hf_greedy, make_tiny_model
from safetensors.torch import load_file, save_file

from axonserve.neuron.config import ModelConfig
from axonserve.protocol.messages import SamplingParams

from .conftest import MiniScheduler, hf_model, make_runner, runner_logits

MOE = "Qwen3MoeForCausalLM"
CASES = {
    "mistral": ("MistralForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3-bias": ("Qwen3ForCausalLM", {"attention_bias": True}),
    "qwen3-moe": (MOE, {}),  # layer 0 sparse, layer 1 dense (mlp_only_layers), top-k renormalised
    # layer 1 sparse by decoder_sparse_step, raw top-k probabilities, every expert routed to often
    "qwen3-moe-step2": (
        MOE,
        {
            "mlp_only_layers": [],
            "decoder_sparse_step": 2,
            "norm_topk_prob": False,
            "num_experts": 4,
            "num_experts_per_tok": 3,
        },
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case_dir(request, tmp_path_factory) -> str:
    arch, overrides = CASES[request.param]
    return make_tiny_model(str(tmp_path_factory.mktemp(request.param)), arch, **overrides)


def test_config_and_layers(case_dir):
    mc = ModelConfig.from_dir(case_dir)
    runner = make_runner(case_dir)
    model = runner.model
    assert type(model).__name__ == mc.architecture
    attn = model.model.layers[0].self_attn
    assert (attn.q_norm is not None) == mc.architecture.startswith("Qwen3")
    assert (attn.qkv_proj.bias is not None) == (mc.architecture == "Qwen2ForCausalLM" or mc.attention_bias)
    assert (attn.o_proj.bias is not None) == mc.attention_bias
    sparse = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in model.model.layers]
    assert sparse == [mc.is_moe_layer(i) for i in range(mc.num_layers)]
    if mc.architecture == MOE:
        assert any(sparse) and not all(sparse)


def test_logits_match_transformers(case_dir):
    runner = make_runner(case_dir)
    ids = torch.randint(0, 1024, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf_model(case_dir)(torch.tensor([ids])).logits[0]
    for chunks in ([37], [10, 1, 26], [1] * 5 + [32]):
        torch.testing.assert_close(runner_logits(runner, ids, chunks), ref, atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers(case_dir):
    g = torch.Generator().manual_seed(3)
    lengths = {"a": 13, "b": 1, "c": 4, "d": 9, "e": 22}
    prompts = {rid: torch.randint(3, 1024, (n,), generator=g).tolist() for rid, n in lengths.items()}
    arrivals = {"a": 0, "b": 0, "c": 1, "d": 3, "e": 6}
    n_new = 10
    params = SamplingParams(temperature=0.0, min_tokens=n_new, max_tokens=n_new)
    sched = MiniScheduler(make_runner(case_dir), chunk=5)
    for rid, p in prompts.items():
        sched.add(rid, p, n_new, at_step=arrivals[rid], params=params)
    got = sched.run()
    assert sched.mixed_steps > 0 and {"a", "e"} <= sched.chunked
    model = hf_model(case_dir)
    for rid, p in prompts.items():
        assert got[rid] == hf_greedy(model, p, n_new), rid


def test_fused_3d_expert_checkpoint_loads_the_same(tmp_path):
    """Experts stored as [E, 2I, H] / [E, H, I] tensors (transformers 5's in-memory layout) load too."""
    d = make_tiny_model(str(tmp_path / "per-expert"), MOE)
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    tensors = load_file(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        n = sum(1 for k in tensors if k.startswith(f"{p}.") and k.endswith(".down_proj.weight"))
        if not n:
            continue
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat((tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"])) for e in range(n)]
        )
        out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(n)])
    save_file(out, str(fused_dir / "model.safetensors"))
    (fused_dir / "config.json").write_text(json.dumps(cfg))
    ids = list(range(5, 30))
    want = runner_logits(make_runner(d), ids, [25])
    torch.testing.assert_close(runner_logits(make_runner(str(fused_dir)), ids, [25]), want, atol=0, rtol=0)


def test_sliding_window_read_from_each_config_layout(tmp_path):
    def windows(**cfg) -> list[int | None]:
        base = {
            "architectures": ["X"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "vocab_size": 100,
        }
        (tmp_path / "config.json").write_text(json.dumps({**base, **cfg}))
        return ModelConfig.from_dir(str(tmp_path)).layer_windows

    def window(**cfg) -> int | None:
        return max((w for w in windows(**cfg) if w), default=None)

    assert window() is None
    assert window(sliding_window=None) is None
    assert window(sliding_window=4096) == 4096  # Mistral v0.1: every layer
    assert window(sliding_window=4096, use_sliding_window=False, max_window_layers=2) is None  # Qwen2 default
    assert window(sliding_window=4096, use_sliding_window=True, max_window_layers=4) is None  # no layer >= 4
    assert window(sliding_window=4096, use_sliding_window=True, max_window_layers=2) == 4096
    assert window(sliding_window=64, use_sliding_window=True, layer_types=["full_attention"] * 4) is None
    assert window(sliding_window=64, layer_types=["full_attention", "sliding_attention"] * 2) == 64
    # which layers (transformers 5: Qwen2Config layer i slides when i >= max_window_layers)
    assert windows(sliding_window=8) == [8] * 4
    assert windows(model_type="qwen2", sliding_window=8, max_window_layers=2) == [None] * 4  # use_sliding_window off
    on = dict(sliding_window=8, use_sliding_window=True)
    assert windows(model_type="qwen2", max_window_layers=1, **on) == [None] + [8] * 3
    assert windows(model_type="qwen3", max_window_layers=0, **on) == [8] * 4
    mixed = ["sliding_attention", "full_attention"] * 2
    assert windows(model_type="qwen3", layer_types=mixed, **on) == [8, None, 8, None]
    mc = ModelConfig.from_dir(str(tmp_path))  # (the last one)
    assert mc.kv_window is None and mc.sliding_window == 8  # a full layer: nothing can be freed
    windows(sliding_window=8)
    assert ModelConfig.from_dir(str(tmp_path)).kv_window == 8
