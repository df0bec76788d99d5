"""`--activation-quantization int8` (layers/quant.py PanelWeight, csrc dot_linear_codes): GGUF block
codes times activations rounded to int8 per block of 32, summed in integers (llama.cpp's Q8_1).

The kernel against the same arithmetic in float64 at every tile it dispatches to, a coded model
through the real loader against transformers (close, not equal: the activations lose bits), the
native stack against the Python modules (equal), and the settings it refuses. `axonserve validate`
on the default model is in tests/test_validate.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from axonserve.config import EngineConfig
from axonserve.neuron.layers.quant import PanelWeight, panel_kernels
from axonserve.neuron.models import fused
from axonserve.neuron.ops.attention import AttentionMetadata

from .conftest import hf_model, make_runner, make_tiny_llama, runner_logits
from .test_panel import _bound, _gguf_like

kernels = panel_kernels(torch.float32)
pytestmark = pytest.mark.skipif(kernels is None, reason="panel kernels need AVX2 + FMA")


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x with every block of 32 inputs rounded as the kernel rounds it: d = max|x| / 127,
    q = round-half-even(x * (1 / d)) in float32, returned as q d in float64."""
    m, k = x.shape
    g = x.reshape(m, k // 32, 32)
    d = g.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = (g * inv[..., None]).round()
    return (q.double() * d.double()[..., None]).reshape(m, k)


# rows: 1 (4 panels a tile, and the leftover panels), 2-4, groups of <= 4, past PANEL_ROW_BLOCK (192)
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 9, 32, 250])
def test_int8_activations_match_the_integer_arithmetic(kind, m):
    n, k = 112, 96  # 7 panels: one 4-panel tile and 3 single ones at 1 row
    w = _gguf_like(n, k, kind, seed=m)
    pw = PanelWeight(w, kernels, int8_activations=True)
    assert pw.int8_activations and pw.format == kind and pw.data.shape == (n // 16, k // 4, 32 if kind == "q4" else 64)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    if m:
        x[0, :32] = 0  # an all-zero block (scale 0)
        x[-1, 40] = 1e4  # one large input: its block's other inputs round to 0
    got = pw.matmul(x)
    xq = _int8_rows(x)
    ref = xq @ w.double().T
    assert got.shape == (m, n)
    assert ((got.double() - ref).abs() <= _bound(xq, w)).all()
    if m:  # the activations are rounded: the exact product differs
        assert not torch.allclose(got.double(), x.double() @ w.double().T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_int8_activations_turn_non_finite_inputs_into_nan_rows(kind):
    w = _gguf_like(32, 96, kind, seed=3)
    pw = PanelWeight(w, kernels, int8_activations=True)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(3))
    x[1, 5], x[2, 70], x[3, 33] = float("nan"), float("inf"), -float("inf")
    got = pw.matmul(x)
    assert got[1:4].isnan().all()  # not a finite guess
    finite = [0, 4, 5]
    assert torch.equal(got[finite], pw.matmul(x[finite]))  # the other rows as if alone


def test_dot_codes_refuse_bad_input():
    w = _gguf_like(32, 64, "q4", seed=1)
    pw = PanelWeight(w, kernels, int8_activations=True)
    with pytest.raises(RuntimeError, match="K = x.size"):
        kernels.dot_linear_codes(torch.randn(2, 32), pw.data, pw.d, pw.m)
    with pytest.raises(RuntimeError, match="d, m"):
        kernels.dot_linear_codes(torch.randn(2, 64), pw.data, pw.d[:1], pw.m)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack_dot_codes(torch.zeros(2, 48, 8, dtype=torch.uint8))
    plain = PanelWeight(torch.randn(32, 64), kernels, int8_activations=True)  # no codes: stays exact
    assert not plain.int8_activations and plain.format == "float32"


def _coded_llama(path: str) -> str:
    """A tiny Llama whose linears hold what the GGUF converter writes for Q4_1 tensors (the LM head
    and embedding Q8_0's), each block's values rounded onto its codes."""
    from safetensors.torch import load_file, save_file

    make_tiny_llama(path)
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    for name, t in sd.items():
        if t.dim() != 2:
            continue
        n, k = t.shape
        g = t.double().reshape(n, k // 32, 32)
        if "embed" in name or "lm_head" in name:
            d = (g.abs().amax(-1) / 127).half().double()
            q = (g / d[..., None]).round().clamp(-127, 127)
            m = torch.zeros_like(d)
        else:
            m = g.amin(-1).half().double()
            d = ((g.amax(-1) - m) / 15).half().double()
            q = ((g - m[..., None]) / d[..., None]).round().clamp(0, 15)
        sd[name] = (q * d[..., None] + m[..., None]).float().reshape(n, k)
    save_file(sd, f, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def coded_dir(tmp_path_factory) -> str:
    return _coded_llama(str(tmp_path_factory.mktemp("coded-llama")))


def test_a_coded_model_serves_int8_activations_near_transformers(coded_dir, monkeypatch):
    exact = make_runner(coded_dir, dtype="float32")
    runner = make_runner(coded_dir, dtype="float32", activation_quantization="int8")
    linears = {n: m.qweight for n, m in runner.model.named_modules() if getattr(m, "quantizable", False)}
    assert linears and all(q.int8_activations for q in linears.values())
    assert linears.pop("lm_head").format == "q8" and {q.format for q in linears.values()} == {"q4"}
    ids = torch.randint(0, 1024, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf_model(coded_dir)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(runner_logits(exact, ids, [60]), ref, atol=1e-4, rtol=1e-4)  # codes: exact
    got = runner_logits(runner, ids, [60])
    err = (got - ref).abs().max().item()
    assert 1e-4 < err < 0.05 * ref.abs().max().item(), err  # rounded activations: near, not equal
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9

    # decodes through the native stack equal the Python modules' (the same kernel, the same order)
    def decode(on: bool) -> list[torch.Tensor]:
        monkeypatch.setenv("AXONSERVE_FUSED", "1" if on else "0")
        runner.model.model._stack = None
        runner_logits(runner, ids[:20], [20])  # the prompt (its K/V), then 4 decodes
        outs, used = [], False
        with torch.inference_mode():
            for c in range(20, 24):
                table = [list(range(15))[::-1]]
                meta = AttentionMetadata.build([1], [c], table, runner.block_size, native=runner.native)
                tok = torch.tensor(ids[c : c + 1])
                outs.append(runner.model(tok, meta.positions, runner.kv_caches, meta))
                stack = runner.model.model._stack
                used |= stack is not None and stack[1] is not None and fused.takes(meta, tok[:, None])
        assert used == on
        return outs

    assert all(torch.equal(a, b) for a, b in zip(decode(True), decode(False)))


def test_int8_activations_are_refused_where_they_cannot_apply(tmp_path):
    # --dtype auto means float32 with them, also on CPUs where auto would pick bf16
    assert EngineConfig(model="m", activation_quantization="int8").dtype == "float32"
    with pytest.raises(ValueError, match="needs --dtype float32"):
        EngineConfig(model="m", dtype="bfloat16", activation_quantization="int8")
    with pytest.raises(ValueError, match="not with --quantization"):
        EngineConfig(model="m", dtype="float32", quantization="int8", activation_quantization="int8")
    with pytest.raises(ValueError, match="not supported"):
        EngineConfig(model="m", dtype="float32", activation_quantization="int4")
    plain = make_tiny_llama(str(tmp_path))  # float32 weights: no block codes to multiply
    with pytest.raises(ValueError, match="needs GGUF Q4_1 / Q8_0 weights"):
        make_runner(plain, dtype="float32", activation_quantization="int8")
