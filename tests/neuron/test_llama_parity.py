"""Tiny random Llama: logits and greedy generation equal transformers through the real loading path."""

from __future__ import annotations

import pytest
import torch

from axonserve.neuron.model_source import resolve_model
from axonserve.neuron.ops import native
from axonserve.neuron.ops.attention import AttentionMetadata
from axonserve.protocol.messages import SamplingParams

from .conftest import MiniScheduler, hf_model, make_runner, make_tiny_llama, runner_logits


@pytest.fixture(params=["native", "torch"])
def kernels_path(request, monkeypatch):
    """Each parity test runs on the fused C++ kernels (when built) and on the plain torch path."""
    if request.param == "torch":
        monkeypatch.setattr(native, "_state", {"mod": None})
    elif native.kernels() is None:
        pytest.skip("native kernels unavailable")
    return request.param


def test_logits_match_transformers(tiny_llama_dir, kernels_path):
    runner = make_runner(resolve_model(tiny_llama_dir))
    assert (runner.native is not None) == (kernels_path == "native")
    ids = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf_model(tiny_llama_dir)(torch.tensor([ids])).logits[0]
    # short chunks, decodes, and chunks of NATIVE_MAX_QUERY+ tokens (the SDPA path) first and after a context
    for chunks in ([37], [10, 1, 26], [1] * 5 + [32], [150, 2, 148], [20, 280]):
        ref_n = ref[: sum(chunks)]
        got = runner_logits(runner, ids, chunks)
        torch.testing.assert_close(got, ref_n, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_parity(tmp_path):
    d = make_tiny_llama(
        str(tmp_path),
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        rope_theta=500000.0,
    )
    runner = make_runner(d)
    assert runner.model_config.rope_scaling["rope_type"] == "llama3"
    ids = torch.randint(0, 1024, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf_model(d)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(runner_logits(runner, ids, [50, 40]), ref, atol=1e-4, rtol=1e-4)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_generation_matches_transformers(tiny_llama_dir, kernels_path):
    g = torch.Generator().manual_seed(3)
    prompts = {
        "a": torch.randint(3, 1024, (13,), generator=g).tolist(),  # chunked 5+5+3
        "b": torch.randint(3, 1024, (1,), generator=g).tolist(),  # one-token prompt: decode path from the start
        "c": torch.randint(3, 1024, (4,), generator=g).tolist(),  # exactly one block
        "d": torch.randint(3, 1024, (9,), generator=g).tolist(),  # arrives later, prefills while others decode
        "e": torch.randint(3, 1024, (22,), generator=g).tolist(),  # arrives later still, long chunked prefill
    }
    arrivals = {"a": 0, "b": 0, "c": 1, "d": 3, "e": 6}
    n_new = 12
    # min_tokens = max_tokens mirrors min_new_tokens in transformers (EOS masked throughout)
    params = SamplingParams(temperature=0.0, min_tokens=n_new, max_tokens=n_new)
    sched = MiniScheduler(make_runner(tiny_llama_dir), chunk=5)
    for rid, p in prompts.items():
        sched.add(rid, p, n_new, at_step=arrivals[rid], params=params)
    got = sched.run()
    assert sched.mixed_steps > 0 and {"a", "e"} <= sched.chunked
    model = hf_model(tiny_llama_dir)
    for rid, p in prompts.items():
        assert got[rid] == hf_greedy(model, p, n_new), rid


def test_bfloat16_close_to_transformers_bfloat16(tiny_llama_dir, kernels_path):
    from transformers import AutoModelForCausalLM

    ids = list(range(5, 40))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)(torch.tensor([ids])).logits[0]
    got = runner_logits(make_runner(tiny_llama_dir, dtype="bfloat16"), ids, [20, 15])
    assert got.dtype == torch.bfloat16

    torch.testing.assert_close(
        got.float(), ref.float(), atol=0.1, rtol=0.05
    )  # a few bf16 ulps: fused matmuls round differently


@pytest.mark.parametrize("tiles", ["1", "0"])
def test_bfloat16_prefill_chunks_close_to_transformers(tmp_path, tiles, monkeypatch):
    """head_dim 64: a bf16 model's prefill chunks (first and after a context) run on the native
    kernel's flash attention (runner.native_chunks), on AMX tiles or ("0") AVX512-BF16's dot product,
    as close to transformers' bf16 as the SDPA path gets."""
    from transformers import AutoModelForCausalLM

    k = native.kernels()
    if k is None or not k.chunk_attention(64) or (tiles == "1" and not k.amx_attention(64)):
        pytest.skip("no AMX tiles (or AVX512-BF16) on this CPU")
    monkeypatch.setenv("AXONSERVE_AMX_ATTENTION", tiles)
    d = make_tiny_llama(str(tmp_path), hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    ids = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)(torch.tensor([ids])).logits[0]
    runner = make_runner(d, dtype="bfloat16")
    assert runner.native_chunks
    got = runner_logits(runner, ids, [150, 2, 148])
    torch.testing.assert_close(got.float(), ref.float(), atol=0.1, rtol=0.05)


def test_bfloat16_decodes_sharing_a_prefix_close_to_transformers(tmp_path):
    """head_dim 64, bf16: four sequences on one 160-token prefix (its blocks in every table, written
    once, as prefix caching leaves them) decode in one batch, the prefix's keys read once for all
    (csrc/amx_attention.h, shared prefixes): each row's logits as close to transformers' bf16 over
    its whole sequence as the same row decoded alone (the per-row kernel)."""
    from transformers import AutoModelForCausalLM

    if native.kernels() is None or not native.kernels().amx_attention(64):
        pytest.skip("no AMX tiles on this CPU")
    d = make_tiny_llama(str(tmp_path), hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    runner = make_runner(d, dtype="bfloat16", block_size=16)
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(0, 1024, (160,), generator=g).tolist()
    owns = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (5, 17, 30, 9)]
    free = iter(torch.randperm(runner.num_kv_blocks, generator=g).tolist())
    shared = [next(free) for _ in range(10)]
    tables = [shared + [next(free) for _ in range(-(-len(o) // 16))] for o in owns]

    def forward(ids: list[int], query_lens: list[int], contexts: list[int], tabs: list[list[int]]) -> torch.Tensor:
        meta = AttentionMetadata.build(query_lens, contexts, tabs, 16, native=runner.native, native_chunks=True)
        with torch.inference_mode():
            return runner.model.compute_logits(runner.model(torch.tensor(ids), meta.positions, runner.kv_caches, meta))

    forward(prefix, [160], [0], [shared])  # the prefix, once
    for o, t in zip(owns, tables):  # each sequence's own tokens but its last, after the prefix
        forward(o[:-1], [len(o) - 1], [160], [t])
    ctx = [160 + len(o) - 1 for o in owns]
    batched = forward([o[-1] for o in owns], [1] * 4, ctx, tables).float()
    alone = torch.cat([forward([o[-1]], [1], [c], [t]) for o, c, t in zip(owns, ctx, tables)]).float()
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([prefix + o])).logits[0, -1] for o in owns]).float()
    err, alone_err = (batched - ref).abs().max().item(), (alone - ref).abs().max().item()
    torch.testing.assert_close(batched, ref, atol=0.1, rtol=0.05)
    assert err <= 1.5 * alone_err + 0.02, (err, alone_err)
    assert batched.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_multi_step_plans_decode_like_transformers(tiny_llama_dir, kernels_path):
    """Multi-step plans (the runner feeds each forward's sample to the next) generate transformers'
    greedy tokens on both attention paths, across block boundaries (4-token blocks), with runs of
    unequal length in one plan."""
    from axonserve.protocol.messages import CachedRequestData, NewRequestData, StepPlan

    runner = make_runner(resolve_model(tiny_llama_dir))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (3, 10)]
    model = hf_model(tiny_llama_dir)
    ref = [hf_greedy(model, p, 14) for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=14)
    new = [
        NewRequestData(f"r{i}", p, len(p), list(range(i * 8, i * 8 + 8))[::-1], 0, greedy)
        for i, p in enumerate(prompts)
    ]
    res = runner.execute(StepPlan(1, new=new, num_scheduled_tokens=[len(p) for p in prompts]))
    got = {rid: [t] for rid, t in zip(res.request_ids, res.sampled_token_ids)}
    cached = [CachedRequestData("r0", []), CachedRequestData("r1", [])]
    for step, ns in [(2, [5, 5]), (3, [7, 3]), (4, [1, 4])]:
        res = runner.execute(StepPlan(step, cached=cached, num_scheduled_tokens=ns, multi_step=True))
        assert res.error is None, res.error
        at = 0
        for rid, m in zip(res.request_ids, res.num_sampled):
            got[rid] += res.sampled_token_ids[at : at + m]
            at += m
    assert got["r0"] == ref[0] and got["r1"] == ref[1][:13]  # 1 + 5 + 7 + 1 and 1 + 5 + 3 + 4 tokens
