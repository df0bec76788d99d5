"""Incremental detokenization and stop strings, with the real SmolLM2 (byte-level BPE) tokenizer."""

from __future__ import annotations

import pytest

from axonserve.frontends.detokenizer import IncrementalDetokenizer
from axonserve.frontends.tokenizer import Tokenizer

TEXTS = [
    "Hello world, this is a test.",
    "Emoji 😀👍🏽 and flags 🇫🇷 mixed in.",
    "中文测试：你好，世界！日本語もね。",
    "naïve café — “quotes” …",
    "  leading spaces\n\nand\ttabs ",
]


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.load(smollm2_dir)


def feed(tok: Tokenizer, ids: list[int], chunk: int = 1, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, tok.encode("Prompt:"), **kw)
    pieces = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        out = d.step(ids[i : i + chunk], finished=last)
        pieces.append(out.text)
        if out.stop_string is not None:
            break
    return pieces, d


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_roundtrip_never_emits_broken_utf8(tok, text, chunk):
    ids = tok.hf.encode(text, add_special_tokens=False)
    pieces, d = feed(tok, ids, chunk)
    assert "".join(pieces) == text == d.text
    assert all("\ufffd" not in p for p in pieces)
    assert d.num_output_tokens == len(ids)


def test_multibyte_char_is_held_until_complete(tok):
    ids = tok.hf.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    d = IncrementalDetokenizer(tok, [])
    texts = [d.step([t]).text for t in ids]
    assert texts[:-1] == [""] * (len(ids) - 1) and texts[-1] == "😀"


def test_incomplete_char_is_flushed_at_finish(tok):
    ids = tok.hf.encode("ab😀", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [])
    first = d.step(ids[:-1]).text
    last = d.step([], finished=True).text
    assert first == "ab" and last.startswith("\ufffd")


def test_skip_special_tokens(tok):
    eos = tok.hf.convert_tokens_to_ids("<|im_end|>")
    ids = tok.hf.encode("Hi there", add_special_tokens=False)
    _, d = feed(tok, ids + [eos] + ids)
    assert d.text == "Hi thereHi there"
    _, d = feed(tok, ids + [eos], skip_special_tokens=False)
    assert d.text == "Hi there<|im_end|>"


def test_stop_token_text_left_out(tok):
    eos = tok.hf.convert_tokens_to_ids("<|im_end|>")
    ids = tok.hf.encode("Hi", add_special_tokens=False) + [eos]
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    out = d.step(ids, finished=True, stop_terminated=True)
    assert out.text == d.text == "Hi" and d.num_output_tokens == len(ids)
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=False, include_stop_str_in_output=True)
    assert d.step(ids, finished=True, stop_terminated=True).text == "Hi<|im_end|>"


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_across_boundaries(tok, chunk):
    text = "The answer is 42. STOP here and more text"
    ids = tok.hf.encode(text, add_special_tokens=False)
    pieces, d = feed(tok, ids, chunk, stop=["STOP"])
    assert d.stop_string == "STOP"
    assert "".join(pieces) == d.text == "The answer is 42. "
    assert all("S" not in p for p in pieces)  # the stop prefix was held back, never emitted
    assert d.num_output_tokens < len(ids)


def test_stop_string_split_inside_tokens(tok):
    # "lo wo" spans token boundaries of "hello world"
    ids = tok.hf.encode("hello world again", add_special_tokens=False)
    pieces, d = feed(tok, ids, 1, stop=["lo wo"])
    assert "".join(pieces) == d.text == "hel"


def test_include_stop_str_in_output(tok):
    ids = tok.hf.encode("one two three four", add_special_tokens=False)
    pieces, d = feed(tok, ids, 1, stop=["three"], include_stop_str_in_output=True)
    assert "".join(pieces) == d.text == "one two three"


def test_earliest_stop_wins_and_multibyte_stop(tok):
    ids = tok.hf.encode("abc 世界 xyz end", add_special_tokens=False)
    pieces, d = feed(tok, ids, 4, stop=["end", "世界"])
    assert d.stop_string == "世界" and "".join(pieces) == "abc "


def test_holdback_released_when_no_stop(tok):
    ids = tok.hf.encode("almost STO", add_special_tokens=False)
    pieces, d = feed(tok, ids, 1, stop=["STOP"])
    assert d.stop_string is None and "".join(pieces) == "almost STO"


def test_min_tokens_delays_stop_strings(tok):
    ids = tok.hf.encode("x x x x", add_special_tokens=False)
    _, d = feed(tok, ids, 1, stop=["x"], min_tokens=2)
    assert d.stop_string == "x" and d.num_output_tokens == 3
