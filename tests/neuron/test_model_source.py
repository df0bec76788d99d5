"""Model resolution, registry and runner error paths."""

from __future__ import annotations

import json
import os

import pytest

from axonserve.neuron.config import ModelConfig
from axonserve.neuron.model_source import resolve_model
from axonserve.neuron.registry import model_class
from axonserve.protocol.messages import CachedRequestData, StepPlan

from .conftest import make_runner


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'nope'.*nothing is downloaded"):
        resolve_model("nope")
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model(str(tmp_path))  # a directory without config.json


def test_directory_resolves_to_itself(tiny_llama_dir):
    assert resolve_model(tiny_llama_dir) == os.path.abspath(tiny_llama_dir)


def test_unsupported_architecture():
    with pytest.raises(
        ValueError, match="architecture GPT2LMHeadModel is not supported; supported: .*LlamaForCausalLM"
    ):
        model_class("GPT2LMHeadModel")


def test_model_config_reads_eos_union_and_rope(tmp_path):
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        eos_token_id=[2, 3],
        rope_scaling={"type": "linear", "factor": 2.0},
        rope_theta=1e4,
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    mc = ModelConfig.from_dir(str(tmp_path))
    assert mc.eos_token_ids == [2, 3, 5]
    assert mc.head_dim == 16 and mc.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert mc.kv_bytes_per_token("float32") == 2 * 2 * 2 * 16 * 4
    assert mc.kv_bytes_per_token("bfloat16") == 2 * 2 * 2 * 16 * 2


def test_bad_plan_returns_error_not_crash(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    res = runner.execute(StepPlan(7, cached=[CachedRequestData("ghost")], num_scheduled_tokens=[1]))
    assert res.step_id == 7 and "ghost" in res.error


def test_kv_blocks_sized_from_memory(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir, num_kv_blocks=None, kv_cache_memory_fraction=0.0001, max_model_len=256)
    per_block = runner.block_size * runner.model_config.kv_bytes_per_token("float32")
    assert runner.num_kv_blocks >= 1 and runner.kv_caches[0][0].shape[0] == runner.num_kv_blocks
    assert runner.num_kv_blocks * per_block < 0.0002 * 64 * 2**30
    assert runner.max_model_len == 256 and runner.eos_token_ids == [2]
