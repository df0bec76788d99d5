"""Fixtures for the device layer: tiny random Llama checkpoints and a miniature scheduler."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from axonserve.config import EngineConfig  # noqa: E402
from axonserve.neuron.model_runner import ModelRunner  # noqa: E402
from axonserve.neuron.ops.attention import AttentionMetadata  # noqa: E402
from axonserve.protocol.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepPlan,
)

TINY = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def make_tiny_llama(path: str, seed: int = 0, **overrides) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger-than-default weights so logits are well separated (fewer near-ties)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session", params=[False, True], ids=["untied", "tied"])
def tiny_llama_dir(request, tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny")), tie_word_embeddings=request.param)


def make_runner(model_dir: str, rank: int = 0, dist_init: str | None = None, **kw) -> ModelRunner:
    kw = {"block_size": 4, "num_kv_blocks": 256, "threads": 2, **kw}
    return ModelRunner(EngineConfig(model=model_dir, **kw), rank=rank, dist_init=dist_init)


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def runner_logits(runner, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """All-position logits of one sequence, prefilled in the given chunk sizes (through the
    runner's attention path: native kernels when it has them, as `execute` does)."""
    out, c = [], 0
    blocks = list(range(-(-len(ids) // runner.block_size)))[::-1]  # reversed: non-contiguous slots
    with torch.inference_mode():
        for n in chunks:
            meta = AttentionMetadata.build(
                [n], [c], [blocks], runner.block_size, native=runner.native, native_chunks=runner.native_chunks
            )
            h = runner.model(torch.tensor(ids[c : c + n]), meta.positions, runner.kv_caches, meta)
            out.append(runner.model.compute_logits(h))
            c += n
    return torch.cat(out)


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    started: bool = False
    outputs: list[int] = field(default_factory=list)


class MiniScheduler:
    """Just enough scheduling to drive ModelRunner like the real engine does: arrivals at
    given steps, a per-request chunk limit (chunked prefill), shuffled block ids, diffs."""

    def __init__(self, runner: ModelRunner, chunk: int = 5, seed: int = 0):
        self.runner, self.chunk, self.bs = runner, chunk, runner.block_size
        self.free = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free)
        self.pending: list[tuple[int, _Req]] = []
        self.running: list[_Req] = []
        self.done: dict[str, _Req] = {}
        self.step_id = 0
        self.to_finish: list[str] = []
        self.mixed_steps = 0  # steps with both decodes and prefills
        self.chunked: set[str] = set()

    def add(self, rid: str, prompt: list[int], max_tokens: int, at_step: int = 0, params: SamplingParams | None = None):
        p = params or SamplingParams(temperature=0.0)
        self.pending.append((at_step, _Req(rid, list(prompt), p, max_tokens, tokens=list(prompt))))

    def step(self):
        for at, r in [x for x in self.pending if x[0] <= self.step_id]:
            self.pending.remove((at, r))
            self.running.append(r)
        new, cached, nums = [], [], []
        news, olds = [r for r in self.running if not r.started], [r for r in self.running if r.started]
        for r in news + olds:
            n = min(self.chunk, len(r.tokens) - r.computed)
            need = -(-(r.computed + n) // self.bs) - len(r.blocks)
            added = [self.free.pop() for _ in range(need)]
            r.blocks += added
            if not r.started:
                new.append(NewRequestData(r.rid, list(r.tokens), len(r.prompt), list(r.blocks), r.computed, r.params))
                r.started = True
            else:
                cached.append(CachedRequestData(r.rid, added))
            nums.append(n)
            if r.computed + n < len(r.tokens):
                self.chunked.add(r.rid)
        kinds = {n == 1 for n in nums}
        self.mixed_steps += kinds == {True, False}
        plan = StepPlan(
            self.step_id, new=new, cached=cached, num_scheduled_tokens=nums, finished_request_ids=self.to_finish
        )
        self.to_finish = []
        res = self.runner.execute(plan)
        assert res.error is None, res.error
        by_id = {r.rid: r for r in self.running}
        for r, n in zip(news + olds, nums):
            r.computed += n
        for rid, t in zip(res.request_ids, res.sampled_token_ids):
            r = by_id[rid]
            r.tokens.append(t)
            r.outputs.append(t)
            if len(r.outputs) >= r.max_tokens:
                self.running.remove(r)
                self.free += r.blocks
                self.done[rid] = r
                self.to_finish.append(rid)
        self.step_id += 1
        return res

    def run(self) -> dict[str, list[int]]:
        while self.pending or self.running:
            self.step()
        return {rid: r.outputs for rid, r in self.done.items()}
