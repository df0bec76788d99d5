"""Synthetic prompts: exact lengths, seeded, shared prefixes."""

from axonserve.bench.dataset import PromptFactory


def test_token_prompts_seeded_and_exact():
    a = PromptFactory("tokens", vocab_size=1000, seed=3).make(4, 16, 8)
    b = PromptFactory("tokens", vocab_size=1000, seed=3).make(4, 16, 8)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert all(len(s.prompt) == s.prompt_len == 16 and s.max_tokens == 8 for s in a)
    assert all(100 <= t < 1000 for s in a for t in s.prompt)


def test_shared_prefix_groups():
    specs = PromptFactory("tokens", vocab_size=1000, seed=0).make(6, 8, 4, prefix_len=5, prefix_groups=2)
    assert all(s.prompt_len == 13 for s in specs)
    assert specs[0].prompt[:5] == specs[2].prompt[:5] == specs[4].prompt[:5]
    assert specs[1].prompt[:5] == specs[3].prompt[:5]
    assert specs[0].prompt[:5] != specs[1].prompt[:5]
    assert specs[0].prompt[5:] != specs[2].prompt[5:]


def test_text_prompts_without_tokenizer():
    specs = PromptFactory("text", vocab_size=1000, seed=0).make(2, 12, 4)
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == 12 == s.prompt_len for s in specs)
