"""The frontend's tokenizer: HF tokenizer loading, prompt encoding and chat templates.

The engine only ever sees token ids; every text <-> token conversion happens here, in the
frontend process, so tokenization cost scales with the number of frontends, not the engine.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from axonserve.protocol.messages import ParamError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_hf_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    """Load from a model directory; a directory holding only a GGUF file works too."""
    d = Path(model_dir)
    if d.is_dir() and not any((d / f).exists() for f in _TOKENIZER_FILES):
        ggufs = sorted(d.glob("*.gguf"))
        if ggufs:
            return AutoTokenizer.from_pretrained(str(d), gguf_file=ggufs[0].name)
    return AutoTokenizer.from_pretrained(model_dir)


class Tokenizer:
    """Thin, typed wrapper over an HF tokenizer with the calls the frontend needs."""

    def __init__(self, hf: PreTrainedTokenizerBase):
        self.hf = hf
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self._rust_decode = _rust_decode(hf)

    @classmethod
    def load(cls, model_dir: str) -> "Tokenizer":
        return cls(load_hf_tokenizer(model_dir))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.hf.all_special_ids)

    def encode(self, text: str) -> list[int]:
        """Encode a raw completion prompt (adds BOS etc. as the model expects)."""
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def _token_text(self, token_id: int) -> str:
        """One token as text (logprob listings); partial UTF-8 shows as U+FFFD, like vLLM."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Apply the model's chat template. ValueError if the model has none."""
        if not self.has_chat_template:
            raise ParamError(
                "messages",
                "this model has no chat template; use /v1/completions with a raw prompt",
            )
        return self.hf.apply_chat_template(
            [_flatten_content(m) for m in messages],
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=False,
            **template_kwargs,
        )

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Render then encode; the template already wrote BOS/role tokens, so add none."""
        text = self.render_chat(messages, **kwargs)
        return list(self.hf.encode(text, add_special_tokens=False))


def _rust_decode(hf: PreTrainedTokenizerBase) -> Any:
    """The `tokenizers` decode that `hf.decode` ends in, when calling it directly returns the same
    text: a fast tokenizer whose class keeps transformers' own decode and does no space cleanup.
    The incremental detokenizer decodes twice per generated token, and HF's Python wrapper around
    this call costs about three times the call itself (issue 33). None: use `hf.decode`."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase as Base

        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend as Fast
        except ImportError:  # transformers 4
            from transformers import PreTrainedTokenizerFast as Fast
    except ImportError:
        return None
    cls, backend = type(hf), getattr(hf, "_tokenizer", None)
    if backend is None or getattr(hf, "clean_up_tokenization_spaces", True):
        return None
    if getattr(cls, "decode", None) is not Base.decode or getattr(cls, "_decode", None) is not Fast._decode:
        return None
    return backend.decode


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts ([{type: text, text}]) -> one string, for text-only templates."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise ParamError("messages", f"content part type {part.get('type')!r} is not supported")
            texts.append(part.get("text", ""))
        message = {**message, "content": "".join(texts)}
    elif content is None:
        message = {**message, "content": ""}
    return message
