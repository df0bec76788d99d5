"""FP8 (layers/fp8.py): codes and scales for both formats, the native kernels that read them (paged
attention over an FP8 KV cache, the FP8 weight matmul) against torch's float8 dtypes and the
dequantized references, and the dequantization of FP8 checkpoints (per tensor, channel, block).
The native tests need only a C++ compiler: the kernels have AVX-512, AVX2 and scalar paths."""

from __future__ import annotations

import pytest
import torch

from axonserve.neuron.layers import fp8
from axonserve.neuron.layers.quant import QuantizedWeight
from axonserve.neuron.layers.rotary import RotaryEmbedding
from axonserve.neuron.ops import attention, native
from axonserve.neuron.ops.attention import AttentionMetadata, paged_attention

from .test_attention import random_block_tables

K = native.kernels()
needs_native = pytest.mark.skipif(K is None, reason="native kernels unavailable (no compiler): torch path only")
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
MIN_SUBNORMAL = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}
DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bound(x: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half a code step: 2^-(m+1) relative for normal codes, half the smallest subnormal x s below."""
    return x.abs() * 2.0 ** -(MANTISSA[dtype] + 1) + s[..., None] * MIN_SUBNORMAL[dtype] / 2 + 1e-30


@pytest.mark.parametrize("dtype", FORMATS)
def test_round_trip_within_half_a_code_step(dtype):
    x = torch.randn(64, 5, 128, generator=_gen(0)) * torch.logspace(-6, 3, 128)  # wide dynamic range per row
    x[3, 1] = 0  # an all-zero row: code 0, the floor scale
    codes, s = fp8.quantize_rows(x, dtype)
    assert codes.dtype == dtype and s.dtype == torch.float32 and s.shape == x.shape[:-1]
    assert torch.isfinite(codes.float()).all() and codes.float().abs().amax(-1).max() <= fp8.FP8_MAX[dtype]
    back = codes.float() * s[..., None]
    assert ((back - x).abs() <= _bound(x, s, dtype)).all()
    assert s[3, 1] == 1e-30 and codes[3, 1].float().eq(0).all()
    # the row's largest element is represented exactly (it maps to the format's largest value)
    i = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, i), x.gather(-1, i), rtol=1e-6, atol=0)


@needs_native
@pytest.mark.parametrize("dtype", FORMATS)
def test_every_finite_code_widens_exactly(dtype):
    """Every finite code (subnormals, zero and -0 included) through the attention kernel's reads: one
    key and scale 1, so the output is the V row itself, in float32."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = codes[torch.isfinite(codes.float())]
    d = 256
    rows = -(-finite.numel() // d)
    v = torch.zeros(rows * d, dtype=torch.uint8).view(dtype)
    v[: finite.numel()] = finite
    v_cache = v.view(1, 1, rows, d).repeat(1, 1, 1, 1).contiguous().view(1, 1, rows, d)
    k_cache = torch.zeros(1, 1, rows, d, dtype=torch.uint8).view(dtype)
    ones = torch.ones(1, 1, rows)
    out = torch.empty(1, rows, d)
    K.paged_attention(
        out,
        torch.zeros(1, rows, d),
        k_cache,
        v_cache,
        torch.zeros(1, 1, dtype=torch.long),
        torch.zeros(1, dtype=torch.long),
        torch.ones(1, dtype=torch.long),
        1.0,
        ones,
        ones.clone(),
    )
    assert torch.equal(out.view(-1)[: finite.numel()], finite.float())


@needs_native
@pytest.mark.parametrize("codes", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24])  # AVX-512 vector path where built, scalar path
def test_rotary_write_into_an_fp8_cache_quantizes_like_torch(codes, dtype, head_dim):
    """The kernel's codes and scales are attention.quantize_kv's (torch's float8 rounding), bit for bit."""
    g = _gen(5)
    hq, hkv, t = 6, 2, 40
    rot = RotaryEmbedding(head_dim, 512, 10000.0, None, dtype)
    qkv = torch.randn(t, hq + 2 * hkv, head_dim, generator=g).to(dtype) * 3
    qkv[7, hq + hkv] = 0  # a zero V row
    pos, slots = torch.arange(t) * 3, torch.randperm(16 * 16, generator=g)[:t]
    kc, vc = (torch.zeros(16, 16, hkv, head_dim, dtype=torch.uint8).view(codes) for _ in range(2))
    ks, vs = torch.zeros(16, 16, hkv), torch.zeros(16, 16, hkv)
    got = qkv.clone()
    K.rotary_kv_write(got, hq, hkv, rot.cos, rot.sin, pos, kc, vc, slots, ks, vs)
    for cache, scales, x in ((kc, ks, got[:, hq : hq + hkv]), (vc, vs, got[:, hq + hkv :])):
        want_codes, want_scales = attention.quantize_kv(x, codes)
        assert torch.equal(cache.view(torch.uint8).view(-1, hkv, head_dim)[slots], want_codes.view(torch.uint8))
        assert torch.equal(scales.view(-1, hkv)[slots], want_scales)
    assert vs.view(-1, hkv)[slots[7], 0] == 1e-30


@pytest.mark.parametrize("codes", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24])
def test_paged_attention_over_an_fp8_cache(codes, dtype, head_dim):
    """Decodes, short chunks and a prefill with a context over FP8 K/V: the native kernel (codes
    widened in registers, scales folded into scores and probabilities) against the torch path
    (dequantized blocks into SDPA), both writing the same codes, and both near attention over the
    unquantized cache: within half a code step of the largest inputs (|x| < 5: e4m3 5 x 2^-4, e5m2
    5 x 2^-3), and far closer on average."""
    g = _gen(6)
    bs, blocks, hkv, hq = 4, 256, 2, 6
    seqs = [(1, 0), (1, 12), (1, 33), (1, 300), (3, 9), (5, 17), (30, 6), (2, 3)]
    tables = random_block_tables(seqs, bs, blocks, g)
    args = ([q for q, _ in seqs], [c for _, c in seqs], tables, bs)
    t = sum(q for q, _ in seqs)
    q, k, v = (torch.randn(t, h, head_dim, generator=g).to(dtype) for h in (hq, hkv, hkv))
    k_full = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(dtype)
    v_full = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(dtype)
    (kc, ks), (vc, vs) = attention.quantize_kv(k_full, codes), attention.quantize_kv(v_full, codes)
    scale = head_dim**-0.5
    caches = [(kc.clone(), vc.clone(), ks.clone(), vs.clone()) for _ in range(2)]
    ref = paged_attention(q, k, v, *caches[1][:2], AttentionMetadata.build(*args), scale, True, *caches[1][2:])
    full = paged_attention(q, k, v, k_full, v_full, AttentionMetadata.build(*args), scale)
    err = (ref.float() - full.float()).abs()
    assert err.max() < 5 * 2.0 ** -(MANTISSA[codes] + 1) and err.mean() < 2.0 ** -(MANTISSA[codes] + 3)
    if K is None:
        return
    got = paged_attention(
        q, k, v, *caches[0][:2], AttentionMetadata.build(*args, native=K), scale, True, *caches[0][2:]
    )
    assert all(torch.equal(fp8.as_bytes(a), fp8.as_bytes(b)) for a, b in zip(*caches))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(got, ref, **tol)


