"""Chat tool calling: request/response models, tool_choice planning, output parsers.

tool_choice (vLLM semantics):
- "none": tools reach the chat template, the output is plain content.
- "auto" (the default when tools are given): needs the server flags `--enable-auto-tool-choice
  --tool-call-parser {hermes,llama3_json}` (else 400); the model writes calls in its own format
  and the parser finds them: Hermes `<tool_call>{"name", "arguments"}</tool_call>` blocks, or
  Llama-3.1 `{"name", "parameters"}` objects (optionally after `<|python_tag|>`, `;`-separated).
- "required" / a named function: constrained decoding, like vLLM. Named: the output is the
  function's arguments, constrained to its parameters schema. Required: a JSON array of
  `{"name", "parameters"}` with one schema branch per tool, at least one item.

Every parser is an incremental scanner fed the text piece by piece (a whole output is one
piece), so one code path serves whole outputs and streams, and a stream's delta costs O(delta)
scanning however long the output already is: a call's `arguments` is the raw JSON text the model
wrote for it (valid JSON once complete), streamed as it grows, so reassembled stream deltas
equal the non-streaming message.
A stream holds back text that may still turn into a call (a partial `<tool_call>` tag). When the
finished output holds no well-formed call, the whole text is plain content.
"""

from axonserve.frontends.openai.tools.formatter import ToolCallFormatter
from axonserve.frontends.openai.tools.models import (
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    FunctionDefinition,
    NamedToolChoice,
    ToolCall,
    call_id,
)
from axonserve.frontends.openai.tools.parsers import (
    PARSERS,
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    ToolParser,
    make_parser,
)
from axonserve.frontends.openai.tools.plan import ToolPlan, plan_tools, required_schema, template_messages

__all__ = [
    "PARSERS",
    "ChatTool",
    "DeltaFunctionCall",
    "DeltaToolCall",
    "FunctionCall",
    "FunctionDefinition",
    "HermesToolParser",
    "JsonArrayToolParser",
    "Llama3JsonToolParser",
    "NamedToolChoice",
    "NamedToolParser",
    "ToolCall",
    "ToolCallFormatter",
    "ToolParser",
    "ToolPlan",
    "call_id",
    "make_parser",
    "plan_tools",
    "required_schema",
    "template_messages",
]
