"""LoRA adapters on the HTTP edge, as vLLM serves them.

A request's `model` names either the base model or a registered adapter (`lora/registry.py`);
an adapter's `LoraSpec` travels with each of the request's generations, so an adapter unloaded
while a request runs does not affect that request. `/v1/models` lists every adapter with its
`parent` and `root`. `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's bodies
and plain-text answers) exist only with runtime updating on (`--allow-runtime-lora-updating` or
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`); elsewhere the paths are 404, as in vLLM, where they are
not mounted. They sit behind the API key like every non-probe route (middleware.py). A loaded
directory is hostile input: `read_adapter_config` reads it on a small pool of its own, never on the
event loop, under a time limit.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from axonserve.config import EngineConfig
from axonserve.frontends.openai.errors import ModelNotFound
from axonserve.frontends.openai.protocol import ModelCard, _Strict, error_response
from axonserve.lora.adapter import LoraError, read_adapter_config
from axonserve.lora.registry import LoraRegistry, base_model_config, check_path, parse_lora_module
from axonserve.protocol.messages import LoraSpec, ParamError

log = structlog.get_logger(__name__)

# validating an adapter reads two small, bounded things (its JSON config, its safetensors header);
# a path on a stuck filesystem must still not hold the caller: past this the load is refused (400).
# The pool bounds the threads such loads can tie up, apart from the tokenizer's and templates'
VALIDATE_TIMEOUT_S = 10.0
_VALIDATE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lora-validate")


class LoadLoraAdapterRequest(_Strict):
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoraAdapterRequest(_Strict):
    lora_name: str | None = None
    lora_int_id: int | None = None  # vLLM's body has it; the name decides


class LoraModels:
    """The served names: the base model's and the adapters' (an empty registry without --enable-lora)."""

    def __init__(self, config: EngineConfig, base_name: str, base_names: set[str]):
        self.config = config
        self.base_names = base_names
        self.registry = LoraRegistry(base_names, base_name)
        for text in config.lora_modules:  # validated by the CLI before start-up
            mod = parse_lora_module(text)
            self.registry.add(mod.name, mod.path, mod.base_model_name)

    def resolve(self, name: str | None, api: str | None = None) -> LoraSpec | None:
        """The adapter `model` names, None for the base model; ModelNotFound (404) for anything else.
        `api`: a route that cannot run adapters (ParamError when one is asked for)."""
        if name is None or name in self.base_names:
            return None
        spec = self.registry.get(name)
        if spec is None:
            raise ModelNotFound(f"The model `{name}` does not exist.")
        if api is not None:
            raise ParamError("model", f"`{name}` is a LoRA adapter: the {api} serves only the base model")
        return spec

    def cards(self) -> list[ModelCard]:
        return [ModelCard(id=e.spec.name, root=e.spec.path, parent=e.parent) for e in self.registry.entries()]

    async def validate(self, path: str) -> None:
        """read_adapter_config against the base model, on the pool, within VALIDATE_TIMEOUT_S."""

        def work() -> None:
            read_adapter_config(path, self.config.max_lora_rank, _base_model(self.config.model))

        fut = asyncio.get_running_loop().run_in_executor(_VALIDATE_POOL, work)
        try:
            await asyncio.wait_for(fut, VALIDATE_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            raise LoraError(f"reading the adapter took longer than {VALIDATE_TIMEOUT_S:g}s") from None

    async def load(self, body: LoadLoraAdapterRequest) -> Response:
        body.check_fields()
        if not body.lora_name or not body.lora_path:
            return error_response(400, "Both 'lora_name' and 'lora_path' must be provided.", "BadRequestError")
        if not self.config.enable_lora:
            return error_response(400, "LoRA is not enabled: start the server with --enable-lora", "BadRequestError")
        name = self.registry.check_new(body.lora_name)  # before reading anything
        path = check_path(body.lora_path)
        await self.validate(path)
        self.registry.add(name, path)  # checks the name again: a concurrent load may have taken it
        log.info("lora_loaded", name=name, path=path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, body: UnloadLoraAdapterRequest) -> Response:
        body.check_fields()
        if not body.lora_name:
            return error_response(400, "'lora_name' must be provided.", "BadRequestError", "lora_name")
        spec = self.registry.remove(body.lora_name)
        if spec is None:
            return error_response(
                404, f"The lora adapter '{body.lora_name[:128]}' cannot be found.", "NotFoundError", "lora_name"
            )
        log.info("lora_unloaded", name=spec.name, lora_id=spec.lora_id)
        return PlainTextResponse(f"Success: LoRA adapter '{spec.name}' removed successfully.")


@functools.lru_cache(maxsize=4)
def _base_model(model_dir: str) -> Any:
    """The base model's shapes, read once (on the validation pool)."""
    return base_model_config(model_dir)


def mount_lora_routes(app: FastAPI, models: LoraModels) -> None:
    """The runtime-updating routes, only when the config allows them (else the paths stay 404)."""
    if not models.config.allow_runtime_lora_updating:
        return
    log.warning("lora_runtime_updating_enabled", note="clients may load adapters from this machine's files")
    app.post("/v1/load_lora_adapter", response_model=None)(models.load)
    app.post("/v1/unload_lora_adapter", response_model=None)(models.unload)


def lora_kwargs(spec: LoraSpec | None) -> dict[str, LoraSpec]:
    """`generate_batch`'s keyword for a request's adapter: none at all for the base model."""
    return {} if spec is None else {"lora": spec}