def test_move_slots_copies_fp8_rows():
    """A verified draft path moves FP8 codes and their scales (torch has no FP8 index_copy_)."""
    kc = torch.randn(4, 4, 2, 8).to(torch.float8_e4m3fn)
    sc = torch.rand(4, 4, 2)
    layer = (kc.clone(), kc.clone(), sc.clone(), sc.clone())
    attention.move_slots([layer], [5, 9], [1, 2])
    flat = layer[0].view(torch.uint8).view(16, -1)
    assert torch.equal(flat[1], kc.view(torch.uint8).view(16, -1)[5])
    assert torch.equal(layer[2].view(16, -1)[2], sc.view(16, -1)[9])


# ------------------------------------------------------------------ weights


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 16, 17, 64, 300])  # skinny (4-row blocks, tails), dequantized
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [200, 576])  # a scalar tail; whole vectors
def test_fp8_weight_matmul_is_the_dequantized_product(rows, dtype, k):
    g = _gen(1)
    w, x = torch.randn(96, k, generator=g), torch.randn(rows, k, generator=g).to(dtype)
    q = QuantizedWeight(w, "fp8", dtype)
    assert q.data.dtype == torch.float8_e4m3fn and q.scales.dtype == torch.float32 and q.nbytes == 96 * k + 96 * 4
    codes, s = q.data.float(), q.scales
    assert torch.equal(s, (w.abs().amax(1) / 448).clamp_min(1e-12))
    assert ((codes * s[:, None] - w).abs() <= _bound(w, s, torch.float8_e4m3fn)).all()
    got = q.matmul(x)
    assert got.shape == (rows, 96) and got.dtype == dtype
    big = K is None or rows > K.FP8_SKINNY_ROWS
    if big:  # the dequantized weight (rounded once to the activations' dtype) through torch's matmul
        assert torch.equal(got, torch.nn.functional.linear(x, (codes * s[:, None]).to(dtype)))
        return
    exact = x.double() @ (codes.double() * s.double()[:, None]).T  # float32 sums of the codes, scaled once
    slack = (x.double().abs() @ (codes.double().abs() * s.double()[:, None]).T) * 2e-6
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    assert ((got.double() - exact).abs() <= exact.abs() * ulp + slack + 1e-30).all()
    rel = (got.float() - x.float() @ w.T).norm() / (x.float() @ w.T).norm().clamp_min(1e-30)
    assert rel < 0.05, f"fp8 error {rel:.4f} against the dense weight"


