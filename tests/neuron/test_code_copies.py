"""Code copies (layers/quant.py `code_copy`, csrc `qdot_bf16`): a GGUF Q4_1 / Q8_0 weight served in
bf16 is also kept as its block codes, which steps of up to `code_rows` rows stream instead.

They must change nothing but the bytes read: the kernel against dot_bf16 over the same bf16
weight, bit for bit, at every row count it takes (and SiLU's pass); the loader gives copies only
where the codes rebuild the bf16 weight exactly; and the default model (SmolLM2's Q4_1 GGUF)
gives the same logits, bit for bit, with and without them, through the module path and the
fused decoder stack.
"""

from __future__ import annotations

import pytest
import torch

from axonserve.neuron.layers.quant import block_fit, code_copy
from axonserve.neuron.model_source import resolve_model
from axonserve.neuron.ops import native
from axonserve.neuron.ops.attention import AttentionMetadata

from .conftest import make_runner, runner_logits
from .test_panel import _gguf_like

kernels = native.kernels()
pytestmark = pytest.mark.skipif(
    kernels is None or not kernels.has_bf16_gemv(), reason="qdot_bf16 needs AVX512-BF16 (dot_bf16 is its reference)"
)
QDOT_ROWS = 4  # the most rows qdot_bf16 takes (cpu_kernels.cpp)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("n,k", [(112, 96), (3072, 576), (576, 1536)])
def test_codes_give_dot_bf16s_bits(kind, n, k):
    w = _gguf_like(n, k, kind, seed=n + k)
    wb = w.bfloat16()
    codes, scales = code_copy(w, wb)
    assert codes.dtype == (torch.uint8 if kind == "q4" else torch.int8)
    assert codes.numel() * codes.element_size() == n * k // (2 if kind == "q4" else 1)  # 4 / 8 bits a weight
    wp = kernels.pack_gemv_weight(wb)
    g = torch.Generator().manual_seed(k)
    for m in range(QDOT_ROWS + 1):
        x = torch.randn(m, k, generator=g).bfloat16()
        assert torch.equal(kernels.qdot_bf16(x, codes, scales), kernels.dot_bf16(x, wp)), m
        if n % 32 == 0:  # gate_up: [gate; up], SiLU's pass
            assert torch.equal(kernels.qdot_bf16(x, codes, scales, silu=True), kernels.dot_bf16(x, wp, True)), m
    xs = torch.randn(3, 2 * k, generator=g).bfloat16()[:, :k]  # rows with a stride
    assert torch.equal(kernels.qdot_bf16(xs, codes, scales), kernels.dot_bf16(xs.contiguous(), wp))


def test_no_copy_unless_the_codes_rebuild_the_weight():
    w = _gguf_like(32, 64, "q4", seed=3)
    assert code_copy(w, w.bfloat16()) is not None
    off = w.bfloat16().clone()
    off.view(torch.int16)[7, 9] += 1  # the next bf16 after w's rounding there: the codes rebuild another weight
    assert not torch.equal(off, w.bfloat16())
    assert code_copy(w, off) is None
    off = w.bfloat16().clone()
    off.view(torch.int16)[31, 63] ^= 1 << 15  # the sign of its last value
    assert code_copy(w, off) is None
    assert code_copy(torch.randn(32, 64), torch.randn(32, 64).bfloat16()) is None  # not block codes
    assert code_copy(torch.randn(32, 40), torch.randn(32, 40).bfloat16()) is None  # K not a multiple of 32


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_fit_finds_the_codes_the_weight_was_made_of(kind):
    w, q, d, m = _gguf_like(256, 128, kind, seed=11, with_codes=True)
    bits, fq, fd, fm = block_fit(w, w.bfloat16())
    assert bits == (4 if kind == "q4" else 8)
    assert torch.equal(fq.double(), q) and torch.equal(fd.double(), d) and torch.equal(fm.double(), m)
    mixed = torch.cat([w[:16], _gguf_like(48, 128, "q8" if kind == "q4" else "q4", seed=6)])
    assert block_fit(mixed) is None  # one kind a weight (the copy's layout is one)


