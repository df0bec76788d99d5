"""`POST /v1/embeddings` (OpenAI's Embeddings API, vLLM's extensions) for embed-task models.

Each input becomes one engine request (the scheduler batches them into one encoder step);
vectors come back as float lists or, with `encoding_format=base64`, as little-endian float32
bytes in base64 (what the official client asks for by default). Every input is checked before
any is sent: an empty input, a token id outside the vocabulary, or more tokens than the
model's positions is a 400 that says the numbers.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Literal

import numpy as np
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from axonserve.frontends.client import AsyncEngineClient, EmbeddingOutput, RequestError
from axonserve.frontends.openai.protocol import error_response
from axonserve.protocol.messages import ParamError, PoolingParams

_LONG_INPUT_CHARS = 4096  # tokenize more text than this off the event loop


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a parameter we would silently ignore is a 400

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM extensions
    normalize: bool | None = None  # None: the model's sentence-transformers default
    request_id: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """One entry per vector asked for: a text or a token-id list."""
        x = self.input
        if isinstance(x, str):
            items: list[str | list[int]] = [x]
        elif x and all(isinstance(t, int) for t in x):
            items = [list(x)]  # type: ignore[arg-type]
        else:
            items = list(x)  # type: ignore[arg-type]
        if not items or any(len(i) == 0 for i in items):
            raise ParamError(
                "input", "input must be a non-empty string, token list, or list of them, without empty entries"
            )
        return items


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode_vector(vec: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec.tolist()


async def create_embeddings(client: AsyncEngineClient, body: EmbeddingRequest, model_name: str, rid: str) -> Response:
    """Validate every input, embed them all concurrently, answer in input order."""
    client.require_task("embed", "Embeddings API")
    if body.dimensions is not None:
        raise ParamError(
            "dimensions",
            f"The model `{model_name}` does not support matryoshka "
            "representation: `dimensions` cannot change its output size",
        )
    items = body.inputs()
    if len(items) > client.info.limits.max_fanout:
        raise ParamError("input", f"at most {client.info.limits.max_fanout} inputs per request")
    chars = sum(len(i) for i in items if isinstance(i, str))
    enc = client.tokenizer.encode

    def tokenize() -> list[list[int]]:
        return [enc(i) if isinstance(i, str) else i for i in items]

    ids = await asyncio.to_thread(tokenize) if chars > _LONG_INPUT_CHARS else tokenize()
    for x in ids:
        client.validate_embed(x)
    pooling = PoolingParams(normalize=body.normalize)
    try:
        outs: list[EmbeddingOutput] = await asyncio.gather(
            *(client.embed(x, request_id=f"{rid}-{i}", pooling=pooling) for i, x in enumerate(ids))
        )
    except RequestError as e:
        return error_response(e.status, str(e))
    data = [
        EmbeddingData(index=i, embedding=encode_vector(o.embedding.numpy(), body.encoding_format))
        for i, o in enumerate(outs)
    ]
    n = sum(o.num_prompt_tokens for o in outs)
    resp = EmbeddingResponse(
        id=rid,
        created=int(time.time()),
        model=model_name,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=n, total_tokens=n),
    )
    return JSONResponse(resp.model_dump())
