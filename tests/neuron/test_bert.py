"""BERT encoder + pooling (embed task) against transformers.

A tiny random BertModel saved by the test checks hidden states over our flat batch (mixed and
equal lengths) and every pooling type; the real all-MiniLM-L6-v2 checks the sentence-
transformers pipeline (mean pooling over the attention mask, L2 normalize) to 1e-5; the
runner checks the engine's pooling step (whole prompts, one vector each, no KV cache).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from embedding_reference import hf_encoder, hf_hidden, minilm_dir, st_embed

from axonserve.neuron.config import ModelConfig
from axonserve.neuron.loader import load_model
from axonserve.neuron.models.bert import EncoderBatch
from axonserve.neuron.pooling import EMBEDDING_ARCHITECTURES, PoolingConfig, pool, resolve_task
from axonserve.neuron.registry import model_class
from axonserve.protocol.messages import NewRequestData, PoolingParams, SamplingParams, StepPlan

from .conftest import make_runner

ATOL = 1e-5
TINY_BERT = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 64,
    "type_vocab_size": 2,
}


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory) -> str:
    from transformers import BertConfig, BertModel

    path = str(tmp_path_factory.mktemp("tiny-bert"))
    torch.manual_seed(0)
    model = BertModel(BertConfig(**TINY_BERT), add_pooling_layer=True).eval()
    with torch.no_grad():  # larger than the default init, so attention is far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def ours(path: str):
    return load_model(ModelConfig.from_dir(path), torch.float32, progress=False)


def flat_hidden(model, seqs: list[list[int]]) -> torch.Tensor:
    lens = [len(s) for s in seqs]
    with torch.inference_mode():
        return model(torch.tensor([t for s in seqs for t in s]), EncoderBatch.build(lens))


SEQS = {
    "mixed": [[5, 17, 300, 41, 8, 9, 120], [3], [77, 78, 79, 80, 900, 2, 44, 45, 46, 47, 48], [10, 11]],
    "equal": [[5, 6, 7, 8], [9, 10, 11, 12], [300, 301, 302, 303]],
    "single": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]],
}


@pytest.mark.parametrize("case", SEQS)
def test_tiny_bert_hidden_states_match_transformers(tiny_bert_dir, case):
    seqs = SEQS[case]
    h = flat_hidden(ours(tiny_bert_dir), seqs)
    off = 0
    for s in seqs:  # each sequence alone in transformers: no padding involved on its side
        ref, _ = hf_hidden(tiny_bert_dir, [s])
        torch.testing.assert_close(h[off : off + len(s)], ref[0], atol=ATOL, rtol=0)
        off += len(s)
    assert off == h.shape[0]


def _reference_pool(h: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """sentence-transformers' Pooling module on a padded batch."""
    m = mask[..., None].to(h.dtype)
    lens = mask.sum(1)
    if kind == "cls":
        return h[:, 0]
    if kind == "last":
        return h[torch.arange(h.shape[0]), lens - 1]
    if kind == "max":
        return h.masked_fill(m == 0, -1e9).amax(1)
    s = (h * m).sum(1)
    return s / lens[:, None] if kind == "mean" else s / lens[:, None].to(h.dtype).sqrt()


@pytest.mark.parametrize("kind", ["mean", "cls", "last", "max", "mean_sqrt_len"])
def test_pooling_types_match_sentence_transformers(tiny_bert_dir, kind):
    seqs = SEQS["mixed"]
    h = flat_hidden(ours(tiny_bert_dir), seqs)
    ref_h, mask = hf_hidden(tiny_bert_dir, seqs)
    ref = _reference_pool(ref_h, mask, kind)
    lens = [len(s) for s in seqs]
    torch.testing.assert_close(pool(h, lens, kind, [False] * 4), ref, atol=ATOL, rtol=0)
    got = pool(h, lens, kind, [True, False, True, False])  # per-request normalize
    torch.testing.assert_close(got[0::2], F.normalize(ref[0::2], dim=-1), atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1::2], ref[1::2], atol=ATOL, rtol=0)


def test_bert_without_sentence_transformers_files_pools_cls_normalized(tiny_bert_dir):
    model = ours(tiny_bert_dir)
    assert model.pooling == PoolingConfig("cls", True)  # vLLM's default for BERT
    seqs = SEQS["mixed"]
    got = model.pool(flat_hidden(model, seqs), [len(s) for s in seqs], [None, False, None, None])
    ref_h, _ = hf_hidden(tiny_bert_dir, seqs)
    torch.testing.assert_close(got[0], F.normalize(ref_h[0, 0], dim=-1), atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], ref_h[1, 0], atol=ATOL, rtol=0)


def _write_st(path: str, pooling: dict, extra_modules: tuple[str, ...] = ("Normalize",)) -> None:
    mods = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    for i, m in enumerate(extra_modules, 2):
        mods.append({"idx": i, "name": str(i), "path": f"{i}_{m}", "type": f"sentence_transformers.models.{m}"})
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(mods, f)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, **pooling}, f)