def test_qdot_refuses_what_it_cannot_take():
    w = _gguf_like(32, 64, "q4", seed=4)
    codes, scales = code_copy(w, w.bfloat16())
    x = torch.randn(2, 64).bfloat16()
    for bad in (
        lambda: kernels.qdot_bf16(x.float(), codes, scales),
        lambda: kernels.qdot_bf16(torch.randn(2, 96).bfloat16(), codes, scales),
        lambda: kernels.qdot_bf16(x, codes.to(torch.int16), scales),
        lambda: kernels.qdot_bf16(x, codes, scales.float()),
        lambda: kernels.qdot_bf16(x, codes, scales[:1]),
        lambda: kernels.qdot_bf16(torch.randn(QDOT_ROWS + 1, 64).bfloat16(), codes, scales),
    ):
        with pytest.raises(RuntimeError):
            bad()


def _logits_and_stack_decode(runner) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt prefilled in chunks of 5, 4, 3, 2 and 1 rows (the module path), then a decode step of
    three sequences (the fused stack): every logit of both."""
    ids = [1, 416, 2731, 314, 253, 1812, 12, 9466, 30, 2095, 260, 3451, 288, 9, 17]
    prompt = runner_logits(runner, ids, [5, 4, 3, 2, 1])
    bs = runner.block_size
    seqs = [ids[:6], ids[3:10], ids[:9]]
    tables, base = [], 64
    with torch.inference_mode():
        for s in seqs:  # each sequence prefilled into its own blocks
            t = list(range(base, base + 4))
            base += 4
            meta = AttentionMetadata.build(
                [len(s)], [0], [t], bs, native=runner.native, native_chunks=runner.native_chunks
            )
            runner.model(torch.tensor(s), meta.positions, runner.kv_caches, meta)
            tables.append(t)
        meta = AttentionMetadata.build([1] * 3, [len(s) for s in seqs], tables, bs, native=runner.native)
        h = runner.model(torch.tensor([7, 8, 9]), meta.positions, runner.kv_caches, meta)
        return prompt, runner.model.compute_logits(h)


@pytest.mark.skipif(
    kernels is None or not kernels.code_rows(), reason="the loader keeps code copies without AMX only (code_rows)"
)
def test_default_model_logits_are_the_same_bits_with_code_copies(monkeypatch):
    model = resolve_model(None)
    with_codes = make_runner(model, dtype="bfloat16", block_size=16, num_kv_blocks=128)
    packed = [m.qweight for m in with_codes.model.modules() if getattr(m, "qweight", None) is not None]
    assert packed and all(q.codes is not None for q in packed), "every linear and the LM head get codes"
    assert {q.codes.dtype for q in packed} == {torch.uint8, torch.int8}  # Q4_1 layers, the Q8_0 tied LM head
    got = _logits_and_stack_decode(with_codes)
    assert with_codes.model.model._stack[1] is not None  # the decode step ran the fused stack
    del with_codes
    monkeypatch.setenv("AXONSERVE_CODE_COPIES", "0")
    without = make_runner(model, dtype="bfloat16", block_size=16, num_kv_blocks=128)
    assert all(m.qweight.codes is None for m in without.model.modules() if getattr(m, "qweight", None) is not None)
    want = _logits_and_stack_decode(without)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    del without
    # a checkpoint whose layer 3 is not written together: its late tensor arrives after the layer
    # was fitted, so that layer keeps no copies (the others do) and the logits are the same
    from axonserve.neuron import loader

    monkeypatch.delenv("AXONSERVE_CODE_COPIES")
    real = loader.iter_weights

    def late_layer_3(path, progress):
        items = list(real(path, progress))
        name = "model.layers.3.mlp.down_proj.weight"
        assert any(n == name for n, _ in items)
        return iter([it for it in items if it[0] != name] + [it for it in items if it[0] == name])

    monkeypatch.setattr(loader, "iter_weights", late_layer_3)
    late = make_runner(model, dtype="bfloat16", block_size=16, num_kv_blocks=128)
    assert not any(hasattr(p, "exact") or hasattr(p, "code_copy") for p in late.model.parameters())
    packed = {n: m.qweight for n, m in late.model.named_modules() if getattr(m, "qweight", None) is not None}
    coded = {n for n, q in packed.items() if q.codes is not None}
    assert not any(".layers.3." in n for n in coded) and any(".layers.4." in n for n in coded), sorted(coded)[:8]
    for g, w in zip(_logits_and_stack_decode(late), want):
        assert torch.equal(g, w)
