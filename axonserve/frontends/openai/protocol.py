"""OpenAI API request/response models (vLLM-compatible, with vLLM's sampling extensions).

Requests are validated by pydantic for shape; value ranges are checked once, by
`SamplingParams.validate()`, so the rules and the error messages live in one place.
An unknown request field is a 400 that names it (silently ignoring a parameter the caller
relies on is worse than refusing it), except OpenAI fields that do not change the output.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

import msgspec
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_serializer

from axonserve.frontends.openai.tools import ChatTool, DeltaToolCall, NamedToolChoice, ToolCall
from axonserve.protocol.messages import ParamError, SamplingParams
from axonserve.structured_output.frontend import ResponseFormat, StructuredOutputsRequest


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")


def request_id(given: str | None, prefix: str, max_chars: int) -> str:
    """The request's id: the caller's `request_id` (bounded: it is echoed in every chunk and log
    line) or a fresh one."""
    if given is None:
        return random_id(prefix)
    if not 1 <= len(given) <= max_chars or not _REQUEST_ID.fullmatch(given):
        raise ParamError("request_id", f"request_id must be 1 to {max_chars} characters of A-Z a-z 0-9 . _ : -")
    return given


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# OpenAI request fields that do not change what is generated: accepted and ignored.
_HARMLESS = frozenset({"store", "metadata", "service_tier", "user", "parallel_tool_calls"})


class _Strict(_Request):
    """A request body whose unknown fields are refused (see `unknown_fields`)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def check_fields(self) -> None:
        unknown = sorted(set(self.model_extra or {}) - _HARMLESS)
        if unknown:
            raise ParamError(unknown[0], f"unsupported parameter(s): {', '.join(unknown)}")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    request_id: str | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    # structured outputs (structured_outputs.py): OpenAI's response_format, vLLM's extras
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def truncate(self, ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep only the last k prompt tokens."""
        k = self.truncate_prompt_tokens
        return ids[-k:] if k is not None and len(ids) > k else ids

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self.check_fields()
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise ParamError("logit_bias", "logit_bias keys must be token ids (integers as strings)") from None
        params = SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=bias,
            allowed_token_ids=self.allowed_token_ids,
            prompt_logprobs=self.prompt_logprobs,
        )
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported")
        params = self._params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:  # echoed prompt tokens carry logprobs too
            k = max(self.logprobs, params.prompt_logprobs or 0)
            params = msgspec.structs.replace(params, prompt_logprobs=k)
        return params

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ParamError("prompt", "prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # vLLM's: refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # template variables only (chat_template.py)
    tools: list[ChatTool] | None = None  # tool calling: tools.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: at most one call (tool_choice required)

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(max_tokens, logprobs)


# --------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: {token_id: {logprob, rank, decoded_token}}."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobList = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobList | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobList | None = None  # vLLM extension


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        """Stream deltas carry only what changed (`{"content": "..."}`), like OpenAI's."""
        out: dict[str, Any] = {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}
        if self.tool_calls is not None:
            out["tool_calls"] = [t.model_dump() for t in self.tool_calls]
        return out


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "axonserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a completion `prompt` or chat `messages` (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


# OpenAI error `type` by HTTP status (anything else: InternalServerError)
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "TimeoutError",
    409: "ConflictError",
    413: "RequestEntityTooLarge",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_response(status: int, message: str, type_: str | None = None, param: str | None = None) -> JSONResponse:
    """OpenAI error JSON with its status code; the type follows the status unless given."""
    body = ErrorResponse(
        error=ErrorInfo(
            message=message, type=type_ or ERROR_TYPES.get(status, "InternalServerError"), param=param, code=status
        )
    )
    return JSONResponse(body.model_dump(), status_code=status)