def test_pooling_config_from_sentence_transformers_files(tmp_path):
    d = str(tmp_path)
    assert PoolingConfig.from_dir(d) == PoolingConfig("cls", True)
    _write_st(d, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False})
    assert PoolingConfig.from_dir(d) == PoolingConfig("mean", True)
    _write_st(d, {"pooling_mode_lasttoken": True}, extra_modules=())
    assert PoolingConfig.from_dir(d) == PoolingConfig("last", False)
    _write_st(d, {"pooling_mode": "max"})
    assert PoolingConfig.from_dir(d) == PoolingConfig("max", True)
    assert PoolingConfig.from_dir(minilm_dir()) == PoolingConfig("mean", True)
    _write_st(d, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True})
    with pytest.raises(ValueError, match="exactly one"):
        PoolingConfig.from_dir(d)
    _write_st(d, {"pooling_mode_mean_tokens": True}, extra_modules=("Dense",))
    with pytest.raises(ValueError, match="Dense.*not supported"):
        PoolingConfig.from_dir(d)


def test_task_resolution(tiny_bert_dir, tiny_llama_dir):
    assert resolve_task(tiny_bert_dir) == "embed"
    assert resolve_task(minilm_dir(), "auto") == "embed"
    assert resolve_task(tiny_bert_dir, "embedding") == "embed"
    assert resolve_task(tiny_llama_dir) == "generate"
    with pytest.raises(ValueError, match="encoder.*serves only the embed task"):
        resolve_task(tiny_bert_dir, "generate")
    with pytest.raises(ValueError, match="LlamaForCausalLM.*cannot serve the embed task"):
        resolve_task(tiny_llama_dir, "embed")
    with pytest.raises(ValueError, match="unknown task"):
        resolve_task(tiny_bert_dir, "classify")
    for arch in EMBEDDING_ARCHITECTURES:  # pooling.py's torch-free list agrees with the registry
        assert getattr(model_class(arch), "is_pooling_model", False)


# --------------------------------------------------------------------------- the real model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map sentences to vectors.",
    "Hi",
    (
        "A considerably longer sentence, with punctuation; numbers like 3.14159 and 2026, and "
        "some rarer words such as sesquipedalian and antidisestablishmentarianism."
    ),
]


def test_minilm_matches_transformers_mean_pooling_normalized():
    model = ours(minilm_dir())
    _, tok = hf_encoder(minilm_dir())
    ids = [tok.encode(t) for t in TEXTS]
    got = model.pool(flat_hidden(model, ids), [len(x) for x in ids], [None] * len(ids))
    ref = st_embed(minilm_dir(), TEXTS)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(ids)), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- runner


def _plan(step: int, seqs: list[list[int]], normalize: list[bool | None], chunk: int | None = None) -> StepPlan:
    new = [
        NewRequestData(f"r{i}", s, len(s), [], 0, SamplingParams(max_tokens=1), PoolingParams(normalize=n))
        for i, (s, n) in enumerate(zip(seqs, normalize))
    ]
    return StepPlan(step, new=new, num_scheduled_tokens=[chunk or len(s) for s in seqs])


def test_runner_pooling_step(tiny_bert_dir):
    runner = make_runner(tiny_bert_dir)
    assert runner.task == "embed" and runner.num_kv_blocks == 0 and runner.kv_caches == []
    assert runner.max_model_len == TINY_BERT["max_position_embeddings"]
    seqs = SEQS["mixed"]
    res = runner.execute(_plan(1, seqs, [None, False, None, True]))
    assert res.error is None and res.request_ids == []  # nothing sampled
    assert res.pooled_request_ids == ["r0", "r1", "r2", "r3"]
    assert res.pooled is not None and res.pooled.index == 1 and res.pooled.shape == [4, 64]
    (vectors,) = runner.result_tensors
    assert vectors.dtype == torch.float32 and vectors.shape == (4, 64)
    ref_h, _ = hf_hidden(tiny_bert_dir, seqs)
    ref = ref_h[:, 0]  # CLS
    torch.testing.assert_close(vectors[1], ref[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(vectors[[0, 2, 3]], F.normalize(ref[[0, 2, 3]], dim=-1), atol=ATOL, rtol=0)
    assert runner.requests == {}  # done requests leave the worker at once
    # a pooling request scheduled in pieces is a scheduler bug: the step fails loudly
    bad = runner.execute(_plan(2, [[1, 2, 3, 4]], [None], chunk=2))
    assert bad.error and "whole" in bad.error
    runner.execute(StepPlan(3))
    assert runner.result_tensors == []


def test_runner_refuses_encoder_configs_it_cannot_run(tiny_bert_dir):
    with pytest.raises(ValueError, match="bucketing"):
        make_runner(tiny_bert_dir, bucketing=True)
    with pytest.raises(ValueError, match="exceeds the encoder's 64 positions"):
        make_runner(tiny_bert_dir, max_model_len=128)
