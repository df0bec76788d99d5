"""`DataParallelClient`: N engines (`--data-parallel-size`) behind one frontend.

Each engine is a scheduler with its own ranks and KV cache; one `AsyncEngineClient` talks to each.
A request goes to the engine with the fewest outstanding tokens (prompt + tokens still to generate
of everything in flight there), unless an engine already served a prompt with the same leading
blocks and is not much busier: its prefix cache then likely holds them (a hash of the first
blocks, as vLLM's DP load balancer and SGLang's cache-aware router do). The surface is the one the
HTTP server and the offline API use of `AsyncEngineClient`; one engine's death fails only its own
requests, and while its scheduler restarts (`for_scheduler(name).suspend`) new requests go to the others.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import structlog

from axonserve.config import engine_of
from axonserve.frontends.client import AsyncEngineClient, EngineDeadError, StreamOutput, batch_ids
from axonserve.protocol.messages import PoolingParams, ProfileStatus, SamplingParams

log = structlog.get_logger(__name__)

AFFINITY_BLOCKS = 4  # leading blocks hashed for prefix affinity (1..4 blocks: the longest known wins)
AFFINITY_ENTRIES = 65536  # remembered prefixes (LRU)


class DataParallelClient:
    def __init__(self, clients: list[AsyncEngineClient]):
        self.clients = clients
        self.load = [0] * len(clients)  # outstanding tokens per engine
        self.routed = [0] * len(clients)  # requests sent to each engine (for tests and logs)
        self._prefixes: OrderedDict[bytes, int] = OrderedDict()  # hash of leading blocks -> engine

    @classmethod
    async def connect(cls, addresses: list[str], **kwargs: Any) -> "DataParallelClient":
        first = await AsyncEngineClient.connect(addresses[0], **kwargs)
        kwargs.pop("model_hint", None)
        rest = await asyncio.gather(
            *(AsyncEngineClient.connect(a, tokenizer=first.tokenizer, **kwargs) for a in addresses[1:])
        )
        return cls([first, *rest])

    # ------------------------------------------------------------------ what the server reads

    @property
    def info(self):
        return self.clients[0].info

    @property
    def tokenizer(self):
        return self.clients[0].tokenizer

    @property
    def dead(self) -> bool:
        return all(c.dead for c in self.clients)

    @property
    def dead_reason(self) -> str | None:
        return "; ".join(f"engine {i}: {c.dead_reason}" for i, c in enumerate(self.clients)) if self.dead else None

    def require_task(self, task: str, api: str) -> None:
        self.clients[0].require_task(task, api)

    def validate_embed(self, prompt_ids: list[int]) -> None:
        self.clients[0].validate_embed(prompt_ids)

    # ------------------------------------------------------------------ routing

    def _keys(self, prompt_ids: list[int]) -> list[bytes]:
        """Hashes of the first 1..AFFINITY_BLOCKS full blocks, shortest first."""
        bs = self.info.block_size
        out, h = [], hashlib.blake2b(digest_size=16)
        for k in range(1, min(AFFINITY_BLOCKS, len(prompt_ids) // bs) + 1):
            h.update(msgspec.msgpack.encode(prompt_ids[(k - 1) * bs : k * bs]))
            out.append(h.copy().digest())
        return out

    def pick(self, prompt_ids: list[int], cost: int) -> int:
        """The engine for a request of `cost` tokens: its prefix's engine unless that one is loaded
        by more than one such request beyond the least loaded; else the least loaded live engine."""
        live = [i for i, c in enumerate(self.clients) if not c.dead and c.suspended is None]
        if not live:
            live = [i for i, c in enumerate(self.clients) if not c.dead] or [0]
        least = min(live, key=lambda i: (self.load[i], self.routed[i]))
        keys = self._keys(prompt_ids)
        choice = least
        for key in reversed(keys):  # the longest known prefix
            i = self._prefixes.get(key)
            if i is not None and i in live:
                if self.load[i] <= self.load[least] + cost:
                    choice = i
                break
        for key in keys:
            self._prefixes[key] = choice
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > AFFINITY_ENTRIES:
            self._prefixes.popitem(last=False)
        return choice

    async def _tracked(self, gen: AsyncGenerator[StreamOutput, None], i: int, cost: int):
        self.load[i] += cost
        self.routed[i] += 1
        try:
            async for out in gen:
                yield out
        finally:
            self.load[i] -= cost

    # ------------------------------------------------------------------ requests

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: Any = None,
        lora: Any = None,
    ) -> AsyncGenerator[StreamOutput, None]:
        import uuid

        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.generate_batch([prompt_ids], params, request_id or uuid.uuid4().hex, images, lora=lora)[0]

    def generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, request_id: str, images: Any = None, lora: Any = None
    ) -> list[AsyncGenerator[StreamOutput, None]]:
        """Every prompt is validated before any starts (as AsyncEngineClient does), then each goes to
        its own engine."""
        if self.dead:
            raise EngineDeadError(self.dead_reason or "engine is dead")
        ids = batch_ids(self.info, len(prompts), params.n, request_id)
        checked = [self.clients[0].validate(p, params) for p in prompts]
        out = []
        for rid, p, one in zip(ids, prompts, checked):
            cost = (len(p) + (one.max_tokens or 0)) * params.n
            i = self.pick(p, cost)
            gen = self.clients[i].generate_batch([p], params, rid, images if len(prompts) == 1 else None, lora=lora)[0]
            out.append(self._tracked(gen, i, cost))
        return out

    async def embed(
        self, prompt: str | list[int], *, request_id: str | None = None, pooling: PoolingParams | None = None
    ):
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        i = self.pick(prompt_ids, len(prompt_ids))
        self.load[i] += len(prompt_ids)
        try:
            return await self.clients[i].embed(prompt_ids, request_id=request_id, pooling=pooling)
        finally:
            self.load[i] -= len(prompt_ids)

    async def abort(self, request_id: str) -> None:
        for c in self.clients:
            await c.abort(request_id)

    async def start_profile(self, timeout: float = 180.0) -> ProfileStatus:
        return _merge(await asyncio.gather(*(c.start_profile(timeout) for c in self.clients)))

    async def stop_profile(self, timeout: float = 180.0) -> ProfileStatus:
        return _merge(await asyncio.gather(*(c.stop_profile(timeout) for c in self.clients)))

    # ------------------------------------------------------------------ lifecycle

    def for_scheduler(self, name: str) -> AsyncEngineClient:
        """The client of the engine the scheduler `name` drives (its restarts suspend only that one)."""
        return self.clients[engine_of(name)]

    def fail_all(self, reason: str, *, dead: bool = True) -> None:
        for c in self.clients:
            c.fail_all(reason, dead=dead)

    def close(self) -> None:
        for c in self.clients:
            c.close()


def _merge(statuses: list[ProfileStatus]) -> ProfileStatus:
    first = statuses[0]
    return msgspec.structs.replace(first, files=[f for s in statuses for f in s.files])
