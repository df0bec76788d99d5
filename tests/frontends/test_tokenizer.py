"""Prompt encoding and chat templates."""

from __future__ import annotations

import shutil

import pytest

from axonserve.frontends.tokenizer import Tokenizer
from axonserve.protocol.messages import ParamError


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.load(smollm2_dir)


def test_chat_template_renders_and_encodes_once(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.render_chat(messages)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode_chat(messages)
    assert tok.decode(ids, skip_special_tokens=False) == text
    start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and ids[1] != start  # no doubled special tokens


def test_content_parts_are_flattened(tok):
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    assert tok.render_chat([{"role": "user", "content": parts}]) == tok.render_chat(
        [{"role": "user", "content": "Hello"}]
    )
    with pytest.raises(ParamError):
        tok.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_no_chat_template_is_a_clear_error(smollm2_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = f"{smollm2_dir}/{name}"
        try:
            shutil.copy(src, tmp_path / name)
        except FileNotFoundError:
            pass
    tok = Tokenizer.load(str(tmp_path))
    tok.hf.chat_template = None
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_token_text(tok):
    ids = tok.hf.encode(" hello", add_special_tokens=False)
    assert "".join(tok.token_text(i) for i in ids) == " hello"
