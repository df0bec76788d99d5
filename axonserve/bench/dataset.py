"""Synthetic prompts of exact lengths, reproducible from a seed.

Token-id prompts fix the input length exactly (our server and vLLM accept `prompt: [ids]` on
/v1/completions). Text prompts are built from whole-word vocabulary tokens so that they
re-tokenize to the same ids (exact length with a tokenizer, ~length without one), for servers
that only take strings (llama-cpp-python). Chat prompts are real instructions (the EAGLE
trainer's held-out set) through the model's chat template: lengths vary, but they are what
speculative decoding must be measured on (random words make any draft model look useless).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

PromptKind = Literal["tokens", "text", "chat"]

_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line"
).split()


@dataclass
class RequestSpec:
    prompt: str | list[int]
    prompt_len: int
    max_tokens: int


def load_tokenizer(path: str | None) -> Any:
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _id_pool(tokenizer: Any, vocab_size: int, kind: PromptKind) -> np.ndarray:
    """Ids to sample from: no special tokens; for text, only ' word' tokens that round-trip."""
    if tokenizer is None:
        return np.arange(min(100, vocab_size - 1), vocab_size)
    special = set(tokenizer.all_special_ids)
    n = len(tokenizer)
    if kind == "tokens":
        return np.array([i for i in range(n) if i not in special])
    pool = []
    for tok, i in tokenizer.get_vocab().items():
        if i in special or not tok.startswith("Ġ") or not tok[1:].isalpha() or not tok[1:].islower():
            continue
        pool.append(i)
    return np.array(sorted(pool))


class PromptFactory:
    """Makes `RequestSpec`s; the same seed gives the same prompts on every engine."""

    def __init__(
        self, kind: PromptKind = "tokens", tokenizer: Any = None, vocab_size: int = 32000, seed: int = 0
    ) -> None:
        self.kind, self.tok = kind, tokenizer
        self.rng = np.random.default_rng(seed)
        self.pool = _id_pool(tokenizer, vocab_size, kind)

    def _ids(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.choice(self.pool, size=n)] if n > 0 else []

    def _render(self, ids: list[int]) -> tuple[str | list[int], int]:
        if self.kind == "tokens":
            return ids, len(ids)
        if self.tok is None:  # no tokenizer: one random word per requested token (approximate)
            words = [_WORDS[i % len(_WORDS)] for i in ids]
            return " ".join(words), len(words)
        text = self.tok.decode(ids)
        return text, len(self.tok.encode(text, add_special_tokens=False))

    def make(
        self, num: int, input_len: int, output_len: int, prefix_len: int = 0, prefix_groups: int = 1
    ) -> list[RequestSpec]:
        """`num` prompts of `prefix_len + input_len` tokens; request i shares the prefix of group
        i % prefix_groups (vLLM's --random-prefix-len semantics). Chat: input lengths ignored."""
        if self.kind == "chat":
            return self._chat(num, output_len)
        prefixes = [self._ids(prefix_len) for _ in range(max(1, prefix_groups))]
        specs = []
        for i in range(num):
            ids = prefixes[i % len(prefixes)] + self._ids(input_len)
            prompt, n = self._render(ids)
            specs.append(RequestSpec(prompt, n, output_len))
        return specs

    def _chat(self, num: int, output_len: int) -> list[RequestSpec]:
        from axonserve.speculative.training.prompts import held_out_prompts

        if self.tok is None:
            raise ValueError("chat prompts need the model's tokenizer")
        pool = held_out_prompts()
        order = self.rng.permutation(len(pool))
        specs = []
        for i in range(num):
            p = pool[int(order[i % len(pool)])]
            text = (
                self.tok.apply_chat_template(
                    [{"role": "user", "content": p.text}], tokenize=False, add_generation_prompt=True
                )
                if p.chat
                else p.text
            )
            specs.append(RequestSpec(text, len(self.tok.encode(text, add_special_tokens=False)), output_len))
        return specs
