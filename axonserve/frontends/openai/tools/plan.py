"""What a request's tools and tool_choice mean: template variables, a constraint, a parser."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from axonserve.frontends.openai.tools.formatter import ToolCallFormatter
from axonserve.frontends.openai.tools.models import ChatTool, NamedToolChoice
from axonserve.frontends.openai.tools.parsers import JsonArrayToolParser, NamedToolParser, ToolParser, make_parser
from axonserve.protocol.messages import ParamError, StructuredOutputsParams
from axonserve.structured_output.grammar import json_schema


@dataclass
class ToolPlan:
    """What a chat request's tools mean for the prompt, the decoding and the output."""

    tools: list[dict[str, Any]]  # for the chat template
    parser: ToolParser | None  # None: plain content (tool_choice none)
    structured: StructuredOutputsParams | None = None  # required / named: constrained decoding

    def template_kwargs(self) -> dict[str, Any]:
        return {"tools": self.tools} if self.tools else {}

    def formatter(self) -> ToolCallFormatter | None:
        return ToolCallFormatter(self.parser) if self.parser is not None else None


def plan_tools(
    tools: list[ChatTool] | None,
    tool_choice: str | NamedToolChoice | None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str = "",
    parallel_tool_calls: bool = True,
) -> ToolPlan | None:
    """Validate tools + tool_choice against the server's flags (ParamError -> 400).
    parallel_tool_calls=False limits tool_choice "required" to one call."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise ParamError("tool_choice", "when using `tool_choice`, `tools` must be set")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ParamError("tools", "tool function names must be unique")
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(rendered, None)
    if choice == "auto":
        if not (enable_auto_tool_choice and tool_call_parser):
            raise ParamError(
                "tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            )
        return ToolPlan(rendered, make_parser(tool_call_parser))
    if choice == "required":
        schema = required_schema(tools, max_calls=None if parallel_tool_calls else 1)
        return ToolPlan(rendered, JsonArrayToolParser(), json_schema(schema))
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise ParamError(
                "tool_choice", f"tool_choice names function {choice.function.name!r}, which is not in `tools`"
            )
        return ToolPlan(rendered, NamedToolParser(tool.function.name), json_schema(_parameters(tool)))
    raise ParamError("tool_choice", f"unsupported tool_choice {choice!r}")


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return copy.deepcopy(tool.function.parameters) or {"type": "object", "properties": {}}


def required_schema(tools: list[ChatTool], max_calls: int | None = None) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": `[{"name": <tool>, "parameters": <its schema>}, ...]`,
    each tool's `$defs` hoisted to the top so their `#/$defs/...` references still resolve."""
    defs: dict[str, Any] = {}
    branches = []
    for t in tools:
        params = _parameters(t)
        for k, v in params.pop("$defs", {}).items():
            if k in defs and defs[k] != v:
                raise ParamError("tools", f"tools define `$defs/{k}` differently")
            defs[k] = v
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant `tool_calls` arguments arrive as JSON text; chat templates expect objects
    (they render them with `tojson`), as vLLM passes them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise ParamError("messages", f"tool call arguments are not valid JSON: {args!r}") from None
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
