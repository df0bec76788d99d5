"""Structured output (constrained decoding), every layer side by side.

- `frontend`: OpenAI `response_format` and vLLM's `structured_outputs` / `guided_*` request
  fields -> `StructuredOutputsParams` (HTTP frontend).
- `grammar`: llguidance compile and check of a spec, no tokenizer (run by
  `SamplingParams.validate()` in the frontend and the scheduler; the design notes are here).
- `worker`: per-request matchers and token bitmasks on the logits (worker rank 0).

The engine (scheduler) holds no grammar state: it only validates.
"""
