"""Structured output (constrained decoding): request specs and their llguidance grammars.

Design, end to end:

- A request carries `SamplingParams.structured_outputs`, a `StructuredOutputsParams(kind, spec)`:
  "json" (a JSON schema as JSON text), "regex", "choice" (a JSON list of strings) or "grammar"
  (Lark or GBNF). The OpenAI frontend builds it from `response_format`, vLLM's `guided_*` /
  `structured_outputs` extras and `tool_choice` (structured_output/frontend.py,
  frontends/openai/tools.py).
- `check()` compiles the spec without a tokenizer (llguidance, cheap, cached per spec). It runs
  in `SamplingParams.validate()`, so the frontend (HTTP and offline) turns a bad schema into a
  400 before sending and the engine never holds a grammar that does not compile. The scheduler
  validates every AddRequest too, which then costs a cache hit.
- Worker rank 0 holds the grammar state (structured_output/worker.py): an llguidance tokenizer built
  once, lazily, over the model's vocabulary width and EOS ids (a padded vocabulary gets its
  extra ids masked out; the model's EOS is what the scheduler stops on), compiled matchers
  cached per spec and copied per request, a token bitmask filled before sampling and applied to
  the logits first (so logprobs, like vLLM's, describe the constrained distribution), and the
  sampled token consumed after rank 0's ids are broadcast. Once the grammar is complete the
  mask admits only EOS. Preemption re-sends a request as new with its output tokens: the
  matcher is rebuilt and replays them. Other tensor-parallel ranks skip all of it: their
  sampled ids are replaced by rank 0's.
- JSON is compact by default (no free whitespace between tokens, `any_whitespace=False`): the
  output is equally valid JSON, and small models otherwise spend max_tokens on whitespace.

llguidance (Rust wheel, no Python dependencies) was chosen over xgrammar, which pulls triton
and a second copy of the tensor stack into a CPU install.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from axonserve.protocol.messages import ParamError, StructuredOutputsParams

KINDS = ("json", "regex", "choice", "grammar")


def json_schema(schema: dict[str, Any] | bool, any_whitespace: bool = False) -> StructuredOutputsParams:
    """A spec for output matching a JSON schema (`{"type": "object"}`: any JSON object)."""
    return StructuredOutputsParams(kind="json", spec=json.dumps(schema), any_whitespace=any_whitespace)


def check(so: StructuredOutputsParams) -> None:
    """Raise ParamError (with the llguidance message) unless the spec compiles."""
    compile_grammar(so.kind, so.spec, so.any_whitespace)


@lru_cache(maxsize=512)
def compile_grammar(kind: str, spec: str, any_whitespace: bool = False) -> str:
    """The llguidance grammar (serialized) for a spec; ParamError when it is invalid."""
    from llguidance import LLMatcher

    param = "structured_outputs"
    if kind not in KINDS:
        raise ParamError(param, f"structured output kind {kind!r} is not one of {list(KINDS)}")
    if kind == "json":
        try:
            schema = json.loads(spec)
        except ValueError as e:
            raise ParamError(param, f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ParamError(param, "a JSON schema must be an object or a boolean")
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": any_whitespace})
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(spec)
    elif kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError:
            choices = None
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise ParamError(param, "choice must be a non-empty list of non-empty strings")
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    else:
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            grammar = LLMatcher.grammar_from_lark(any_to_lark(spec))
        except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions
            raise ParamError(param, f"invalid grammar: {e}") from None
    err = LLMatcher.validate_grammar(grammar)
    if err:
        what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[kind]
        raise ParamError(param, f"invalid {what}: {err.strip()}")
    return grammar
