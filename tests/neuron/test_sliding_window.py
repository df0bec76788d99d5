"""Sliding-window attention (ops/window.py, the native kernel's window argument) against a dense
per-sequence reference with transformers' rule (a query at p sees keys p - window < k <= p).

The blocks wholly before a sequence's window are filled with NaN, as if given back to the pool and
reused: any path that read them, masked or not, would return NaN."""

from __future__ import annotations

import pytest
import torch

from axonserve.neuron.ops import attention, native
from axonserve.neuron.ops.attention import AttentionMetadata, build_static, paged_attention

from .test_attention import random_block_tables

K = native.kernels()
DTYPES = [torch.float32, torch.bfloat16]
# (query_len, context_len): decodes (inside, at and far past the window), short equal chunks with a
# context (one batched call), prefill chunks with a context, first chunks shorter and longer than it
SEQS = [(1, 0), (1, 9), (1, 10), (1, 47), (1, 300), (4, 5), (4, 30), (4, 61), (20, 50), (7, 3), (25, 0), (6, 0)]


def _dense(q, k_cache, v_cache, seqs, tables, bs, scale, window):
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    hq, out, row = q.shape[1], [], 0
    for (qn, ctx), table in zip(seqs, tables):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx + qn)])
        keys = k_cache.view(-1, hkv, d)[slots].float().repeat_interleave(hq // hkv, dim=1)
        vals = v_cache.view(-1, hkv, d)[slots].float().repeat_interleave(hq // hkv, dim=1)
        kpos, qpos = torch.arange(ctx + qn)[None, :], (ctx + torch.arange(qn))[:, None]
        seen = (kpos <= qpos) & (kpos > qpos - window)
        keys, vals = keys.nan_to_num(0.0), vals.nan_to_num(0.0)  # (NaN only where `seen` is false)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + qn].float(), keys) * scale
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), vals))
        row += qn
    return torch.cat(out)


