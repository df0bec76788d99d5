"""Drafter actor: a smaller draft model proposes tokens for the scheduler (method "draft_model").

After every step the scheduler sends each candidate's whole known sequence; the drafter runs
its own ModelRunner (own paged KV, reused across calls for the common prefix) and answers k
greedy drafts. It is a process of its own because a draft model is a whole second model with
its own KV pool. EAGLE's head is small and reads the target's hidden states, so it runs inside
worker rank 0 instead (speculative/eagle.py EagleProposer): a round trip through this actor cost
several times the draft step itself (docs/benchmarks.md#fig-speculative).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import torch
import zmq

from axonserve.actors.runtime import Actor
from axonserve.neuron.heap import keep_heap
from axonserve.protocol import Codec
from axonserve.protocol.messages import (
    CachedRequestData,
    DraftRequest,
    DraftResult,
    NewRequestData,
    SamplingParams,
    StepPlan,
)

_codec = Codec(DraftRequest)


class DrafterActor(Actor):
    kind = "drafter"

    async def setup(self) -> dict[str, Any]:
        torch.set_num_threads(self.config.threads or len(os.sched_getaffinity(0)))
        keep_heap()
        assert self.config.speculative is not None and self.config.speculative.method == "draft_model"
        self.proposer = await asyncio.to_thread(DraftModelProposer, self.config)
        self.sock = self.socket(zmq.ROUTER, self.addresses.drafter, bind=True)
        return self.proposer.info

    async def run(self) -> None:
        async for msg, _, ident in self.messages(self.sock, _codec, "draft request", routed=True):
            t0 = time.perf_counter()
            try:
                for rid in msg.finished_request_ids:
                    self.proposer.drop(rid)
                drafts = self.proposer.propose(msg) if msg.request_ids else []
                want = [(rid, d[:m]) for rid, d, m in zip(msg.request_ids, drafts, msg.num_drafts) if m > 0]
                reply = DraftResult(
                    msg.step_id, [r for r, _ in want], [d for _, d in want], propose_s=time.perf_counter() - t0
                )
            except Exception as e:  # noqa: BLE001 - (a malformed request too) this step goes without drafts
                self.log.error("drafter.propose_failed", step_id=msg.step_id, error=repr(e))
                for rid in msg.request_ids:  # their state may be half-updated
                    self.proposer.drop(rid)
                reply = DraftResult(msg.step_id, error=f"{type(e).__name__}: {e}")
            if msg.reply:
                await self.sock.send_multipart([ident, *Codec.encode(reply)], copy=False)


class DraftModelProposer:
    """A smaller model of the same vocabulary proposes greedily: axonserve's own ModelRunner
    with its own paged KV. Each call syncs a request to the target's tokens (keeping the
    computed KV of the common prefix), then runs one catch-up step and k - 1 decode steps."""

    def __init__(self, config: Any):
        import msgspec

        from axonserve.neuron.config import ModelConfig
        from axonserve.neuron.model_runner import ModelRunner
        from axonserve.neuron.model_source import resolve_model

        spec = config.speculative
        if not spec.model:
            raise ValueError('method "draft_model" needs "model": the draft model (name, directory or .gguf)')
        dcfg = msgspec.structs.replace(
            config,
            model=resolve_model(spec.model),
            speculative=None,
            num_workers=1,
            num_kv_blocks=None,
            kv_cache_memory_fraction=config.kv_cache_memory_fraction / 2,
            quantization="",
            snapshot="",
            bucketing=False,
            task="generate",
        )
        self.runner = ModelRunner(dcfg)
        target_vocab = ModelConfig.from_dir(config.model).vocab_size
        if self.runner.vocab_size > target_vocab:
            raise ValueError(
                f"draft model {dcfg.model} has {self.runner.vocab_size} tokens, more than the "
                f"target's {target_vocab}: they must share one vocabulary"
            )
        self.bs = self.runner.block_size
        self.free = list(range(self.runner.num_kv_blocks))
        self.blocks: dict[str, list[int]] = {}
        self.step = 0
        self.greedy = SamplingParams(temperature=0.0, max_tokens=None)
        self.info = {"method": "draft_model", "model": dcfg.model, "num_kv_blocks": self.runner.num_kv_blocks}

    def drop(self, rid: str) -> None:
        self.runner.drop_request(rid)
        self.free.extend(self.blocks.pop(rid, []))

    def propose(self, msg: DraftRequest) -> list[list[int]]:
        k = max(msg.num_drafts)
        if k == 0:
            return [[] for _ in msg.request_ids]
        new, cached, order = [], [], []
        for rid, at, n in zip(msg.request_ids, msg.offsets, msg.counts):
            true = msg.tokens[at : at + n]  # the request's whole known sequence
            if len(true) + k > self.runner.max_model_len:  # past the draft model's context
                self.drop(rid)
                continue
            need = -(-(len(true) + k) // self.bs)
            have = self.blocks.setdefault(rid, [])
            if need > len(have) + len(self.free):
                self.drop(rid)  # no room: no drafts for it this time
                continue
            grown = [self.free.pop() for _ in range(need - len(have))]
            have += grown
            st = self.runner.requests.get(rid)
            if st is None:
                new.append(NewRequestData(rid, true, len(true), list(have), 0, self.greedy))
                counts_n = len(true)
            else:
                same = next(
                    (i for i, (a, b) in enumerate(zip(st.token_ids, true)) if a != b), min(len(st.token_ids), len(true))
                )
                st.token_ids = list(true)
                st.num_computed_tokens = min(st.num_computed_tokens, same, len(true) - 1)
                cached.append(CachedRequestData(rid, grown))
                counts_n = len(true) - st.num_computed_tokens
            order.append((rid, st is None, counts_n))
        plan_n = [c for _, is_new, c in order if is_new] + [c for _, is_new, c in order if not is_new]
        drafts: dict[str, list[int]] = {rid: [] for rid, _, _ in order}
        plan = StepPlan(self._next(), new=new, cached=cached, num_scheduled_tokens=plan_n)
        for _j in range(k):
            res = self.runner.execute(plan)
            if res.error:
                raise ValueError(f"draft model step failed: {res.error}")
            for rid, tok in zip(res.request_ids, res.sampled_token_ids):
                drafts[rid].append(tok)
            live = [CachedRequestData(rid) for rid, _, _ in order]
            plan = StepPlan(self._next(), cached=live, num_scheduled_tokens=[1] * len(live))
        return [drafts.get(rid, []) for rid in msg.request_ids]

    def _next(self) -> int:
        self.step += 1
        return self.step
