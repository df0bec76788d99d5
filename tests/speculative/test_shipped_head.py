"""The EAGLE head shipped for the default model loads against it and drafts what it predicts."""

from __future__ import annotations

import os

import pytest
import torch

from axonserve.speculative.eagle import HEADS_DIR, DraftKV, EagleHead, builtin_head_dir, propose

SHIPPED = os.path.join(HEADS_DIR, "smollm2-135m-instruct")
pytestmark = pytest.mark.skipif(not os.path.isdir(SHIPPED), reason="no head shipped for the default model")


def test_shipped_head_agrees_with_the_target(smollm2_dir):
    """Teacher-forced on a chat answer, the head's first draft at each answer position matches the
    target's own greedy choice far above chance; propose in bf16 drafts from the same state."""
    from axonserve.frontends.tokenizer import Tokenizer
    from axonserve.speculative.training.data import FeatureRecorder, Sequence, encode_prompts
    from axonserve.speculative.training.prompts import Prompt
    from axonserve.speculative.training.train import TrainConfig, top1

    assert builtin_head_dir(None) == SHIPPED and builtin_head_dir("SmolLM2-135M-Instruct") == SHIPPED
    head = EagleHead.from_pretrained(SHIPPED, smollm2_dir)
    assert head.config.draft_vocab_size == 8192 and head.config.target_vocab_size == 49152
    prompt = encode_prompts(smollm2_dir, [Prompt("Explain how rainbows form.", True, "chat")])[0]
    answer = Tokenizer.load(smollm2_dir).hf.encode(
        "Rainbows form when sunlight passes through raindrops in the air. The light is refracted, or bent, as it "
        "enters the drop, then reflected off the back of the drop, and refracted again as it leaves. Because "
        "different colors of light bend by different amounts, the white sunlight is split into a spectrum of "
        "colors: red, orange, yellow, green, blue, indigo and violet.",
        add_special_tokens=False,
    )
    seq = Sequence(torch.tensor(prompt + answer), len(prompt))
    FeatureRecorder(smollm2_dir).record([seq])
    acc = top1(head, [seq], TrainConfig(ttt_steps=1))[0]
    # untrained: ~0.001; the shipped head: 0.383 (hand-written text, not its own; the 2.8M-token head of the
    # eleventh session: 0.358, the 244k-token head: 0.148)
    assert acc > 0.3, acc
    # a batch of 20 requests cut at different answer positions: bf16 drafts as fp32 does (near-ties aside)
    bf = EagleHead.from_pretrained(SHIPPED, smollm2_dir, dtype=torch.bfloat16)
    ns = [len(prompt) + 3 * i for i in range(20)]
    drafts = [
        propose(
            h,
            [DraftKV.for_head(h) for _ in ns],
            [0] * len(ns),
            [seq.ids[1 : n + 1] for n in ns],
            [seq.feats[:n] for n in ns],
            2,
        )
        for h in (head, bf)
    ]
    same = sum(a[0] == b[0] for a, b in zip(*drafts))
    assert same >= 17, drafts
