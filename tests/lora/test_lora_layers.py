"""The ranks' LoRA machinery in process (a real ModelRunner on a tiny Llama): one forward over
rows of two adapters (different ranks and targets) and base rows gives, per row, transformers'
logits with that adapter merged (within float32 tolerance); slots are evicted least recently used
and re-filled from the host LRU or, past `max_cpu_loras`, from disk."""

from __future__ import annotations

import pytest
import torch

from axonserve.config import EngineConfig
from axonserve.neuron.model_runner import ModelRunner, RequestState
from axonserve.neuron.ops.attention import AttentionMetadata
from axonserve.protocol.messages import LoraSpec, SamplingParams
from lora.lora_helpers import make_adapter, merged_model


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-layers")
    return {
        "a": make_adapter(tiny_llama_dir, str(root / "a"), r=8, seed=1),
        "b": make_adapter(tiny_llama_dir, str(root / "b"), r=4, targets=["q_proj", "v_proj", "down_proj"], seed=2),
    }


def runner(model_dir: str, **kw) -> ModelRunner:
    cfg = dict(block_size=4, num_kv_blocks=64, threads=1, enable_lora=True, max_lora_rank=8, **kw)
    return ModelRunner(EngineConfig(model=model_dir, **cfg))


def state(rid: str, ids: list[int], lora: LoraSpec | None) -> RequestState:
    return RequestState(rid, ids, len(ids), [], 0, SamplingParams(), None, lora=lora)


def batch_logits(r: ModelRunner, seqs: list[tuple[RequestState, list[int]]]) -> list[torch.Tensor]:
    """Every position's logits of each sequence, all prefilled in ONE forward."""
    assert not r.lora.load([st for st, _ in seqs])
    blocks, nxt = [], 0
    for _, ids in seqs:
        n = -(-len(ids) // r.block_size)
        blocks.append(list(range(nxt, nxt + n)))
        nxt += n
    lens = [len(ids) for _, ids in seqs]
    meta = AttentionMetadata.build(lens, [0] * len(seqs), blocks, r.block_size, native=r.native)
    r.lora.map_rows([(st, len(ids)) for st, ids in seqs])
    with torch.inference_mode():
        h = r.model(torch.tensor([t for _, ids in seqs for t in ids]), meta.positions, r.kv_caches, meta)
        logits = r.model.compute_logits(h)
    return list(logits.split(lens))


def hf_logits(base_dir: str, adapter: str | None, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return merged_model(base_dir, adapter)(torch.tensor([ids])).logits[0]


def test_mixed_rows_match_merged_logits(tiny_llama_dir, adapters):
    r = runner(tiny_llama_dir, max_loras=2)
    A, B = LoraSpec("a", 1, adapters["a"]), LoraSpec("b", 2, adapters["b"])
    p1, p2, p3 = [5, 17, 300, 41, 99, 1000, 7], [8, 9, 10, 11, 12], [100, 200, 300]
    # adapters interleaved with base rows: A's rows are not contiguous (a gather segment)
    seqs = [(state("a1", p1, A), p1), (state("x", p2, None), p2), (state("b", p3, B), p3), (state("a2", p2, A), p2)]
    got = batch_logits(r, seqs)
    want = [
        hf_logits(tiny_llama_dir, adapters["a"], p1),
        hf_logits(tiny_llama_dir, None, p2),
        hf_logits(tiny_llama_dir, adapters["b"], p3),
        hf_logits(tiny_llama_dir, adapters["a"], p2),
    ]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)
    # the adapters really move the logits
    assert (want[3] - want[1]).abs().max() > 0.05
    assert (hf_logits(tiny_llama_dir, adapters["b"], p2) - want[1]).abs().max() > 0.05


@pytest.mark.parametrize("max_cpu, disk_loads", [(1, 3), (2, 2)])
def test_slot_lru_and_host_lru(tiny_llama_dir, adapters, max_cpu, disk_loads):
    r = runner(tiny_llama_dir, max_loras=1, max_cpu_loras=max_cpu)
    A, B = LoraSpec("a", 1, adapters["a"]), LoraSpec("b", 2, adapters["b"])
    p = [5, 17, 300, 41, 99]
    for rid, spec, path in (("1", A, adapters["a"]), ("2", B, adapters["b"]), ("3", A, adapters["a"])):
        (got,) = batch_logits(r, [(state(rid, p, spec), p)])
        torch.testing.assert_close(got, hf_logits(tiny_llama_dir, path, p), atol=2e-4, rtol=1e-4)
        assert list(r.lora.slots) == [(spec.lora_id, spec.path)]  # one slot: the last adapter holds it
    assert r.lora.num_disk_loads == disk_loads


def test_adapter_that_fails_to_load_is_reported_per_request(tiny_llama_dir, adapters, tmp_path):
    r = runner(tiny_llama_dir, max_loras=2)
    good, gone = state("g", [5, 6], LoraSpec("a", 1, adapters["a"])), state("x", [5, 6], LoraSpec("x", 2, "/nope"))
    failed = r.lora.load([good, gone, state("base", [5, 6], None)])
    assert list(failed) == ["x"] and "not a directory" in failed["x"]
    assert r.lora.load([gone]) == failed  # sticky: the request stays failed until it is dropped


def test_scattered_rows_are_gathered(tiny_llama_dir, adapters):
    """Five runs of adapter rows (more than MAX_RUNS) take the gather path; same logits."""
    from axonserve.lora.layers import MAX_RUNS

    r = runner(tiny_llama_dir, max_loras=2)
    A = LoraSpec("a", 1, adapters["a"])
    prompts = [[7 + i, 300 + i, 41] for i in range(MAX_RUNS + 1)]
    seqs = []
    for i, p in enumerate(prompts):
        seqs += [(state(f"a{i}", p, A), p), (state(f"x{i}", p, None), p)]
    got = batch_logits(r, seqs)
    assert any(not isinstance(rows, slice) for _, rows in r.lora.batch.segments)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(got[2 * i], hf_logits(tiny_llama_dir, adapters["a"], p), atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(got[2 * i + 1], hf_logits(tiny_llama_dir, None, p), atol=2e-4, rtol=1e-4)
