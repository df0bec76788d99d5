"""OpenAI `response_format` and vLLM's structured-output extras -> `StructuredOutputsParams`.

Accepted (one kind per request): `response_format` {"type": "json_object"} or {"type":
"json_schema", "json_schema": {"name", "schema", "strict"}} (always enforced, strict or not),
vLLM's `structured_outputs` {json | regex | choice | grammar | json_object, disable_any_whitespace}
and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. The spec is
compiled here once (cached), so a bad schema is a 400 before anything reaches the engine.
Grammar semantics and the whole flow: structured_output/grammar.py.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from axonserve.protocol.messages import ParamError, SamplingParams, StructuredOutputsParams
from axonserve.structured_output.grammar import check, json_schema


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: str | dict[str, Any] | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


def _schema(value: str | dict[str, Any] | bool, param: str, any_whitespace: bool) -> StructuredOutputsParams:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ParamError(param, f"{param}: the JSON schema is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise ParamError(param, f"{param}: a JSON schema must be an object or a boolean")
    return json_schema(value, any_whitespace)


def requested_spec(body: Any, tokenizer: Any, max_bytes: int | None = None) -> StructuredOutputsParams | None:
    """The one structured-output spec a completion/chat request asks for, compiled (ParamError
    if several or if it does not compile)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    so: StructuredOutputsRequest | None = getattr(body, "structured_outputs", None)
    # vLLM: JSON may contain whitespace only when disable_any_whitespace is explicitly false
    ws = so is not None and so.disable_any_whitespace is False
    rf: ResponseFormat | None = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", json_schema({"type": "object"}, ws)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ParamError("response_format", "response_format json_schema needs `json_schema.schema`")
        found.append(("response_format", _schema(rf.json_schema.schema_, "response_format", ws)))
    if body.guided_json is not None:
        found.append(("guided_json", _schema(body.guided_json, "guided_json", ws)))
    if body.guided_regex is not None:
        found.append(("guided_regex", StructuredOutputsParams(kind="regex", spec=body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", StructuredOutputsParams(kind="choice", spec=json.dumps(body.guided_choice))))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutputsParams(kind="grammar", spec=body.guided_grammar)))
    if so is not None:
        kinds = [
            (k, v)
            for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar))
            if v is not None
        ]
        if so.json_object:
            kinds.append(("json_object", True))
        if len(kinds) != 1:
            raise ParamError(
                "structured_outputs",
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
            )
        kind, value = kinds[0]
        if kind == "json":
            spec = _schema(value, "structured_outputs", ws)  # type: ignore[arg-type]
        elif kind == "json_object":
            spec = json_schema({"type": "object"}, ws)
        else:
            spec = StructuredOutputsParams(kind=kind, spec=value if isinstance(value, str) else json.dumps(value))
        found.append(("structured_outputs", spec))
    if len(found) > 1:
        raise ParamError(
            found[1][0],
            f"only one structured output constraint per request; got {', '.join(name for name, _ in found)}",
        )
    return checked(found[0][1], tokenizer, found[0][0], max_bytes) if found else None


def checked(
    spec: StructuredOutputsParams, tokenizer: Any, param: str, max_bytes: int | None = None
) -> StructuredOutputsParams:
    """Compile the spec now (ParamError naming `param` -> 400), unless it is over `max_bytes`
    (refused before compiling); llguidance reads fast (Rust) tokenizers only."""
    if max_bytes is not None and len(spec.spec.encode()) > max_bytes:
        raise ParamError(
            param, f"{param}: the constraint (schema, regex, grammar or choices) is larger than {max_bytes} bytes"
        )
    if not getattr(tokenizer.hf, "is_fast", False):
        raise ParamError(param, "structured output needs a fast (tokenizers) tokenizer")
    try:
        check(spec)
    except ParamError as e:
        raise ParamError(param, f"{param}: {e}") from None
    return spec


def with_structured_outputs(
    params: SamplingParams,
    body: Any,
    tokenizer: Any,
    tool_spec: StructuredOutputsParams | None = None,
    max_bytes: int | None = None,
) -> SamplingParams:
    """`params` carrying the request's constraint: its own (response_format, guided_*,
    structured_outputs) or the one tool_choice required/named implies (frontends/openai/tools.py); not both.
    Compiling is CPU work: the server calls this off the event loop."""
    spec = requested_spec(body, tokenizer, max_bytes)
    if tool_spec is not None:
        if spec is not None:
            raise ParamError(
                "tool_choice",
                "tool_choice required or named already constrains the output; "
                "it cannot be combined with response_format or guided decoding",
            )
        spec = checked(tool_spec, tokenizer, "tools", max_bytes)
    return params if spec is None else msgspec.structs.replace(params, structured_outputs=spec)
