"""Weight-only quantization: packed kernels compute x @ dequant(W)^T, the error against the
dense weight is what the format allows, and a quantized SmolLM2 stays close to the dense one
(next-token agreement and KL over a real prompt, measured against our own bf16 forward)."""

from __future__ import annotations

import pytest
import torch

from axonserve.config import EngineConfig
from axonserve.neuron.layers.quant import INT4_GROUP, QuantizedWeight, onednn_bf16
from axonserve.neuron.model_runner import ModelRunner
from axonserve.neuron.ops.attention import AttentionMetadata


def _dequant(q: QuantizedWeight, w: torch.Tensor) -> torch.Tensor:
    """The weight the kernel multiplies by, rebuilt from the format's definition."""
    if q.method == "int8":
        return q.data.float() * q.scales.float()[:, None]
    n, k = w.shape
    g = w.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
    return (codes * scale[..., None] + lo[..., None]).reshape(n, k)


@pytest.mark.parametrize("method,tol", [("int8", 0.01), ("int4", 0.12)])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_packed_matmul_is_the_dequantized_product(method, tol, rows):
    torch.manual_seed(0)
    w, x = torch.randn(96, 128), torch.randn(rows, 128)
    q = QuantizedWeight(w, method, torch.float32)
    want = x @ _dequant(q, w).T
    torch.testing.assert_close(q.matmul(x), want, rtol=1e-4, atol=1e-3)
    rel = (q.matmul(x) - x @ w.T).norm() / (x @ w.T).norm()
    assert rel < tol, f"{method} error {rel:.4f} against the dense weight"


@pytest.mark.parametrize("rows", [0, 1, 7, 16, 17, 32, 33, 64, 65, 70])
def test_int8_amx_copy_multiplies_the_dequantized_weight(rows):
    """bf16 activations with AMX: up to 64 rows through the int8 tiles (float32 sums scaled per
    column, rounded once to bf16), more through oneDNN on the dequantized bf16 weight."""
    torch.manual_seed(2)
    w, x = torch.randn(96, 128), torch.randn(rows, 128).bfloat16()
    q = QuantizedWeight(w, "int8", torch.bfloat16)
    if q.skinny is None:
        pytest.skip("no AMX int8 kernel on this CPU")
    scale = w.abs().amax(1) / 127
    codes = (w / scale[:, None]).round().clamp(-127, 127)
    assert q.skinny_rows == 64 and codes.abs().max() == 127
    got = q.matmul(x)
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
    if rows > q.skinny_rows:
        assert torch.equal(got, torch.nn.functional.linear(x, (codes * scale[:, None]).bfloat16()))
        return
    exact = x.double() @ (codes.double() * scale.double()[:, None]).T
    ulp = exact.abs().clamp_min(1e-30).log2().floor().exp2() * 2**-7
    slack = (x.double().abs() @ (codes.double().abs() * scale.double()[:, None]).T) * 1e-6
    assert ((got.double() - exact).abs() <= ulp * 0.5 + slack).all()


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight(torch.randn(8, 40), "int4", torch.float32)


def _prompt_logits(model_dir: str, quantization: str, n: int) -> torch.Tensor:
    r = ModelRunner(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=8, quantization=quantization))
    ids = torch.arange(400, 400 + n)
    meta = AttentionMetadata.build([len(ids)], [0], [list(range(8))], 16)
    with torch.inference_mode():
        return r.model.compute_logits(r.model(ids, meta.positions, r.kv_caches, meta)).float()


