"""The native decoder stack (models/fused.py) gives bit-identical hidden states and KV caches to the
Python modules, for every weight format it takes, over steps that mix decodes and short chunks;
models with parts only the Python modules run (per-head norms, MoE) are left to them."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from axonserve.neuron.config import ModelConfig
from axonserve.neuron.loader import load_model
from axonserve.neuron.models import fused
from axonserve.neuron.ops import native
from axonserve.neuron.ops.attention import NATIVE_MAX_QUERY, AttentionMetadata

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="native kernels unavailable: torch path only")
BS = 16
# (query_lens, context_lens) per step over the same 4 sequences: prompts in short chunks, then
# mixed steps (decodes first, then chunks), then decodes; the last step has a long chunk that
# attention sends to SDPA, so the whole step stays on the Python path
STEPS = [
    ([40, 17, 5, 33], [0, 0, 0, 0]),
    ([1, 1, 9, 30], [40, 17, 5, 33]),
    ([1, 1, 1, 1], [41, 18, 14, 63]),
    ([1, 1, 1, NATIVE_MAX_QUERY], [42, 19, 15, 64]),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {
        arch: make_tiny_model(str(tmp_path_factory.mktemp(arch)), arch)
        for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    }


def _run(
    model, dtype, monkeypatch, on: bool, reset: bool = True, kv_codes: torch.dtype | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    """Hidden states of every step and the caches after them (fresh ones); whether the stack ran."""
    monkeypatch.setenv("AXONSERVE_FUSED", "1" if on else "0")
    cfg = model.config
    shape = (64, BS, cfg.num_kv_heads, cfg.head_dim)
    if kv_codes is not None:  # --kv-cache-dtype int8 / fp8*: codes and their scales
        caches = [
            (
                torch.zeros(shape, dtype=kv_codes),
                torch.zeros(shape, dtype=kv_codes),
                torch.zeros(shape[:3]),
                torch.zeros(shape[:3]),
            )
            for _ in range(cfg.num_layers)
        ]
    else:
        caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(4)]
    gen = torch.Generator().manual_seed(0)
    outs, used = [], False
    if reset:
        model.model._stack = None
    with torch.inference_mode():
        for q, ctx in STEPS:
            meta = AttentionMetadata.build(q, ctx, tables, BS, native=native.for_dtype(dtype))
            ids = torch.randint(0, cfg.vocab_size, (sum(q),), generator=gen)
            outs.append(model(ids, meta.positions, caches, meta))
            stack = model.model._stack
            used |= stack is not None and stack[1] is not None and fused.takes(meta, ids[:, None])
    return outs, [t for kv in caches for t in kv], used


@pytest.mark.parametrize(
    "dtype,quantization,pack,kv_codes",
    [
        (torch.float32, "", False, None),
        (torch.bfloat16, "", False, None),  # dense bf16: one row through mv
        (
            torch.bfloat16,
            "",
            True,
            None,
        ),  # oneDNN-packed, and the skinny (AMX / dot-product) copy where the CPU has one
        (torch.bfloat16, "int8", False, None),
        (torch.bfloat16, "int4", False, None),
        (torch.bfloat16, "fp8", False, None),
        (torch.float32, "fp8", False, None),
        (torch.bfloat16, "", True, torch.int8),  # --kv-cache-dtype int8
        (torch.float32, "", False, torch.int8),
        (torch.bfloat16, "", True, torch.float8_e4m3fn),  # --kv-cache-dtype fp8
        (torch.float32, "", False, torch.float8_e5m2),
    ],
)
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])  # Qwen2: q/k/v biases
def test_stack_equals_the_python_modules(model_dirs, arch, dtype, quantization, pack, kv_codes, monkeypatch):
    mc = ModelConfig.from_dir(model_dirs[arch])
    model = load_model(mc, dtype, progress=False, quantization=quantization, pack=pack)
    if quantization == "int8" and native.kernels().skinny_rows(
        native.kernels().pack_int8_weight(torch.zeros(16, 32, dtype=torch.int8))
    ):  # AMX: int8 decode batches take the int8 tiles
        assert model.model.layers[0].mlp.down_proj.qweight.skinny is not None
    want, want_caches, used = _run(model, dtype, monkeypatch, on=False, kv_codes=kv_codes)
    assert not used
    got, got_caches, used = _run(model, dtype, monkeypatch, on=True, kv_codes=kv_codes)
    assert used, "the native stack did not run"
    # new caches for the same model: the stack is rebuilt over them (not left on the old ones)
    again, again_caches, _ = _run(model, dtype, monkeypatch, on=True, reset=False, kv_codes=kv_codes)
    assert all(torch.equal(a, b) for a, b in zip(again, got)) and all(t.any() for t in again_caches)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max()}"
    assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))


def test_gate_up_and_silu_fused(model_dirs, monkeypatch):
    """bf16 packed on AMX or AVX512-BF16: the stack runs gate_up and silu_and_mul as one pass
    (gate_up_silu), with the bits of the two ops (AXONSERVE_GATE_UP_SILU=0 keeps them apart)."""
    K = native.kernels()
    if K.skinny_rows(K.pack_gemv_weight(torch.zeros(16, 32, dtype=torch.bfloat16))) != 128:
        pytest.skip("no AMX tiles nor AVX512-BF16 on this CPU")
    model = load_model(ModelConfig.from_dir(model_dirs["LlamaForCausalLM"]), torch.bfloat16, progress=False, pack=True)
    runs = {}
    for v in ("0", "1"):
        monkeypatch.setenv("AXONSERVE_GATE_UP_SILU", v)
        outs, caches, used = _run(model, torch.bfloat16, monkeypatch, on=True)
        assert used and model.model._stack[1].gate_up_fused() == (v == "1")
        runs[v] = outs + caches
    assert all(torch.equal(a, b) for a, b in zip(runs["0"], runs["1"]))


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_models_with_python_only_parts_keep_the_modules(model_dirs, arch, monkeypatch):
    model = load_model(ModelConfig.from_dir(model_dirs[arch]), torch.float32, progress=False)
    _, _, used = _run(model, torch.float32, monkeypatch, on=True)
    assert not used and model.model._stack is not None and model.model._stack[1] is None


def test_small_steps_run_on_the_kernels_pool(tmp_path, monkeypatch):
    """SmolLM2's widths (2 layers), bf16 packed: a step whose linears are all the kernels' own
    (decodes on the skinny AMX / dot-product path) runs its loops on the kernels' pool
    (csrc/thread_pool.h), with the same bits as on OpenMP; a step of more rows than the skinny
    kernels take (its linears on oneDNN) stays on OpenMP."""
    K = native.kernels()
    wp = K.pack_gemv_weight(torch.zeros(16, 64, dtype=torch.bfloat16)) if K.has_bf16_gemv() else None
    if wp is None or K.skinny_rows(wp) == 0:
        pytest.skip("no skinny bf16 kernels on this CPU: every step's linears are oneDNN's")
    widths = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    model = load_model(
        ModelConfig.from_dir(make_tiny_model(str(tmp_path), "LlamaForCausalLM", **widths)),
        torch.bfloat16,
        progress=False,
        pack=True,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        K.set_thread_pool(False)
        want, want_caches, _ = _run(model, torch.bfloat16, monkeypatch, on=True)
        K.set_thread_pool(True)
        before = K.pool_loops()
        got, got_caches, used = _run(model, torch.bfloat16, monkeypatch, on=True)
        assert used and K.pool_loops() > before
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
        # more rows than the skinny kernels take: the linears go to oneDNN, the step's loops to OpenMP
        n = K.skinny_rows(wp) + 16
        monkeypatch.setenv("AXONSERVE_FUSED", "1")
        cfg = model.config
        caches = [
            (torch.zeros(64, BS, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16),) * 2
            for _ in range(cfg.num_layers)
        ]
        meta = AttentionMetadata.build([1] * n, [5] * n, [[i % 64] for i in range(n)], BS, native=K)
        before = K.pool_loops()
        with torch.inference_mode():
            model(torch.zeros(n, dtype=torch.long), meta.positions, caches, meta)
        assert fused.takes(meta, torch.zeros(n, 1)) and K.pool_loops() == before
    finally:
        torch.set_num_threads(threads)
        K.set_thread_pool(True)
