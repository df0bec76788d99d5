"""Multi-LoRA through the whole offline engine (supervisor, scheduler, worker processes): each
request's greedy tokens equal transformers' with its adapter merged into the weights
(`PeftModel.from_pretrained(...).merge_and_unload()`), for batches that mix adapters of different
ranks and targets with base-model requests in the same steps; with one slot (requests of two
adapters serialized, slots evicted and re-filled); across the prefix cache; over 2 tensor-parallel
ranks; and on SmolLM2."""

from __future__ import annotations

import os

import pytest
from conftest import hf_greedy

from axonserve import LLM, LoRARequest, SamplingParams
from lora.lora_helpers import make_adapter, merged_model

N = 8  # greedy tokens per request


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-engine")
    return {
        "a": make_adapter(tiny_llama_dir, str(root / "a"), r=8, seed=1),
        "b": make_adapter(tiny_llama_dir, str(root / "b"), r=4, targets=["q_proj", "v_proj"], seed=2),
    }


def references(base_dir: str, adapters: dict[str, str | None], prompts: list[list[int]], n: int = N):
    """name -> greedy tokens per prompt, each adapter merged (None: the base model); every
    adapter must change some output, or the test would prove nothing."""
    refs = {name: [hf_greedy(merged_model(base_dir, path), p, n) for p in prompts] for name, path in adapters.items()}
    base = refs.get("base")
    for name, got in refs.items():
        if name != "base" and base is not None:
            assert got != base, f"adapter {name} does not change the output"
    return refs


def greedy(n: int = N) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


PROMPTS = [[5, 17, 300, 41, 99, 1000, 7, 12, 4000, 13], [8, 9, 10, 11], [100, 200, 300, 400, 500, 600]]


@pytest.mark.timeout(600)
def test_mixed_adapters_and_base_in_one_batch(tiny_llama_dir, adapters):
    refs = references(tiny_llama_dir, {"a": adapters["a"], "b": adapters["b"], "base": None}, PROMPTS)
    la, lb = LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"])
    # every prompt with every adapter and the base model, submitted together: steps mix all three
    prompts, loras, want = [], [], []
    for i, p in enumerate(PROMPTS):
        for name, lo in (("a", la), ("b", lb), ("base", None)):
            prompts.append(p)
            loras.append(lo)
            want.append(refs[name][i])
    with LLM(
        tiny_llama_dir,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=24,  # chunked prefills next to decodes
        log_level="warning",
    ) as llm:
        outs = llm.generate(prompts, greedy(), lora_request=loras)
        assert [o.outputs[0].token_ids for o in outs] == want
        # one LoRARequest for every prompt
        outs = llm.generate(PROMPTS, greedy(), lora_request=lb)
        assert [o.outputs[0].token_ids for o in outs] == refs["b"]
        with pytest.raises(ValueError, match="one per prompt"):
            llm.generate(PROMPTS, greedy(), lora_request=[la])
        with pytest.raises(ValueError, match="not a directory"):
            llm.generate(PROMPTS[:1], greedy(), lora_request=LoRARequest("x", 9, "/nonexistent"))


@pytest.mark.timeout(600)
def test_one_slot_serializes_evicts_and_keeps_prefixes_apart(tiny_llama_dir, adapters):
    long = [[(i * 7919) % 40000 + 3 for i in range(1, 23)]]  # 5 full blocks of 4: prefix-cache hits
    refs = references(tiny_llama_dir, {"a": adapters["a"], "b": adapters["b"], "base": None}, PROMPTS + long)
    la, lb = LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"])
    with LLM(
        tiny_llama_dir,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,  # every switch re-reads the adapter from disk
        max_lora_rank=8,
        block_size=4,
        num_kv_blocks=128,
        log_level="warning",
    ) as llm:
        # two adapters requested concurrently with one slot: the scheduler runs them in turn
        outs = llm.generate(PROMPTS * 2, greedy(), lora_request=[la] * 3 + [lb] * 3)
        assert [o.outputs[0].token_ids for o in outs] == refs["a"][:3] + refs["b"][:3]
        # the same prompt with A, then B, then the base model, then A again (slot evicted and
        # re-filled): each from its own KV, never another's cached prefix
        for name, lo in (("a", la), ("b", lb), ("base", None), ("a", la), ("b", lb)):
            (out,) = llm.generate(long, greedy(), lora_request=lo)
            assert out.outputs[0].token_ids == refs[name][3], name


