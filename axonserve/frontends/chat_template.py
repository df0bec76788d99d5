"""Chat templates as hostile input: who may supply one, which variables a request may set,
and a time and size bound on every render.

A chat template is Jinja code. The model's own template is the operator's choice; one sent
with a request is the caller's code, so it is refused (HTTP 400 naming it) unless the server
runs with `--trust-request-chat-template` (vLLM's flag). `chat_template_kwargs` are template
variables only: a key that would override an `apply_chat_template` argument (`chat_template`,
`tools`, `tokenize`, ...) is refused the same way.

Every render runs on a small thread pool, never on the event loop, under a deadline. Python
cannot stop a thread from outside, so the deadline is enforced from inside: transformers renders
in a Jinja sandbox, and the sandbox's hooks (every call, attribute and item lookup, and the join
of the output) check the rendering thread's deadline and output size and raise past them. Any
template that loops over messages or writes output reaches a hook within microseconds; the
event loop also stops waiting at the deadline (HTTP 400) whatever the thread does.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import jinja2
import structlog
from jinja2.sandbox import SandboxedEnvironment

from axonserve.protocol.messages import ParamError

log = structlog.get_logger(__name__)
T = TypeVar("T")

# apply_chat_template's own arguments (and the names it passes to the template itself): a request's
# chat_template_kwargs may not set these
_RESERVED = frozenset(
    {
        "messages",
        "conversation",
        "chat_template",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
        "processor_kwargs",
        "kwargs",
        "self",
    }
)


@functools.cache
def _reserved() -> frozenset[str]:
    """Keys a request's chat_template_kwargs may not set: ours plus transformers' current
    apply_chat_template arguments (a new one is reserved without a change here); read once."""
    from transformers import PreTrainedTokenizerBase

    return _RESERVED | frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)


class TemplateTimeout(jinja2.TemplateError):
    """The render passed its deadline or its output bound."""


def request_template(
    chat_template: str | None, kwargs: dict[str, Any] | None, trust: bool
) -> tuple[str | None, dict[str, Any]]:
    """(template override, template variables) from a request's `chat_template` field and
    `chat_template_kwargs`; ParamError (HTTP 400) for a template without `trust` or a reserved key."""
    variables = dict(kwargs or {})
    override = variables.pop("chat_template", None)
    param = "chat_template_kwargs.chat_template" if override is not None else "chat_template"
    if chat_template is not None:
        override, param = chat_template, "chat_template"
    if override is not None:
        if not trust:
            raise ParamError(
                param,
                "a chat template in the request is refused: the server uses the model's "
                "template (start it with --trust-request-chat-template to allow request templates)",
            )
        if not isinstance(override, str):
            raise ParamError(param, "chat_template must be a string")
    reserved = _reserved()
    for key in variables:
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            raise ParamError(
                f"chat_template_kwargs.{key}", "chat_template_kwargs keys must be identifiers not starting with '_'"
            )
        if key in reserved:
            raise ParamError(
                f"chat_template_kwargs.{key}",
                f"chat_template_kwargs may only set template variables; {key!r} is an apply_chat_template argument",
            )
    return override, variables


# ----------------------------------------------------------------------------- the guard

_state = threading.local()  # per rendering thread: (deadline, max output chars)


def _check() -> None:
    limit = getattr(_state, "deadline", None)
    if limit is not None and time.monotonic() > limit:
        raise TemplateTimeout("chat template rendering took too long")


def _hooked(name: str) -> Callable[..., Any]:
    original = getattr(SandboxedEnvironment, name)

    def hook(self: SandboxedEnvironment, *args: Any, **kwargs: Any) -> Any:
        _check()
        return original(self, *args, **kwargs)

    hook.__name__ = name
    return hook


def _bounded_concat(chunks: Iterable[str]) -> str:
    """Environment.concat ("".join) for sandboxed templates: checks the deadline and the output
    size as the chunks come."""
    max_chars = getattr(_state, "max_chars", None)
    if max_chars is None:
        return "".join(chunks)
    out: list[str] = []
    size = 0
    for i, chunk in enumerate(chunks):
        size += len(chunk)
        if size > max_chars:
            raise TemplateTimeout(f"chat template output is longer than {max_chars} characters")
        if not i & 255:
            _check()
        out.append(chunk)
    return "".join(out)


def _install() -> None:
    if getattr(SandboxedEnvironment, "_axonserve_guard", False):
        return
    for name in ("call", "getattr", "getitem", "call_binop", "call_unop"):
        setattr(SandboxedEnvironment, name, _hooked(name))
    SandboxedEnvironment.concat = staticmethod(_bounded_concat)  # type: ignore[assignment]
    SandboxedEnvironment._axonserve_guard = True  # type: ignore[attr-defined]


_install()

_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="chat-template")


def _guarded(fn: Callable[[], T], deadline: float, max_chars: int) -> T:
    _state.deadline, _state.max_chars = deadline, max_chars
    try:
        return fn()
    finally:
        _state.deadline = _state.max_chars = None


async def render_bounded(fn: Callable[[], T], timeout_s: float, max_chars: int) -> T:
    """Run `fn` (a template render, plus the tokenization after it) on the template pool with a
    deadline; ParamError("messages") past it. The thread stops at its next sandbox hook."""
    deadline = time.monotonic() + timeout_s
    fut = asyncio.get_running_loop().run_in_executor(_pool, _guarded, fn, deadline, max_chars)
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout_s + 0.5)
    except (TemplateTimeout, asyncio.TimeoutError, TimeoutError) as e:
        log.warning("chat_template.refused", reason=str(e) or "timeout", timeout_s=timeout_s)
        raise ParamError(
            "messages",
            f"rendering the chat template failed: {e or 'it took too long'} "
            f"(limit {timeout_s:g} s, {max_chars} characters)",
        ) from None
