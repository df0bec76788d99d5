"""Offline API in the vLLM style: `LLM(model).generate(prompts, SamplingParams(...))`, and
`LLM("all-MiniLM-L6-v2").embed(prompts)` for an embedding model.

The same engine as the server (scheduler + worker processes under a supervisor), driven
through the ZMQ client library from a private event loop on a background thread, so the
caller's code stays synchronous.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from tqdm import tqdm

from axonserve.config import EngineConfig, SpeculativeConfig
from axonserve.lora.request import LoRARequest
from axonserve.protocol.messages import LoraSpec, PoolingParams, SamplingParams, TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


class LLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **kwargs: Any):
        from axonserve.actors.supervisor import Supervisor
        from axonserve.frontends.client import AsyncEngineClient

        if config is None:
            from axonserve.neuron.model_source import resolve_model

            name = model or "SmolLM2-135M-Instruct"
            if "speculative_config" in kwargs:  # vLLM's keyword
                kwargs["speculative"] = SpeculativeConfig.parse(kwargs.pop("speculative_config"))
            kwargs.setdefault("dtype", "auto")  # vLLM's default: the checkpoint's precision
            config = EngineConfig(model=resolve_model(model), served_model_name=name, **kwargs)
        self.config = config
        # request ids never repeat within an engine: an id() of a freed object would, and a late
        # abort of a finished request (a stop string found after the scheduler ran past it) would
        # then hit the next call's request
        self._request_ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="axonserve-llm", daemon=True)
        self._thread.start()
        self._sup = Supervisor(config, frontend=False)
        self._sup.listeners.append(self._on_engine_event)
        self._closed = False
        try:
            self._call(self._sup.start())
            self._watch = asyncio.run_coroutine_threadsafe(self._sup.wait(), self._loop)
            engines = self._sup.addresses.engines or [self._sup.addresses.engine]
            if len(engines) > 1:  # data parallel
                from axonserve.frontends.dp_client import DataParallelClient

                self._client = self._call(DataParallelClient.connect(engines))
            else:
                self._client = self._call(AsyncEngineClient.connect(engines[0]))
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = self._client.tokenizer

    async def _on_engine_event(self, msg: Any) -> None:
        """A replaced scheduler: generations wait, then resume on the new one (supervisor.py)."""
        from axonserve.protocol.messages import ActorRestarted, ActorRestarting

        client, name = getattr(self, "_client", None), getattr(msg, "name", "")
        if client is None or not name.startswith("scheduler"):
            return
        if isinstance(msg, ActorRestarting):
            client.for_scheduler(name).suspend(f"{name} restarting: {msg.reason}")
        elif isinstance(msg, ActorRestarted):
            await client.for_scheduler(name).resume()

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt concurrently (continuous batching); outputs in input order.
        `lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("sampling_params must be one or one per prompt")
        loras = self._lora_specs(lora_request, len(prompts))
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm)
        try:
            return self._call(self._generate_all(list(prompts), plist, bar, loras))
        finally:
            bar.close()

    def _lora_specs(self, lora_request: Any, n: int) -> list[LoraSpec | None]:
        """One LoraSpec (or None) per prompt, each adapter validated once (axonserve/lora/adapter.py)
        before any prompt is sent."""
        if lora_request is None:
            return [None] * n
        reqs = [lora_request] * n if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(reqs) != n:
            raise ValueError("lora_request must be one or one per prompt")
        if any(r is not None for r in reqs) and not self.config.enable_lora:
            raise ValueError("lora_request needs LLM(..., enable_lora=True)")
        from axonserve.lora.adapter import read_adapter_config
        from axonserve.neuron.config import ModelConfig

        model = ModelConfig.from_dir(self.config.model)
        checked: dict[tuple[int, str], str] = {}
        specs: list[LoraSpec | None] = []
        for r in reqs:
            if r is None:
                specs.append(None)
                continue
            if not isinstance(r, LoRARequest):
                raise TypeError(f"lora_request items must be LoRARequest or None, not {type(r).__name__}")
            spec = r.spec()
            if checked.setdefault((spec.lora_id, spec.path), spec.name) != spec.name:
                raise ValueError(f"lora_int_id {spec.lora_id} names two adapters")
            if len(checked) > len({k[0] for k in checked}):
                raise ValueError(f"lora_int_id {spec.lora_id} is used with two paths")
            read_adapter_config(spec.path, self.config.max_lora_rank, model)
            specs.append(spec)
        return specs

    async def _generate_all(
        self, prompts: list, plist: list[SamplingParams], bar: tqdm, loras: list[LoraSpec | None]
    ) -> list[RequestOutput]:
        async def one(i: int, prompt: Any, p: SamplingParams, lora: LoraSpec | None) -> RequestOutput:
            ids = self._client.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            res = RequestOutput(str(i), prompt if isinstance(prompt, str) else None, ids)
            choices: dict[int, CompletionOutput] = {}
            rid = f"offline-{next(self._request_ids)}"
            async for out in self._client.generate(ids, p, request_id=rid, lora=lora):
                c = choices.setdefault(out.index, CompletionOutput(out.index, "", [], None))
                c.text = out.output_text
                c.token_ids.extend(out.token_ids)
                if out.logprobs:
                    c.logprobs = (c.logprobs or []) + list(out.logprobs)
                if out.finish_reason:
                    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
                    if out.finish_reason == "error":
                        raise RuntimeError(out.error or "generation failed")
            res.outputs = [choices[k] for k in sorted(choices)]
            bar.update(1)
            return res

        return list(
            await asyncio.gather(*(one(i, pr, p, lo) for i, (pr, p, lo) in enumerate(zip(prompts, plist, loras))))
        )

    def embed(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """One pooled vector per prompt (embed-task models), batched by the engine; input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        bar = tqdm(total=len(prompts), desc="embed", disable=not use_tqdm)
        try:
            return self._call(self._embed_all(list(prompts), pooling_params, bar))
        finally:
            bar.close()

    async def _embed_all(self, prompts: list, pooling: PoolingParams | None, bar: tqdm) -> list[EmbeddingRequestOutput]:
        enc = self._client.tokenizer.encode
        all_ids = [enc(p) if isinstance(p, str) else list(p) for p in prompts]
        for ids in all_ids:  # every input is checked before any is sent
            self._client.validate_embed(ids)

        async def one(i: int, prompt: Any, ids: list[int]) -> EmbeddingRequestOutput:
            out = await self._client.embed(ids, request_id=f"offline-embed-{next(self._request_ids)}", pooling=pooling)
            bar.update(1)
            return EmbeddingRequestOutput(
                str(i), prompt if isinstance(prompt, str) else None, ids, EmbeddingOutput(out.embedding.tolist())
            )

        return list(await asyncio.gather(*(one(i, p, ids) for i, (p, ids) in enumerate(zip(prompts, all_ids)))))

    def shutdown(self) -> None:
        """Stop the engine processes; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.cancel()
        client = getattr(self, "_client", None)
        if client is not None:
            self._loop.call_soon_threadsafe(client.close)
        try:
            self._call(self._sup.stop("LLM.shutdown"), timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
