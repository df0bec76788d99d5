"""Worker-side constrained decoding: one llguidance matcher per request, token bitmasks on logits.

Design (whole flow: structured_output/grammar.py). Rank 0 alone masks and advances matchers, since
only its sampled ids count; other tensor-parallel ranks hold `enabled=False` and do nothing.
A request's matcher is made when it first samples and replays the output tokens it already
has, which covers preemption by recompute (the request comes back as new, outputs included).
A matcher that cannot advance (a bug, or a tokenizer llguidance cannot read) is logged and from
then on admits only EOS, so the request ends instead of taking the worker down.
"""

from __future__ import annotations

import contextvars
import importlib.util
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import structlog
import torch

from axonserve.protocol.messages import SamplingParams
from axonserve.structured_output.grammar import compile_grammar

log = structlog.get_logger()


class _Sampled(Protocol):
    request_id: str
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    grammar: Any  # GrammarState | None, set here


class GrammarState:
    """One request's matcher; `failed` once it could not follow the tokens (EOS only then)."""

    __slots__ = ("failed", "matcher")

    def __init__(self, matcher: Any | None):
        self.matcher = matcher
        self.failed = matcher is None


def _tokenizer_json_llg(model_dir: str, vocab_size: int, eos_token_ids: list[int]) -> Any | None:
    """The grammar tokenizer straight from `tokenizer.json`, without importing transformers (most of
    the build's time, in a process that never needs it otherwise; docs/benchmarks.md#fig-structured-output).
    None whenever transformers' tokenizer might differ from the file (the transformers path then decides,
    as the frontend's tokenizer does): no file (GGUF-only directories), an unreadable one,
    added_tokens.json, configured tokens the file lacks, or pre-tokenizer options transformers applies
    on load."""
    import json
    import os

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path) or os.path.exists(os.path.join(model_dir, "added_tokens.json")):
        return None
    try:
        from llguidance import LLTokenizer
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        cfg: dict = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if os.path.isfile(os.path.join(model_dir, name)):
                with open(os.path.join(model_dir, name)) as f:
                    cfg.update(json.load(f))
    except Exception as e:  # noqa: BLE001 - the transformers path may still read it
        log.info("structured.fast_tokenizer_skipped", error=f"{type(e).__name__}: {e}")
        return None
    if "add_prefix_space" in cfg or cfg.get("legacy") is False:
        return None
    added = cfg.get("added_tokens_decoder") or {}
    if any(tok.id_to_token(int(i)) != t.get("content") for i, t in added.items()):
        return None
    named = [cfg.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")]
    named += list(cfg.get("additional_special_tokens") or []) + list(cfg.get("extra_special_tokens") or [])
    for t in named:
        content = t.get("content") if isinstance(t, dict) else t
        if isinstance(content, str) and tok.token_to_id(content) is None:
            return None
    tok.no_padding()
    tok.no_truncation()
    n_vocab = max(vocab_size, tok.get_vocab_size(with_added_tokens=True))
    return LLTokenizer(tok.to_str(), n_vocab=n_vocab, eos_token=list(eos_token_ids))


class StructuredDecoding:
    """Grammar masks for the rows of one sampling batch; llguidance state built on first use."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Sequence[int], enabled: bool = True):
        self.model_dir, self.vocab_size, self.enabled = model_dir, vocab_size, enabled
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: Any = None  # llguidance.LLTokenizer
        self._tokenizer_error: str | None = None
        self._templates: dict[tuple[str, str, bool], Any] = {}  # fresh matcher per spec, copied per request
        # the grammar tokenizer takes a while to build (mostly imports): on a thread from the start,
        # so it overlaps the model load, and the first structured request does not stall its step
        self._warm: threading.Thread | None = None
        if enabled and importlib.util.find_spec("llguidance") is not None:
            ctx = contextvars.copy_context()  # its log lines keep the actor/rank binding
            self._warm = threading.Thread(
                target=ctx.run, args=(self._llg_tokenizer,), name="llg-tokenizer", daemon=True
            )
            self._warm.start()

    def wait_warm(self, timeout_s: float = 60.0) -> None:
        """Wait for the grammar tokenizer: a worker reports ready only then, since the build holds
        the GIL and slowed every step while it ran (docs/benchmarks.md#fig-structured-output).
        Bounded: a stuck build delays structured requests (they join it), not the engine's start."""
        if self._warm is not None:
            self._warm.join(timeout_s)
            if self._warm.is_alive():
                log.warning("structured.tokenizer_slow", waited_s=timeout_s)

    # ------------------------------------------------------------------ matchers

    def _llg_tokenizer(self) -> Any:
        """Model vocabulary width (a padded vocab's extra ids are never allowed), model EOS ids."""
        if self._tokenizer is None and self._tokenizer_error is None:
            try:
                self._tokenizer = _tokenizer_json_llg(self.model_dir, self.vocab_size, self.eos_token_ids)
                if self._tokenizer is None:
                    import llguidance.hf

                    from axonserve.frontends.tokenizer import load_hf_tokenizer

                    hf = load_hf_tokenizer(self.model_dir)
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        hf, n_vocab=max(self.vocab_size, len(hf)), eos_token=self.eos_token_ids
                    )
                log.info("structured.tokenizer_ready", vocab=self._tokenizer.vocab_size, eos=self.eos_token_ids)
            except Exception as e:  # noqa: BLE001 - structured requests then end at once
                self._tokenizer_error = f"{type(e).__name__}: {e}"
                log.warning(
                    "structured.unavailable", reason="no grammar tokenizer for this model", error=self._tokenizer_error
                )
        return self._tokenizer

    def _new_state(self, st: _Sampled) -> GrammarState:
        from llguidance import LLMatcher

        so = st.params.structured_outputs
        assert so is not None
        if self._warm is not None:
            self._warm.join()
            self._warm = None
        tok = self._llg_tokenizer()
        if tok is None:
            return GrammarState(None)
        key = (so.kind, so.spec, so.any_whitespace)
        template = self._templates.get(key)
        if template is None:
            template = LLMatcher(tok, compile_grammar(*key), log_level=0)
            if len(self._templates) >= 256:
                self._templates.pop(next(iter(self._templates)))
            self._templates[key] = template
        state = GrammarState(template.deep_copy())
        outputs = st.token_ids[st.num_prompt_tokens :]
        if outputs:  # resumed after preemption: replay what was already generated
            self._consume(st, state, outputs)
        if state.matcher is not None and state.matcher.is_error():
            self._fail(st, state, state.matcher.get_error())
        return state

    def _consume(self, st: _Sampled, state: GrammarState, tokens: list[int]) -> None:
        for t in tokens:
            if state.failed or state.matcher.is_stopped():  # complete: only EOS follows, unconsumed
                return
            if not state.matcher.consume_token(t):
                self._fail(st, state, state.matcher.get_error())

    def _fail(self, st: _Sampled, state: GrammarState, why: str) -> None:
        state.failed = True  # llguidance appends its whole parser state: keep the first line
        log.error("structured.matcher_failed", request_id=st.request_id, error=why.strip().split("\n")[0][:300])

    # ------------------------------------------------------------------ per step

    def mask_logits(self, logits: torch.Tensor, reqs: Sequence[_Sampled]) -> None:
        """Set disallowed tokens' logits to -inf in place, for rows with a structured spec."""
        if not self.enabled:
            return
        rows = [i for i, r in enumerate(reqs) if r.params.structured_outputs is not None]
        if not rows:
            return
        for i in rows:
            if reqs[i].grammar is None:
                reqs[i].grammar = self._new_state(reqs[i])
        width = logits.shape[1]
        words = (max(width, self._tokenizer.vocab_size if self._tokenizer is not None else 0) + 31) // 32
        bitmask = np.zeros((len(rows), words), dtype=np.int32)  # bit t of row j: token t allowed
        for j, i in enumerate(rows):
            state = reqs[i].grammar
            if state.failed:
                for t in self.eos_token_ids:
                    bitmask[j].view(np.uint8)[t // 8] |= 1 << (t % 8)
            else:
                state.matcher.unsafe_compute_mask_ptr(bitmask[j].ctypes.data, words * 4)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=width, bitorder="little").view(np.bool_)
        empty = ~allowed.any(axis=1)
        if empty.any():  # the grammar allows only ids past the model's vocabulary: end it
            allowed[np.ix_(empty, self.eos_token_ids)] = True
        idx = torch.tensor(rows)
        logits[idx] = torch.where(torch.from_numpy(allowed), logits[idx], float("-inf"))

    def accept(self, reqs: Sequence[_Sampled], token_ids: Sequence[int]) -> None:
        """Advance each structured request's matcher by the token it was given (rank 0's)."""
        if not self.enabled:
            return
        for st, t in zip(reqs, token_ids):
            if st.grammar is not None:
                self._consume(st, st.grammar, [t])
