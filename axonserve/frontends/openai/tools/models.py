"""The OpenAI tool-calling shapes: request tools and choices, response calls and deltas."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # strict, ... reach the template

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: _FunctionName


class FunctionCall(BaseModel):
    name: str
    arguments: str


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCall(BaseModel):
    id: str = Field(default_factory=call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _only_set(self) -> dict[str, str]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class DeltaToolCall(BaseModel):
    """A stream fragment of call `index`: its first carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type=self.type or "function")
        out["function"] = self.function.model_dump()
        return out