def _poison_outside(cache, seqs, tables, bs, window):
    """NaN into every block no query of its sequence can see (as a freed, reused block)."""
    for (_, ctx), table in zip(seqs, tables):
        for b in range(max(ctx - window + 1, 0) // bs):
            cache[table[b]] = float("nan")


def _case(dtype, head_dim, window, bs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks, hkv, hq = 512, 2, 6
    k_cache = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(dtype)
    tables = random_block_tables(SEQS, bs, blocks, g)
    for c in (k_cache, v_cache):
        _poison_outside(c, SEQS, tables, bs, window)
    t = sum(q for q, _ in SEQS)
    q, k, v = (torch.randn(t, h, head_dim, generator=g).to(dtype) for h in (hq, hkv, hkv))
    return k_cache, v_cache, tables, q, k, v


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("window", [10, 16, 1])
def test_torch_paths_attend_within_the_window(window):
    k_cache, v_cache, tables, q, k, v = _case(torch.float32, 8, window)
    meta = AttentionMetadata.build([q for q, _ in SEQS], [c for _, c in SEQS], tables, 4)
    wmeta = meta.for_window(window)
    assert wmeta is meta.for_window(window) and meta.for_window(None) is meta  # built once per step
    assert wmeta.num_decodes == 5 and wmeta.short[0] == 3 and wmeta.window == window
    out = paged_attention(q, k, v, k_cache, v_cache, wmeta, 8**-0.5)
    assert not out.isnan().any()
    ref = _dense(q, k_cache, v_cache, SEQS, tables, 4, 8**-0.5, window)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


@pytest.mark.skipif(K is None, reason="native kernels unavailable (no compiler)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24])  # vector path, scalar path
@pytest.mark.parametrize("window", [10, 16, 1])
def test_native_kernel_skips_keys_outside_the_window(dtype, head_dim, window, monkeypatch):
    """Every row through the kernel (and, as served, the long chunks through SDPA)."""
    k_cache, v_cache, tables, q, k, v = _case(dtype, head_dim, window)
    args = ([q for q, _ in SEQS], [c for _, c in SEQS], tables, 4)
    slots = AttentionMetadata.build(*args).slot_mapping  # the step's own K/V first, as paged_attention does
    k_cache.view(-1, 2, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, 2, head_dim).index_copy_(0, slots, v)
    ref = _dense(q, k_cache, v_cache, SEQS, tables, 4, head_dim**-0.5, window).to(dtype)
    for limit in (10**9, 16):  # all rows native; chunks of 16+ tokens through the windowed SDPA masks
        monkeypatch.setattr(attention, "NATIVE_MAX_QUERY", limit)
        meta = AttentionMetadata.build(*args, native=K).for_window(window)
        out = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, head_dim**-0.5)
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.skipif(K is None, reason="native kernels unavailable (no compiler)")
def test_native_kernel_without_window_is_unchanged():
    """window=0 is the full-attention kernel, bit for bit, on the multi-threaded split too."""
    g = torch.Generator().manual_seed(5)
    seqs = [(1, 700)] * 6 + [(1, 40)]
    tables = random_block_tables(seqs, 16, 512, g)
    kc, vc = (torch.randn(512, 16, 2, 64, generator=g) for _ in range(2))
    q = torch.randn(len(seqs), 8, 64, generator=g)
    meta = AttentionMetadata.build([1] * len(seqs), [c for _, c in seqs], tables, 16, native=K)
    a, b = torch.empty_like(q), torch.empty_like(q)
    common = (kc, vc, meta.native_block_table, meta.native_row_seq, meta.native_row_kv_len, 0.125)
    K.paged_attention(a, q, *common)
    K.paged_attention(b, q, *common, window=0)
    assert torch.equal(a, b)
    K.paged_attention(b, q, *common, window=10**6)  # a window longer than every row: all keys
    assert torch.equal(a, b)


def test_bucketed_steps_mask_the_window():
    """build_static (bucketing mode): padded shapes, the window as a mask only."""
    g = torch.Generator().manual_seed(7)
    bs, window, hkv, hq, d = 4, 10, 2, 4, 8
    seqs = [(6, 20), (5, 0)]
    tables = random_block_tables(seqs, bs, 64, g)
    kc, vc = (torch.randn(65, bs, hkv, d, generator=g) for _ in range(2))
    meta, src, last = build_static([6, 5], [20, 0], tables, bs, ("prefill", 2, 8, 32), pad_block=64)
    wmeta = meta.for_window(window)
    qp = torch.randn(16, hq, d, generator=g)
    kp, vp = torch.randn(16, hkv, d, generator=g), torch.randn(16, hkv, d, generator=g)
    out = paged_attention(qp, kp, vp, kc, vc, wmeta, d**-0.5)
    rows = torch.tensor([r for r in range(16) if src[r] >= 0])
    q, k, v = qp[rows], kp[rows], vp[rows]
    kc2, vc2 = kc.clone(), vc.clone()
    ref_meta = AttentionMetadata.build([6, 5], [20, 0], tables, bs).for_window(window)
    ref = paged_attention(q, k, v, kc2, vc2, ref_meta, d**-0.5)
    torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)


# tiny sliding-window models: every layer slides (Mistral, Qwen2), mixed full / sliding layers by
# max_window_layers (Qwen2) and by layer_types (Qwen3)
SWA_CASES = {
    "mistral": ("MistralForCausalLM", {"sliding_window": 16}),
    "qwen2": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}),
    "qwen2-mixed": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
    "qwen3-mixed": (
        "Qwen3ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}


@pytest.fixture(scope="module", params=list(SWA_CASES))
def swa_dir(request, tmp_path_factory) -> str:
    from conftest import make_tiny_model

    arch, overrides = SWA_CASES[request.param]
    return make_tiny_model(str(tmp_path_factory.mktemp(request.param)), arch, **overrides)


@pytest.mark.parametrize("path", ["torch", "native", "fused"])
def test_model_logits_past_the_window_match_transformers(swa_dir, path, monkeypatch):
    """Logits at every position of a prompt ~4x the window, prefilled whole (a first chunk longer
    than the window), in chunks that start past it, and token by token, against transformers'
    eager attention (its sliding_window_causal mask)."""
    from transformers import AutoModelForCausalLM

    from axonserve.neuron.config import ModelConfig

    from .conftest import make_runner, runner_logits

    mc = ModelConfig.from_dir(swa_dir)
    assert mc.sliding_window in (12, 16) and mc.max_model_len_for(None) == 512  # no longer capped at the window
    if path != "torch" and K is None:
        pytest.skip("native kernels unavailable")
    monkeypatch.setenv("AXONSERVE_FUSED", "1" if path == "fused" else "0")
    runner = make_runner(swa_dir)
    assert [layer.self_attn.window for layer in runner.model.model.layers] == mc.layer_windows
    if path == "torch":
        runner.native = None
    ids = torch.randint(0, 1024, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(swa_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for chunks in ([60], [20, 9, 1, 1, 29], [30] + [1] * 30):
        torch.testing.assert_close(runner_logits(runner, ids, chunks), ref, atol=1e-4, rtol=1e-4)


def test_unsupported_settings_are_refused_at_start_up(tmp_path):
    """EngineConfig reads the model's windows and refuses what does not honour them, naming the
    way out; --disable-sliding-window serves full attention, capped at the window."""
    from conftest import make_tiny_model

    from axonserve.config import EngineConfig, SpeculativeConfig
    from axonserve.engine.sliding_window import check_model_dir

    from .conftest import make_runner

    d = make_tiny_model(str(tmp_path / "m"), "MistralForCausalLM", sliding_window=16)
    refused = "sliding-window attention .* not supported with .*--disable-sliding-window"
    for kw in ({"speculative": SpeculativeConfig(method="ngram", num_speculative_tokens=2)}, {"role": "decode"}):
        with pytest.raises(ValueError, match=refused):
            EngineConfig(model=d, **kw)
    xla = EngineConfig(model=d)  # (EngineConfig itself needs torch-xla for --device xla: the check alone)
    xla.device = "xla"
    with pytest.raises(ValueError, match=refused.replace("with ", "with --device xla")):
        check_model_dir(xla)
    EngineConfig(model=d, speculative=SpeculativeConfig(method="ngram"), disable_sliding_window=True)
    runner = make_runner(d, disable_sliding_window=True)
    assert runner.max_model_len == 16 and runner.kv_window is None
    assert all(layer.self_attn.window is None for layer in runner.model.model.layers)
    with pytest.raises(ValueError, match="exceeds it; use --max-model-len 16 or less"):
        make_runner(d, disable_sliding_window=True, max_model_len=17)
    assert make_runner(d).max_model_len == 512 and make_runner(d).kv_window == 16


@pytest.mark.skipif(K is None, reason="native kernels unavailable (no compiler)")
def test_multi_step_decode_run_windows_through_the_kernel():
    """DecodeRun's native metadata (no rebuild) gets the window as the kernel's argument: equal to a
    step built with AttentionMetadata.build; a torch-path metadata without a rebuild is refused."""
    from axonserve.neuron.ops.attention import DecodeRun

    g = torch.Generator().manual_seed(9)
    ctx, steps, bs, window = [40, 23, 9], [4, 3, 2], 4, 10
    tables = random_block_tables([(s, c) for s, c in zip(steps, ctx)], bs, 128, g)
    kc, vc = (torch.randn(128, bs, 2, 64, generator=g) for _ in range(2))
    run = DecodeRun(ctx, tables, steps, bs, native=K)
    for s, m in ((0, 3), (2, 1)):
        q, k, v = (
            torch.randn(m, 6, 64, generator=g),
            torch.randn(m, 2, 64, generator=g),
            torch.randn(m, 2, 64, generator=g),
        )
        got = paged_attention(q, k, v, kc, vc, run.meta(s, m).for_window(window), 0.125)
        pos = [c + s for c in ctx[:m]]
        want = paged_attention(
            q, k, v, kc, vc, AttentionMetadata.build([1] * m, pos, tables[:m], bs).for_window(window), 0.125
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    bare = AttentionMetadata(positions=torch.zeros(1, dtype=torch.long), slot_mapping=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="cannot be rebuilt"):
        bare.for_window(window)
