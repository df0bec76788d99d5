"""GGUF conversion on a tiny llama written as GGUF by the tests (F32, llama.cpp's Q/K permutation)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from axonserve.neuron.config import ModelConfig
from axonserve.neuron.model_source import resolve_model

from .conftest import TINY, hf_model, make_runner, runner_logits

_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's Q/K row permutation."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: str, path: str) -> None:
    import gguf
    from safetensors.torch import load_file

    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(TINY["num_hidden_layers"])
    w.add_context_length(TINY["max_position_embeddings"])
    w.add_embedding_length(TINY["hidden_size"])
    w.add_feed_forward_length(TINY["intermediate_size"])
    w.add_head_count(TINY["num_attention_heads"])
    w.add_head_count_kv(TINY["num_key_value_heads"])
    w.add_key_length(TINY["head_dim"])
    w.add_value_length(TINY["head_dim"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(TINY["vocab_size"])
    w.add_eos_token_id(2)
    for name, t in sd.items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.<module...>.weight
            g = f"blk.{parts[2]}.{_NAMES['.'.join(parts[3:-1])]}.weight"
            if g.endswith("attn_q.weight"):
                a = _permute(a, TINY["num_attention_heads"])
            elif g.endswith("attn_k.weight"):
                a = _permute(a, TINY["num_key_value_heads"])
        w.add_tensor(g, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_gguf(tiny_llama_dir, path)
    return path


def test_gguf_converts_to_equal_logits(tiny_llama_dir, tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("AXONSERVE_CACHE_DIR", str(tmp_path))
    d = resolve_model(tiny_gguf)
    assert d.startswith(str(tmp_path)) and resolve_model(tiny_gguf) == d
    mc = ModelConfig.from_dir(d)
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.eos_token_ids) == (4, 2, 16, [2])
    assert mc.tie_word_embeddings == ModelConfig.from_dir(tiny_llama_dir).tie_word_embeddings
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf_model(tiny_llama_dir)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(runner_logits(make_runner(d), ids, [20, 17]), ref, atol=1e-5, rtol=1e-5)


def _resolve(path: str, cache: str, out) -> None:
    os.environ["AXONSERVE_CACHE_DIR"] = cache
    out.put(resolve_model(path))


def test_concurrent_conversions_agree(tiny_gguf, tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_resolve, args=(tiny_gguf, str(tmp_path), q)) for _ in range(2)]
    for p in procs:
        p.start()
    dirs = {q.get(timeout=120) for _ in procs}
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len(dirs) == 1
    (d,) = dirs
    assert os.path.isfile(os.path.join(d, "model.safetensors"))
    assert os.listdir(os.path.dirname(d)) == [os.path.basename(d)]  # no temp dirs left behind


def test_conversions_are_keyed_by_content_and_stale_ones_go(tiny_gguf, tmp_path, monkeypatch):
    """Two clones' venvs hold the same GGUF at different paths: one conversion serves both (a
    path key left a 0.5 GB copy per clone and filled CI's disk). Changed bytes convert anew, and
    a conversion unused for an hour is removed when its file name is converted again."""
    import shutil

    cache = tmp_path / "cache"
    monkeypatch.setenv("AXONSERVE_CACHE_DIR", str(cache))
    other = tmp_path / "clone2"
    other.mkdir()
    shutil.copy(tiny_gguf, other / "tiny.gguf")
    first = resolve_model(tiny_gguf)
    assert resolve_model(str(other / "tiny.gguf")) == first
    stale = cache / "gguf" / "tiny-0123456789abcdef"
    crashed = cache / "gguf" / ".tmp-crashed"
    for d in (stale, crashed):
        d.mkdir()
        os.utime(d, (1, 1))
    with open(other / "tiny.gguf", "ab") as f:
        f.write(b"\0" * 32)  # GGUF readers ignore trailing bytes; the content key does not
    second = resolve_model(str(other / "tiny.gguf"))
    assert second != first
    assert sorted(os.listdir(cache / "gguf")) == sorted({os.path.basename(first), os.path.basename(second)})


def test_gguf_precision_is_declared_for_dtype_auto(tiny_llama_dir, tiny_gguf, tmp_path, monkeypatch):
    """`--dtype auto` serves a checkpoint at its own precision: an all-F32 GGUF stays float32, one
    with 16-bit (or quantized) weights is a bf16 checkpoint, run in bf16 where the CPU has it."""
    import json

    import gguf

    from axonserve.config import EngineConfig, cpu_has_bf16

    monkeypatch.setenv("AXONSERVE_CACHE_DIR", str(tmp_path))
    f32 = resolve_model(tiny_gguf)
    half_path = str(tmp_path / "half.gguf")
    r = gguf.GGUFReader(tiny_gguf)
    w = gguf.GGUFWriter(half_path, "llama")
    for field in r.fields.values():
        if field.name.startswith(("llama.", "tokenizer.")):
            sub = field.types[-1] if len(field.types) > 1 else None
            w.add_key_value(field.name, field.contents(), field.types[0], sub)
    for t in r.tensors:
        a = np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist())))
        w.add_tensor(t.name, a.astype(np.float16) if a.ndim == 2 else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    half = resolve_model(half_path)
    declared = [json.load(open(os.path.join(d, "config.json")))["torch_dtype"] for d in (f32, half)]
    assert declared == ["float32", "bfloat16"]
    fast = "bfloat16" if cpu_has_bf16() else "float32"
    resolved = [EngineConfig(model=d, dtype="auto").dtype for d in (f32, half, tiny_llama_dir)]
    assert resolved == ["float32", fast, "float32"]
    assert EngineConfig(model=half).dtype == "float32"  # the struct's own default stays explicit


def test_serve_defaults_to_dtype_auto(smollm2_dir):
    """The README's serve command: the default model (a Q4_1 GGUF) runs in bf16 on a bf16 CPU."""
    import argparse

    from axonserve.cli import add_engine_args, engine_config
    from axonserve.config import cpu_has_bf16

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args([])
    assert args.dtype == "auto"
    assert engine_config(args).dtype == ("bfloat16" if cpu_has_bf16() else "float32")
    assert engine_config(p.parse_args(["--dtype", "float32"])).dtype == "float32"
