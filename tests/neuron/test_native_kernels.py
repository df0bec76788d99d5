"""The fused C++ kernels (ops/native.py) against the torch ops they replace, bf16 and float32.

bf16 results must round like the torch ops (transformers' rounding): rotary, RMSNorm, SiLU-and-mul
and argmax are compared exactly, attention (float32 accumulation in a different order) within
one bf16 ulp. The kernels are built by scripts/setup; a machine without a compiler skips here and
serves through the torch path (tests/neuron/test_llama_parity.py covers both)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from axonserve.neuron.layers.rotary import RotaryEmbedding, apply_rotary
from axonserve.neuron.ops import attention, native
from axonserve.neuron.ops.attention import NATIVE_MAX_QUERY, AttentionMetadata, paged_attention

from .test_attention import random_block_tables

K = native.kernels()
pytestmark = pytest.mark.skipif(K is None, reason="native kernels unavailable (no compiler): torch path only")
DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# row counts: one task on the calling thread (small calls stay serial), and several OpenMP tasks
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [7, 300])
@pytest.mark.parametrize("hidden", [576, 100])  # 16-lane vectors; the scalar loop
def test_rms_norm_with_and_without_residual(dtype, rows, hidden):
    g = _gen()
    x, r = torch.randn(rows, hidden, generator=g).to(dtype), torch.randn(rows, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)

    def ref(h):
        if dtype == torch.float32:
            return F.rms_norm(h, (hidden,), w, 1e-5)
        return w * F.rms_norm(h.float(), (hidden,), None, 1e-5).to(dtype)

    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)
    out = torch.empty_like(x)
    K.rms_norm(out, x, None, w, 1e-5)
    torch.testing.assert_close(out, ref(x), **tol)
    res = r.clone()
    K.rms_norm(out, x, res, w, 1e-5)
    assert torch.equal(res, x + r)  # the residual stream, rounded like torch's add
    torch.testing.assert_close(out, ref(x + r), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 100])  # 16-lane vectors only; vectors and a scalar tail
@pytest.mark.parametrize("rows", [5, 700])
def test_silu_and_mul(dtype, inter, rows):
    gu = torch.randn(rows, 2 * inter, generator=_gen(1)).to(dtype) * 4
    gu[1, 3] = gu[2, inter - 1] = float("nan")  # a NaN gate stays NaN (vector lanes and the tail)
    gate, up = gu.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = K.silu_and_mul(gu)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, ref, atol=0, rtol=0, equal_nan=True)
    else:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.skipif(K is None or not K.has_bf16_gemv(), reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("inter,hidden", [(1536, 576), (48, 64)])  # SmolLM2's MLP; an odd count of gate blocks
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 17, 32, 33, 100, 128])  # AMX passes; the dot loop's row groups
def test_gate_up_silu_is_the_two_ops_in_one_pass(inter, hidden, rows):
    """gate_up_silu: skinny_bf16 on [gate; up] then silu_and_mul, bit for bit (NaN rows included),
    on AMX tiles where the CPU has them; the dot-product loop's fused epilogue (a CPU without AMX)
    against its own two ops on any CPU with AVX512-BF16."""
    w = (torch.randn(2 * inter, hidden, generator=_gen(2)) * 0.05).bfloat16()
    wp = K.pack_gemv_weight(w)
    x = torch.randn(rows, hidden, generator=_gen(3)).bfloat16()
    x[rows // 2, 3] = float("nan")
    want = K.silu_and_mul(K.skinny_bf16(x, wp))
    got = K.gate_up_silu(x, wp)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
    # rows of a wider tensor (x a view with a row stride): the same
    wide = torch.cat([x, torch.zeros(rows, 32, dtype=x.dtype)], 1)[:, :hidden]
    torch.testing.assert_close(K.gate_up_silu(wide, wp), want, atol=0, rtol=0, equal_nan=True)
    dot = K.silu_and_mul(K.dot_bf16(x, wp))
    torch.testing.assert_close(K.dot_bf16(x, wp, silu=True), dot, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(K.dot_bf16(wide, wp, silu=True), dot, atol=0, rtol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="rows"):
        K.gate_up_silu(torch.zeros(129, hidden, dtype=torch.bfloat16), wp)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        K.gate_up_silu(x, K.pack_gemv_weight(w[:-16]))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        K.dot_bf16(x, K.pack_gemv_weight(w[:-16]), silu=True)


@pytest.mark.skipif(not (K is not None and K.amx_attention(64)), reason="no AMX tiles on this CPU")
@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("bs", [16, 4])
@pytest.mark.parametrize("peaky", [False, True])
def test_decodes_sharing_a_prefix(head_dim, bs, peaky):
    """Decode rows whose tables share their first blocks (prefix caching) take the shared keys once
    on AMX tiles and their own after them on the per-row kernel (csrc/amx_attention.h, shared
    prefixes). Groups: 5 rows on a 300-key prefix (past the 256-key chunk, tiles of 16 vectors and
    a partial one), 3 rows on 128 keys (the least taken) whose tables part after it, 4 rows on a
    64-key prefix (too short: stays per row), a row whose own keys all sit in one block, and lone rows. Each
    row must equal that row attended alone (the per-row kernel) within one bf16 ulp, and be as
    close to float32 attention as the per-row kernel is. peaky: large scores, so a row's maximum
    is in its prefix for some rows and in its own keys for others."""
    g = _gen(11)
    blocks, hkv, hq = 2048, 2, 6
    k_cache = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(torch.bfloat16)
    perm = iter(torch.randperm(blocks, generator=g).tolist())
    take = lambda n: [next(perm) for _ in range(n)]  # noqa: E731
    tables, kv_lens = [], []

    def group(prefix: int, own: list[int]) -> None:
        shared = take(prefix // bs)
        for n in own:  # keys after the prefix, this token's included
            tables.append(shared + take(-(-n // bs)))
            kv_lens.append(prefix + n)

    group(300 - 300 % bs, [1, 40, 17, 90, 3])
    group(128, [50, 9, 33])
    group(64, [20, 7, 5, 9])
    for n in (5, 130, 1):
        tables.append(take(-(-n // bs)))
        kv_lens.append(n)
    order = torch.randperm(len(tables), generator=g).tolist()  # groups interleaved in the batch
    tables, kv_lens = [tables[i] for i in order], [kv_lens[i] for i in order]
    rows = len(tables)
    q, k, v = (torch.randn(rows, h, head_dim, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv))
    if peaky:
        q = (q.float() * 8).to(torch.bfloat16)
    scale = head_dim**-0.5
    ctx = [n - 1 for n in kv_lens]
    meta = AttentionMetadata.build([1] * rows, ctx, tables, bs, native=K)
    got = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale)
    alone = torch.cat(
        [
            paged_attention(
                q[i : i + 1],
                k[i : i + 1],
                v[i : i + 1],
                k_cache.clone(),
                v_cache.clone(),
                AttentionMetadata.build([1], [ctx[i]], [tables[i]], bs, native=K),
                scale,
            )
            for i in range(rows)
        ]
    )
    torch_meta = AttentionMetadata.build([1] * rows, ctx, tables, bs)
    ref = paged_attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), torch_meta, scale)
    ulp = alone.float().abs() * 2**-7 + 1e-5  # one bf16 ulp (8 significant bits; near 0: cancellation's)
    bad = (got.float() - alone.float()).abs() > ulp
    assert not bad.any(), (bad.nonzero()[:5].tolist(), got.float()[bad][:5], alone.float()[bad][:5])
    err, alone_err = (got.float() - ref).abs().max().item(), (alone.float() - ref).abs().max().item()
    assert err <= alone_err * 1.01 + 1e-6, (err, alone_err)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24])  # vector path, scalar path
@pytest.mark.parametrize("t", [5, 200])
def test_rotary_and_cache_write(dtype, head_dim, t):
    g = _gen(2)
    hq, hkv = 6, 2
    rot = RotaryEmbedding(head_dim, 512, 10000.0, None, dtype)
    qkv = torch.randn(t, hq + 2 * hkv, head_dim, generator=g).to(dtype)
    pos = torch.tensor([0, 5, 17, 300, 511] + list(range(20, 20 + t - 5)))
    slots = torch.randperm(4 * 64, generator=g)[:t]
    cos, sin = rot(pos)
    ref = apply_rotary(qkv[:, : hq + hkv], cos, sin)
    kc = torch.zeros(4 * 4, 16, hkv, head_dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    got = qkv.clone()
    K.rotary_kv_write(got, hq, hkv, rot.cos, rot.sin, pos, kc, vc, slots)
    assert torch.equal(got[:, : hq + hkv], ref)
    assert torch.equal(got[:, hq + hkv :], qkv[:, hq + hkv :])
    assert torch.equal(kc.view(-1, hkv, head_dim)[slots], ref[:, hq:])
    assert torch.equal(vc.view(-1, hkv, head_dim)[slots], qkv[:, hq + hkv :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 24])  # 3 query heads per KV head: one group of 4, groups of 2 + 1
@pytest.mark.parametrize("long", [[], [(150, 0), (130, 20)]])
@pytest.mark.parametrize("far", [[], [(1, 300), (1, 400)]])  # enough keys for the kernel to use threads
@pytest.mark.parametrize("group", [3, 4, 5])  # query heads per KV head: value passes of 3, 3 + 1, 3 + 2 (AVX2)
def test_paged_attention_mixed_batch(dtype, head_dim, long, far, group, monkeypatch):
    """Decodes, short chunks of different lengths (verification), first chunks and a long prefill
    with a context in one flat batch, through AttentionMetadata.build(native=...) against the torch
    path; chunks of NATIVE_MAX_QUERY+ tokens (first and with a context) mixed in take SDPA."""
    g = _gen(3)
    bs, blocks, hkv, hq = 4, 512, 2, 2 * group
    k_cache = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(dtype)
    seqs = [(1, 0), (1, 12), (1, 33), (3, 9), (5, 17), (4, 0), (30, 6), (40, 0), (2, 3)]  # (query_len, context_len)
    seqs = far + seqs[:5] + long[:1] + seqs[5:8] + long[1:] + seqs[8:]  # long chunks amid the short ones
    tables = random_block_tables(seqs, bs, blocks, g)
    args = ([q for q, _ in seqs], [c for _, c in seqs], tables, bs)
    t = sum(q for q, _ in seqs)
    q, k, v = (torch.randn(t, h, head_dim, generator=g).to(dtype) for h in (hq, hkv, hkv))
    scale = head_dim**-0.5
    meta = AttentionMetadata.build(*args, native=K)
    assert all(n >= NATIVE_MAX_QUERY for n, _ in long)
    assert meta.native_rows == t - sum(n for n, _ in long) and len(meta.prefills) == len(long)
    kc, vc = k_cache.clone(), v_cache.clone()
    got = paged_attention(q, k, v, kc, vc, meta, scale)
    ref = paged_attention(q, k, v, k_cache, v_cache, AttentionMetadata.build(*args), scale)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(got, ref, **tol)
    if long:  # the torch path runs the long chunks through the same SDPA code: check them on the kernel too
        monkeypatch.setattr(attention, "NATIVE_MAX_QUERY", 10**9)
        all_native = AttentionMetadata.build(*args, native=K)
        assert all_native.native_rows == t and all_native.native_idx is None
        torch.testing.assert_close(got, paged_attention(q, k, v, k_cache, v_cache, all_native, scale), **tol)


@pytest.mark.skipif(not (K is not None and K.chunk_attention(64)), reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("bs", [16, 4])
@pytest.mark.parametrize("peaky", [False, True])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("tiles", [True, False])
def test_prefill_chunks_against_float32(head_dim, bs, peaky, tree, tiles, monkeypatch):
    """bf16 prefill chunks' flash attention (csrc/amx_attention.h), on AMX tiles or (tiles=False, on
    AMX machines too) on AVX512-BF16's dot product: chunks of 16+ rows, first or after a context,
    with lengths off the 16-row tile and past the 256-key softmax chunk, amid decodes and a short
    chunk (per-row kernel), all in one call; against float32 attention over the same bf16 inputs,
    as close as torch's bf16 SDPA gets. peaky: large scores, so rows' maxima grow from one key
    chunk to the next (the running rescale). tree: a draft tree's verification rides along (its
    rows have extra keys and stay on the per-row kernel; the chunks still take the flash path)."""
    if tiles and not K.amx_attention(head_dim):
        pytest.skip("no AMX tiles on this CPU")
    monkeypatch.setenv("AXONSERVE_AMX_ATTENTION", "1" if tiles else "0")
    assert K.chunk_attention(head_dim) and not K.chunk_attention(128)
    g = _gen(7)
    blocks, hkv, hq = 1024, 2, 6
    k_cache = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(torch.bfloat16)
    seqs = [(1, 40), (1, 700), (4, 30), (16, 0), (5, 9), (17, 3), (100, 0), (300, 500), (33, 257)]
    tables = random_block_tables(seqs, bs, blocks, g)
    trees = {2: [-1, 0, 0]} if tree else None  # row 0: the last token; drafts 1 and 2 both follow draft 0
    args = ([q for q, _ in seqs], [c for _, c in seqs], tables, bs)
    t = sum(q for q, _ in seqs)
    q, k, v = (torch.randn(t, h, head_dim, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv))
    if peaky:
        q = (q.float() * 8).to(torch.bfloat16)
    scale = head_dim**-0.5
    meta = AttentionMetadata.build(*args, native=K, trees=trees, native_chunks=True)
    assert meta.native_rows == t and not meta.prefills  # every chunk on the kernel
    assert (meta.native_row_extra is not None) == tree
    got = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale)
    torch_meta = AttentionMetadata.build(*args, trees=trees)
    ref = paged_attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), torch_meta, scale)
    sdpa = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), torch_meta, scale)
    err, sdpa_err = (got.float() - ref).abs().max().item(), (sdpa.float() - ref).abs().max().item()
    assert err <= 1.5 * sdpa_err + 1e-3, (err, sdpa_err)
    torch.testing.assert_close(got.float(), ref, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24])  # vector path, scalar path
def test_rotary_write_into_an_int8_cache_quantizes_like_torch(dtype, head_dim):
    """`--kv-cache-dtype int8`: the kernel's codes and scales are attention.quantize_kv's, bit for
    bit (an all-zero row gets code 0 and the floor scale)."""
    g = _gen(5)
    hq, hkv, t = 6, 2, 40
    rot = RotaryEmbedding(head_dim, 512, 10000.0, None, dtype)
    qkv = torch.randn(t, hq + 2 * hkv, head_dim, generator=g).to(dtype) * 3
    qkv[7, hq + hkv] = 0  # a zero V row
    pos, slots = torch.arange(t) * 3, torch.randperm(16 * 16, generator=g)[:t]
    kc, vc = torch.zeros(16, 16, hkv, head_dim, dtype=torch.int8), torch.zeros(16, 16, hkv, head_dim, dtype=torch.int8)
    ks, vs = torch.zeros(16, 16, hkv), torch.zeros(16, 16, hkv)
    got = qkv.clone()
    K.rotary_kv_write(got, hq, hkv, rot.cos, rot.sin, pos, kc, vc, slots, ks, vs)
    for codes, scales, x in ((kc, ks, got[:, hq : hq + hkv]), (vc, vs, got[:, hq + hkv :])):
        want_codes, want_scales = attention.quantize_kv(x)
        assert torch.equal(codes.view(-1, hkv, head_dim)[slots], want_codes)
        assert torch.equal(scales.view(-1, hkv)[slots], want_scales)
    assert vc.view(-1, hkv, head_dim)[slots[7], 0].eq(0).all() and vs.view(-1, hkv)[slots[7], 0] == 1e-30
    err = (attention.quantize_kv(qkv)[0].float() * attention.quantize_kv(qkv)[1][..., None] - qkv.float()).abs()
    assert (err <= qkv.float().abs().amax(-1, keepdim=True) / 254 * 1.001).all()  # half a code step


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24])
def test_paged_attention_over_an_int8_cache(dtype, head_dim):
    """Decodes, short chunks and a prefill with a context over int8 K/V: the native kernel (codes x
    scales inside) against the torch path (dequantized blocks into SDPA), and both near attention
    over the unquantized cache."""
    g = _gen(6)
    bs, blocks, hkv, hq = 4, 256, 2, 6
    seqs = [(1, 0), (1, 12), (1, 33), (1, 300), (3, 9), (5, 17), (30, 6), (2, 3)]
    tables = random_block_tables(seqs, bs, blocks, g)
    args = ([q for q, _ in seqs], [c for _, c in seqs], tables, bs)
    t = sum(q for q, _ in seqs)
    q, k, v = (torch.randn(t, h, head_dim, generator=g).to(dtype) for h in (hq, hkv, hkv))
    k_full = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(dtype)
    v_full = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(dtype)
    (kc, ks), (vc, vs) = attention.quantize_kv(k_full), attention.quantize_kv(v_full)
    scale = head_dim**-0.5
    caches = [(kc.clone(), vc.clone(), ks.clone(), vs.clone()) for _ in range(2)]
    got = paged_attention(
        q, k, v, *caches[0][:2], AttentionMetadata.build(*args, native=K), scale, True, *caches[0][2:]
    )
    ref = paged_attention(q, k, v, *caches[1][:2], AttentionMetadata.build(*args), scale, True, *caches[1][2:])
    assert all(torch.equal(a, b) for a, b in zip(*caches))  # the same codes written by both paths
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(got, ref, **tol)
    full = paged_attention(q, k, v, k_full, v_full, AttentionMetadata.build(*args), scale)
    assert (got.float() - full.float()).abs().max() < 0.05  # int8 codes: within a few percent of the inputs


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_first_index_of_ties(dtype):
    g = _gen(4)
    x = torch.randint(0, 5, (16, 49157), generator=g).to(dtype)  # many ties
    assert torch.equal(K.argmax_rows(x), x.argmax(dim=-1))
    y = torch.randn(3, 1000, generator=g).to(dtype)
    assert torch.equal(K.argmax_rows(y), y.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 4, 16])
def test_topk_logprobs_like_torch(dtype, k):
    """EAGLE-2 trees' child selection: the k best of each row (8,192-token draft vocabularies, and
    a row shorter than a vector), ties to the first index, with their log-softmax values."""
    g = _gen(5)
    for x in (
        torch.randn(9, 8192, generator=g).to(dtype),
        torch.randn(2, max(k, 13), generator=g).to(dtype),
        torch.randint(0, 3, (4, 1000), generator=g).to(dtype),
    ):
        vals, idx = K.topk_logprobs(x, k)
        lp = torch.log_softmax(x.float(), dim=-1)
        order = torch.sort(-x.float(), dim=-1, stable=True).indices[:, :k]  # descending, first index of a tie
        assert torch.equal(idx, order)
        torch.testing.assert_close(vals, lp.gather(1, order), atol=2e-5, rtol=1e-5)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("AXONSERVE_NATIVE", "0")
    assert native.kernels() is None and native.for_dtype(torch.bfloat16) is None
    monkeypatch.setattr(native, "_state", {"mod": K})
    assert native.for_dtype(torch.float16) is None  # no fp16 kernels: torch path