@pytest.mark.timeout(600)
def test_tensor_parallel_two_ranks(tiny_llama_dir, adapters):
    # tiny Llama: 4 query / 2 KV heads, intermediate 128: q, k, v, gate, up split over 2 ranks
    refs = references(tiny_llama_dir, {"a": adapters["a"], "b": adapters["b"], "base": None}, PROMPTS)
    la, lb = LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"])
    with LLM(
        tiny_llama_dir,
        enable_lora=True,
        num_workers=2,
        max_loras=2,
        max_lora_rank=8,
        block_size=4,
        num_kv_blocks=128,
        log_level="warning",
    ) as llm:
        outs = llm.generate(PROMPTS * 3, greedy(), lora_request=[la] * 3 + [lb] * 3 + [None] * 3)
        assert [o.outputs[0].token_ids for o in outs] == refs["a"] + refs["b"] + refs["base"]


@pytest.mark.timeout(900)
def test_smollm2_mixed_adapters(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    ads = {
        "a": make_adapter(smollm2_dir, str(tmp_path / "a"), r=8, seed=3),
        "b": make_adapter(smollm2_dir, str(tmp_path / "b"), r=4, targets=["q_proj", "v_proj"], seed=4),
    }
    refs = references(smollm2_dir, {**ads, "base": None}, prompts)
    la, lb = LoRARequest("a", 1, ads["a"]), LoRARequest("b", 2, ads["b"])
    with LLM(
        smollm2_dir,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_kv_blocks=64,
        log_level="warning",
    ) as llm:
        outs = llm.generate(prompts * 3, greedy(), lora_request=[la] * 2 + [lb] * 2 + [None] * 2)
        assert [o.outputs[0].token_ids for o in outs] == refs["a"] + refs["b"] + refs["base"]
    assert os.path.isdir(ads["a"])


@pytest.mark.timeout(600)
async def test_adapter_failing_on_the_ranks_fails_only_its_requests(tiny_llama_dir, adapters, tmp_path):
    """An adapter that no longer loads where the ranks read it (moved or corrupted after the
    frontend checked it) ends its own requests with a 400 error; the other requests of the same
    steps, on the base model and on a good adapter, complete correctly, and the engine keeps serving."""
    import asyncio

    from axonserve.actors.supervisor import Supervisor
    from axonserve.config import EngineConfig
    from axonserve.frontends.client import AsyncEngineClient
    from axonserve.protocol.messages import LoraSpec

    refs = references(tiny_llama_dir, {"a": adapters["a"], "base": None}, PROMPTS[:1])
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        data = (open(os.path.join(adapters["a"], name), "rb")).read()
        (corrupt / name).write_bytes(data[: len(data) // 2] if name.endswith(".safetensors") else data)
    config = EngineConfig(
        model=tiny_llama_dir,
        enable_lora=True,
        num_workers=2,  # both ranks must agree to skip the request
        max_loras=2,
        max_lora_rank=8,
        block_size=4,
        num_kv_blocks=128,
        log_level="warning",
    )
    sup = Supervisor(config, frontend=False)
    await sup.start()
    client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
    try:

        async def run(lora: LoraSpec | None) -> tuple[list[int], str | None, int]:
            toks, err, code = [], None, 0
            async for out in client.generate(PROMPTS[0], greedy(), lora=lora):
                toks.extend(out.token_ids)
                err, code = err or out.error, code or out.error_code
            return toks, err, code

        good = LoraSpec("a", 1, adapters["a"])
        results = await asyncio.wait_for(
            asyncio.gather(
                run(good),
                run(LoraSpec("gone", 2, str(tmp_path / "nowhere"))),
                run(None),
                run(LoraSpec("bad", 3, str(corrupt))),
            ),
            240,
        )
        assert results[0][:2] == (refs["a"][0], None)
        assert results[2][:2] == (refs["base"][0], None)
        assert results[1][0] == [] and "not a directory" in results[1][1] and results[1][2] == 400
        assert results[3][0] == [] and results[3][1] and results[3][2] == 400
        # still serving, the good adapter included
        assert (await run(good))[:2] == (refs["a"][0], None)
        assert (await run(None))[:2] == (refs["base"][0], None)
    finally:
        client.close()
        await sup.stop("test done")
