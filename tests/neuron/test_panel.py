"""Panel matmul (layers/quant.py PanelWeight, csrc panel_linear): float32 linears on AVX2 CPUs.

The kernel against a float64 reference at every tile shape it dispatches to, the weight format
it chooses (bf16 only where exact), and a bf16 checkpoint served in float32 through the real
loader against transformers.
"""

from __future__ import annotations

import pytest
import torch

from axonserve.neuron.layers.quant import PanelWeight, block_codes, panel_kernels, panels_serve
from axonserve.neuron.model_source import resolve_model

from .conftest import hf_model, make_runner, make_tiny_llama, runner_logits

kernels = panel_kernels(torch.float32)
pytestmark = pytest.mark.skipif(kernels is None, reason="panel_linear needs AVX2 + FMA")
# where the loader serves exact float32 on panels (AVX2 CPUs; AVX-512 ones keep MKL for it)
loader_panels = pytest.mark.skipif(
    not panels_serve(torch.float32), reason="AVX-512 CPU: exact float32 linears stay on MKL (quant.panels_serve)"
)


def test_the_loader_puts_panels_where_they_pay():
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert panels_serve(torch.float32) is not avx512
    assert panels_serve(torch.float32, int8_activations=True)  # the int8 dot products: on any AVX2 CPU
    assert not panels_serve(torch.bfloat16) and not panels_serve(torch.bfloat16, int8_activations=True)


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 summation error bound of x @ w^T: K eps sum|x||w| (plus a floor)."""
    k = max(x.shape[1], 1)
    return k * 2**-23 * (x.double().abs() @ w.double().abs().T) + 1e-30


# rows: 1-3 (several panels per tile), 4-6 and odd groups, past PANEL_ROW_BLOCK (192)
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 13, 32, 200, 400])
@pytest.mark.parametrize("n,k", [(16, 1), (48, 3), (112, 64), (960, 577)])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_panel_linear_matches_float64(m, n, k, wdtype):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(wdtype)
    x = torch.randn(m, k, generator=g)
    got = kernels.panel_linear(x, kernels.pack_panels(w))
    assert got.shape == (m, n) and got.dtype == torch.float32
    ref = x.double() @ w.double().T
    err = (got.double() - ref).abs()
    assert (err <= _bound(x, w.float())).all(), err.max()


def test_panel_linear_takes_strided_rows_and_refuses_bad_shapes():
    w = torch.randn(32, 40)
    x = torch.randn(6, 80)[:, ::2]  # non-contiguous rows
    torch.testing.assert_close(kernels.panel_linear(x, kernels.pack_panels(w)), x @ w.T, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.pack_panels(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="K = x.size"):
        kernels.panel_linear(torch.randn(2, 9), kernels.pack_panels(torch.randn(16, 8)))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.panel_linear(torch.randn(2, 8).bfloat16(), kernels.pack_panels(torch.randn(16, 8)))


def test_panel_weight_keeps_bf16_only_where_exact():
    exact = torch.randn(64, 32).bfloat16().float()
    pw = PanelWeight(exact, kernels)
    assert pw.data.dtype == torch.bfloat16 and pw.nbytes == 64 * 32 * 2
    inexact = exact.clone()
    inexact[3, 5] += 1e-4  # one value off the bf16 grid: the whole weight stays float32
    pf = PanelWeight(inexact, kernels)
    assert pf.data.dtype == torch.float32 and pf.nbytes == 64 * 32 * 4
    x = torch.randn(3, 4, 32)  # leading batch dims are flattened and restored
    torch.testing.assert_close(pf.matmul(x), x @ inexact.T, atol=1e-5, rtol=1e-5)


@loader_panels
def test_bf16_checkpoint_served_in_float32_matches_transformers(tmp_path):
    """The loader puts every linear of a float32 model on panels (bf16 ones for a bf16
    checkpoint) and the logits still equal transformers' float32 ones."""
    d16 = make_tiny_llama(str(tmp_path))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(d16, dtype=torch.bfloat16).save_pretrained(d16)  # weights now bf16
    runner = make_runner(resolve_model(d16), dtype="float32")
    linears = [m for m in runner.model.modules() if getattr(m, "quantizable", False)]
    assert linears and all(isinstance(m.qweight, PanelWeight) for m in linears)
    assert all(m.qweight.data.dtype == torch.bfloat16 for m in linears)
    ids = torch.randint(0, 1024, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf_model(d16)(torch.tensor([ids])).logits[0]
    for chunks in ([120], [50, 1, 1, 68]):
        torch.testing.assert_close(runner_logits(runner, ids, chunks), ref, atol=1e-4, rtol=1e-4)


def _gguf_like(n: int, k: int, kind: str, seed: int, with_codes: bool = False):
    """What the GGUF converter writes for a Q4_1 / Q8_0 tensor: float32 of q d + m (one rounding),
    d and m float16, q 4-bit unsigned / 8-bit signed, per row and block of 32 inputs (with_codes:
    also q [n, k], d and m [n, k/32])."""
    g = torch.Generator().manual_seed(seed)
    blocks = (n, k // 32)
    d = (torch.rand(blocks, generator=g) * 0.01 + 1e-4).half().double()
    if kind == "q4":
        q = torch.randint(0, 16, (*blocks, 32), generator=g).double()
        q[..., 0], q[..., 1] = 0, 15  # llama.cpp's Q4_1: the block's min and max are codes 0 and 15
        m = (torch.randn(blocks, generator=g) * 0.05).half().double()
    else:
        q = torch.randint(-127, 128, (*blocks, 32), generator=g).double()
        q[..., 0] = 127  # Q8_0: the largest magnitude is 127
        m = torch.zeros(blocks, dtype=torch.float64)
    w = (q * d[..., None] + m[..., None]).float().reshape(n, k)
    return (w, q.reshape(n, k), d, m) if with_codes else w


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("m", [0, 1, 2, 3, 5, 32, 250])
def test_block_codes_round_trip_and_matmul(kind, m):
    n, k = 112, 96
    w = _gguf_like(n, k, kind, seed=m)
    pw = PanelWeight(w, kernels)
    assert pw.format == kind
    assert pw.nbytes == n * k // (2 if kind == "q4" else 1) + 2 * 2 * n * k // 32  # codes + float16 d, m
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
    got = pw.matmul(x)
    ref = x.double() @ w.double().T  # the very float32 weight: the codes must rebuild it exactly
    assert ((got.double() - ref).abs() <= _bound(x, w)).all()


def test_block_codes_refuse_what_they_cannot_rebuild():
    w = _gguf_like(32, 64, "q4", seed=1)
    assert block_codes(w) is not None
    off = w.clone()
    off[5, 40] = torch.nextafter(off[5, 40], torch.tensor(1.0))  # one value one ulp off its code
    assert block_codes(off) is None or block_codes(off)[0].dtype == torch.int8  # not as Q4 at least
    pw = PanelWeight(off, kernels)
    x = torch.randn(4, 64)
    assert ((pw.matmul(x).double() - x.double() @ off.double().T).abs() <= _bound(x, off)).all()
    assert block_codes(torch.randn(32, 64)) is None  # plain float32 weights stay float32
    assert PanelWeight(torch.randn(32, 64), kernels).format == "float32"
    assert block_codes(torch.randn(32, 40)) is None  # K not a multiple of 32


@loader_panels
def test_default_model_layers_load_as_codes():
    """SmolLM2's GGUF is Q4_1 in its layers and Q8_0 in its (tied) embedding: served in float32,
    every linear comes back as codes, the LM head as 8-bit ones."""
    runner = make_runner(resolve_model(None), block_size=16, num_kv_blocks=16)
    formats = {name: m.qweight.format for name, m in runner.model.named_modules() if getattr(m, "quantizable", False)}
    assert formats.pop("lm_head") == "q8"
    assert set(formats.values()) == {"q4"}, formats
