"""Incremental detokenization and stop-string matching for one generated sequence.

Token-by-token decoding is wrong in two ways: a multi-byte character (emoji, CJK) can be
split across tokens, and some tokenizers (SentencePiece) drop a word's leading space when a
token is decoded alone. We follow vLLM: decode a short window `[prefix_offset:]` and emit only
what it adds over `[prefix_offset:read_offset]`, and hold back text that ends in U+FFFD (an
incomplete character) until the next token completes it.

Stop strings live here because the engine never sees text. A stop string can straddle
deltas, so we hold back the end of the text that could still start one (at most
`len(longest stop) - 1` chars): it must never be emitted if the stop string completes.

Per token the work is bounded by the token, not by the output so far (issue 27 item 7): the
decode window is a few tokens, stop strings are searched only in the new text plus
`len(stop) - 1` chars before it, and the held-back end is looked for only past what was already
emitted. `scanned_chars` counts the characters the stop-string checks examined, so tests can
check that without timing. (One O(output) cost remains per token: `text`, the output so far, is
a str rebuilt by each append, because the client hands it out as `output_text` on every delta.)
"""

from __future__ import annotations

from dataclasses import dataclass

from axonserve.frontends.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5  # prompt tokens decoded as left context (leading-space handling)


@dataclass(slots=True)
class DetokenizedDelta:
    text: str  # new text to emit (may be "")
    num_tokens: int  # how many of the new ids were accepted (fewer if a stop string hit)
    stop_string: str | None = None  # set when a stop string ended the sequence


class IncrementalDetokenizer:
    """Turn a growing list of token ids into text deltas that are always valid UTF-8."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        self._tok = tokenizer
        self._decode = tokenizer.decode  # (bound once: two calls per token)
        self._skip = skip_special_tokens
        self._special = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        # Hold back a possible stop-string prefix, unless it would be emitted anyway.
        longest = max((len(s) for s in self._stop), default=0)
        self._holdback = 0 if include_stop_str_in_output else max(longest - 1, 0)
        self.scanned_chars = 0  # chars examined by stop-string checks (a work counter for tests)
        context = [t for t in prompt_token_ids[-_PROMPT_CONTEXT:] if t not in self._special]
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.num_output_tokens = 0
        self.text = ""  # cumulative output text (stop strings already applied)
        self._emitted = 0  # chars of `text` already handed out
        self.stop_string: str | None = None

    @property
    def finished(self) -> bool:
        return self.stop_string is not None

    def step(
        self, new_token_ids: list[int], *, finished: bool = False, stop_terminated: bool = False
    ) -> DetokenizedDelta:
        """Feed one engine delta. `finished`: the engine ended the sequence with this delta;
        `stop_terminated`: it ended on a stop token (EOS/stop_token_ids), whose text is then
        left out unless include_stop_str_in_output.
        """
        if self.stop_string is not None:
            return DetokenizedDelta("", 0, self.stop_string)
        ids = new_token_ids
        if stop_terminated and ids and not self._include_stop:
            ids = ids[:-1]
        accepted = len(new_token_ids)
        if not self._stop:  # the common case: no stop-string search, no held-back text
            return self._step_plain(ids, accepted, finished)
        for i, token_id in enumerate(ids):
            self.num_output_tokens += 1
            before = len(self.text)
            self.text += self._decode_next(token_id)
            if self._stop and self.num_output_tokens > self._min_tokens and len(self.text) > before:
                if self._check_stop(before):
                    accepted = i + 1
                    break
        if not self.finished:
            self.num_output_tokens += len(new_token_ids) - len(ids)
        done = finished or self.finished
        if done and not self.finished:
            self.text += self._flush()
        return DetokenizedDelta(self._take(done), accepted, self.stop_string)

    # ------------------------------------------------------------------ internals

    def _step_plain(self, ids: list[int], accepted: int, finished: bool) -> DetokenizedDelta:
        """`step` without stop strings: all text is emitted at once (`_emitted` stays at the end)."""
        self.num_output_tokens += accepted
        if len(ids) == 1:
            new = self._decode_next(ids[0])
        else:
            new = "".join([self._decode_next(t) for t in ids])
        if finished:
            new += self._flush()
        if new:
            self.text += new
            self._emitted = len(self.text)
        return DetokenizedDelta(new, accepted)

    def _decode_next(self, token_id: int) -> str:
        if token_id in self._special:
            return ""
        ids = self._ids
        ids.append(token_id)
        start = self._prefix_offset
        prefix = self._decode(ids[start : self._read_offset], self._skip)
        full = self._decode(ids[start:], self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix) :]
        return ""

    def _flush(self) -> str:
        """At the end, release text still held for an incomplete character."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._decode(self._ids[self._prefix_offset :], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _check_stop(self, before: int) -> bool:
        """Search stop strings in text that could involve the new chars; truncate on a hit."""
        best: tuple[int, str] | None = None
        for s in self._stop:
            start = max(before - len(s) + 1, 0)  # a match must involve the new chars
            self.scanned_chars += len(self.text) - start
            idx = self.text.find(s, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        self.text = self.text[: idx + len(s) if self._include_stop else idx]
        self.stop_string = s
        return True

    def _held(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string.

        Only ends starting at or after what was already emitted can qualify (an end that could
        start a stop string now could one step earlier too), so each start position is rejected
        at most once per stream: amortized O(stops * longest stop) per new char."""
        n = len(self.text)
        for p in range(max(n - self._holdback, self._emitted), n):
            end = self.text[p:]
            self.scanned_chars += (n - p) * len(self._stop)
            if any(len(s) > len(end) and s.startswith(end) for s in self._stop):
                return n - p
        return 0

    def _take(self, done: bool) -> str:
        end = len(self.text)
        if not done and self._holdback:
            end = max(end - self._held(), self._emitted)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