# ------------------------------------------------------------------ checkpoints


def _stream(tensors: dict[str, torch.Tensor], qcfg: dict) -> dict[str, torch.Tensor]:
    return dict(fp8.checkpoint_weights(tensors.items(), qcfg))


def test_checkpoint_scales_per_tensor_channel_and_block():
    g = _gen(3)
    codes = (torch.randn(300, 260, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    c = codes.float()
    per_channel = torch.rand(300, 1, generator=g) + 0.1
    blocks = torch.rand(3, 3, generator=g) + 0.1  # [ceil(300/128), ceil(260/128)]
    norm = torch.randn(260, generator=g).bfloat16()
    out = _stream(
        {
            "a.weight_scale": torch.tensor(0.5),  # a scale before its weight
            "a.weight": codes,
            "a.input_scale": torch.tensor(1.0),  # static activation scale: dropped
            "b.weight": codes,
            "b.weight_scale": per_channel,
            "norm.weight": norm,
        },
        {"quant_method": "fp8", "activation_scheme": "static"},
    )
    assert set(out) == {"a.weight", "b.weight", "norm.weight"}
    assert torch.equal(out["a.weight"], c * 0.5) and torch.equal(out["b.weight"], c * per_channel)
    assert out["norm.weight"] is norm
    blk = _stream(
        {"w.weight": codes, "w.weight_scale_inv": blocks}, {"quant_method": "fp8", "weight_block_size": [128, 128]}
    )
    r, col = torch.arange(300) // 128, torch.arange(260) // 128
    assert torch.equal(blk["w.weight"], c * blocks[r][:, col])


def test_checkpoint_junk_is_refused():
    codes = torch.zeros(8, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="without scales"):
        _stream({"a.weight": codes}, {"quant_method": "fp8"})
    with pytest.raises(ValueError, match="fits neither"):
        _stream({"a.weight": codes, "a.weight_scale": torch.ones(3, 3)}, {"quant_method": "fp8"})
    with pytest.raises(ValueError, match="2-D"):
        _stream({"a.weight": codes.view(-1), "a.weight_scale": torch.ones(())}, {"quant_method": "fp8"})