# 24 tokens: a batch the AMX int8 kernel takes (up to 64 rows); 96: oneDNN on the dequantized copy
@pytest.mark.parametrize(
    "method,n,min_agree,max_kl", [("int8", 24, 0.75, 0.05), ("int8", 96, 0.75, 0.05), ("int4", 64, 0.6, 0.25)]
)
def test_quantized_smollm2_stays_close(smollm2_dir, method, n, min_agree, max_kl):
    base = _prompt_logits(smollm2_dir, "", n)
    got = _prompt_logits(smollm2_dir, method, n)
    agree = (got.argmax(-1) == base.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(
        got.log_softmax(-1), base.log_softmax(-1), log_target=True, reduction="batchmean"
    ).item()
    assert agree >= min_agree and kl <= max_kl, (agree, kl)


@pytest.mark.parametrize("rows", [1, 3, 4, 17, 32, 33, 64, 70, 100, 128, 129])
@pytest.mark.parametrize("n", [208, 200])  # 200 rows: no skinny-matmul layout (not a multiple of 16)
def test_bf16_packed_weights_give_the_same_products(rows, n):
    """oneDNN's layout: bit for bit F.linear. The skinny layout (up to skinny_rows rows, when the
    CPU has AVX512-BF16; 128 with AMX): the float32 product rounded once to bf16 (at most half a
    bf16 ulp from the exact product), through AMX tiles and through the dot-product loop."""
    from axonserve.neuron.layers.quant import PackedWeight, can_pack
    from axonserve.neuron.ops import native

    if not can_pack(torch.bfloat16):
        pytest.skip("no oneDNN bf16 path on this CPU (AVX512-BW/VL/DQ or AVX-NE-CONVERT)")
    torch.manual_seed(1)
    w, x = torch.randn(n, 96).bfloat16(), torch.randn(rows, 96).bfloat16()
    pw = PackedWeight(w)
    k = native.kernels()
    skinny = k is not None and k.has_bf16_gemv() and n % 16 == 0
    assert (pw.skinny is not None) == skinny

    def rounded_once(got, x):
        exact = x.double() @ w.double().T
        ulp = exact.abs().clamp_min(1e-30).log2().floor().exp2() * 2**-7
        return ((got.double() - exact).abs() <= ulp * 0.5 + exact.abs() * 1e-5).all()

    got = pw.matmul(x)
    if skinny and rows <= pw.skinny_rows:
        assert rounded_once(got, x)
    if skinny and rows <= 128:  # the dot-product loop (what a CPU without AMX runs), here too
        assert rounded_once(k.dot_bf16(x, pw.skinny), x)
    if not skinny or rows > pw.skinny_rows:
        assert torch.equal(got, torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("mode", ["force", "auto"])
def test_onednn_products_split_by_rows_round_once(mode, monkeypatch):
    """Above 128 rows a thread, bf16 products may run with the rows split between the threads,
    each slice one single-threaded oneDNN call (cpu_kernels.cpp `onednn_linear`): always with
    AXONSERVE_ONEDNN_SPLIT=force; by default the first product of each (K, N, 64-row bucket) runs
    both ways and the bucket keeps the faster. Every product is a float32 product rounded once to
    bf16, the split's slices in their places (reversing them fails this test)."""
    from axonserve.neuron.layers.quant import PackedWeight, can_pack
    from axonserve.neuron.ops import native

    if not can_pack(torch.bfloat16) or native.kernels() is None:
        pytest.skip("no oneDNN bf16 path or no native kernels on this CPU")
    monkeypatch.setenv("AXONSERVE_ONEDNN_SPLIT", mode)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(2)
        w = torch.randn(80, 96).bfloat16()
        pw = PackedWeight(w)
        for call in range(6):
            rows = 257 + 64 * (call // 2) + call % 2  # a new bucket every other call; odd row counts
            with torch.inference_mode():  # as the runner's steps run: the slices are views of inference tensors
                x = torch.randn(rows, 96).bfloat16()
                got = pw.matmul(x)
            exact = x.double() @ w.double().T
            acc = 96 * 2**-24 * (x.double().abs() @ w.double().abs().T)  # float32 accumulation's bound
            ulp = (exact.abs() + acc).clamp_min(1e-30).log2().floor().exp2() * 2**-7
            assert ((got.double() - exact).abs() <= ulp * 0.5 + acc).all(), call
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k", [64, 72])  # 72: not whole AMX tiles (32 K values), the loop alone
def test_skinny_matmul_takes_every_row_count(k):
    """Each row count has its own tile configuration (AMX: 1..16 one row tile, 17..32 two, more in
    passes of 32 over each pair of column blocks, the last pass partial) or register blocking (the
    dot-product loop without AMX: groups of 8 rows over 3 column blocks, the last ones partial):
    all of them, against the float64 product; and a row's bits do not depend on the batch it is
    in (the passes and groups cut rows, never a row's sum)."""
    from axonserve.neuron.layers.quant import PackedWeight, can_pack

    pw = PackedWeight(torch.randn(80, k).bfloat16()) if can_pack(torch.bfloat16) else None
    if pw is None or pw.skinny is None:
        pytest.skip("no skinny-matmul kernel on this CPU")
    w = pw.skinny.permute(0, 2, 1, 3).reshape(80, k).double()  # [N/16, K/2, 16, 2] back to [N, K]
    assert pw.matmul(torch.randn(0, k).bfloat16()).shape == (0, 80)  # an empty batch, not a crash
    for m in range(1, 129):
        xm = torch.randn(m, k).bfloat16()
        if m <= pw.skinny_rows:
            got = pw.matmul(xm)
            torch.testing.assert_close(got.double(), xm.double() @ w.T, atol=0.05, rtol=1e-2)
            assert torch.equal(got, torch.cat([pw.matmul(xm[i : i + 5]) for i in range(0, m, 5)])), m
        dot = pw.kernels.dot_bf16(xm, pw.skinny)  # (on AMX machines too)
        torch.testing.assert_close(dot.double(), xm.double() @ w.T, atol=0.05, rtol=1e-2)
        assert torch.equal(dot, torch.cat([pw.kernels.dot_bf16(xm[i : i + 5], pw.skinny) for i in range(0, m, 5)]))


@pytest.mark.skipif(not onednn_bf16(), reason="this CPU has no oneDNN bf16 path (AVX512-BW/VL/DQ or AVX-NE-CONVERT)")
def test_bf16_runner_packs_its_linears(smollm2_dir):
    r = ModelRunner(EngineConfig(model=smollm2_dir, dtype="bfloat16", num_kv_blocks=4))
    layer = r.model.model.layers[0]
    assert layer.mlp.down_proj.qweight.method == "packed" and layer.mlp.down_proj.weight is None
    assert r.model.lm_head.qweight is not None and r.model.model.embed_tokens.weight is not None  # tied table kept


def _decode_logits(model_dir: str, kv_cache_dtype: str, native: bool, n: int = 48) -> torch.Tensor:
    """An 8-token prompt, then n - 8 teacher-forced decode steps: every step reads the cache."""
    r = ModelRunner(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=8, kv_cache_dtype=kv_cache_dtype))
    kernels = r.native if native else None
    ids, table, out = torch.arange(400, 400 + n), [list(range(4))], []
    with torch.inference_mode():
        meta = AttentionMetadata.build([8], [0], table, 16, native=kernels)
        r.model(ids[:8], meta.positions, r.kv_caches, meta)
        for i in range(8, n):
            meta = AttentionMetadata.build([1], [i], table, 16, native=kernels)
            out.append(r.model.compute_logits(r.model(ids[i : i + 1], meta.positions, r.kv_caches, meta)).float())
    return torch.cat(out)


@pytest.mark.parametrize("native", [True, False])
def test_int8_kv_cache_stays_close(smollm2_dir, native):
    """--kv-cache-dtype int8 against the bf16 cache on SmolLM2's decode steps, through the native
    kernels and through the torch path (dequantized blocks)."""
    from axonserve.neuron.ops import native as kernels

    if native and kernels.for_dtype(torch.bfloat16) is None:
        pytest.skip("native kernels unavailable")
    base = _decode_logits(smollm2_dir, "auto", native)
    got = _decode_logits(smollm2_dir, "int8", native)
    agree = (got.argmax(-1) == base.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(
        got.log_softmax(-1), base.log_softmax(-1), log_target=True, reduction="batchmean"
    ).item()
    assert agree >= 0.85 and kl <= 0.01, (agree, kl)  # measured: 0.90, 0.003 (nonsense prompt: near-ties)


def test_warm_up_settles_every_row_bucket(monkeypatch):
    """`settle_onednn_split` (the runner's warm-up) makes `onednn_linear`'s choice for every row
    bucket of the model's oneDNN weights up to max_rows, so no served product pays the measurement
    (cpu_kernels.cpp `onednn_settle`); buckets past max_rows are left to measure when they come,
    and with AXONSERVE_ONEDNN_SPLIT set (never / always split) nothing is measured at all."""
    from axonserve.neuron.layers.quant import PackedWeight, can_pack, settle_onednn_split
    from axonserve.neuron.ops import native

    k = native.kernels()
    if not can_pack(torch.bfloat16) or k is None:
        pytest.skip("no oneDNN bf16 path or no native kernels on this CPU")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = torch.nn.Sequential(torch.nn.Module(), torch.nn.Module())
        model[0].qweight = PackedWeight(torch.randn(112, 160).bfloat16())  # shapes no other test uses
        model[1].qweight = PackedWeight(torch.randn(48, 160).bfloat16())
        buckets = range(4, 16)  # 256 rows (128 a thread) and up, 64 a bucket

        def choices(n: int) -> list[int]:
            return [k.onednn_split_choice(160, n, 64 * b + 5) for b in buckets]

        monkeypatch.setenv("AXONSERVE_ONEDNN_SPLIT", "0")
        assert settle_onednn_split(model, 700) == 0 and set(choices(112)) == {-1}
        monkeypatch.delenv("AXONSERVE_ONEDNN_SPLIT")
        assert settle_onednn_split(model, 700) == 2 * 2 * 7  # buckets 4..10, both weights, twice each
        for n in (112, 48):
            got = choices(n)
            assert all(c in (0, 1) for c in got[:7]), got  # oneDNN's threading or the split, decided
            assert set(got[7:]) == {-1}, got  # past 700 rows: measured when served
    finally:
        torch.set_num_threads(threads)


def test_runner_warm_up_settles_its_weights(tiny_llama_dir, monkeypatch):
    """A bf16 runner's start-up warm-up leaves each of its oneDNN weights' row buckets decided."""
    from axonserve.neuron.layers.quant import PackedWeight, can_pack
    from axonserve.neuron.ops import native

    from .conftest import make_runner

    k = native.kernels()
    if not can_pack(torch.bfloat16) or k is None:
        pytest.skip("no oneDNN bf16 path or no native kernels on this CPU")
    monkeypatch.delenv("AXONSERVE_ONEDNN_SPLIT", raising=False)
    threads = torch.get_num_threads()
    try:
        runner = make_runner(tiny_llama_dir, dtype="bfloat16", max_num_batched_tokens=320, num_kv_blocks=96)
        torch.set_num_threads(2)
        packed = [m.qweight for m in runner.model.modules() if isinstance(getattr(m, "qweight", None), PackedWeight)]
        runner.warm_up()  # (its prefill's products are 320 rows: bucket 5; only the settling reaches 4)
        assert packed and all(k.onednn_split_choice(p.shape[1], p.shape[0], 300) in (0, 1) for p in packed)
    finally:
        torch.set_num_threads(threads)
