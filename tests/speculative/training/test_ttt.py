"""The training-time-test unrolling computes, for every position at once, what drafting computes
one chain at a time: checked against a causal recompute of each chain."""

from __future__ import annotations

import torch

from axonserve.speculative.training.data import Sequence
from axonserve.speculative.training.train import make_batch, step_mask, unrolled
from tests.speculative.test_eagle import make_head


def test_unrolled_steps_equal_chained_recompute(tiny_llama_dir):
    head = make_head(tiny_llama_dir)
    torch.manual_seed(2)
    seqs = [
        Sequence(torch.randint(0, 49152, (n,)), 4, torch.randn(n, 64), torch.zeros(n, dtype=torch.long))
        for n in (19, 13)
    ]
    batch = make_batch(seqs, 512)
    steps = 3
    with torch.no_grad():
        outs = unrolled(head, batch, steps)
        for j in range(1, steps + 1):
            m = step_mask(batch, j)
            for b, s in enumerate(seqs):
                for p in range(len(s.ids) - 1):
                    if not m[b, p]:
                        continue
                    t = p - j + 1  # the chain's last true position
                    f, tok = s.feats[: t + 1], s.ids[1 : t + 2]
                    for i in range(1, j + 1):
                        y = head(f[None], tok[None])[0, -1]
                        if i < j:  # feed the prediction back with the true next token
                            f, tok = torch.cat((f, y[None])), torch.cat((tok, s.ids[t + i + 1 : t + i + 2]))
                    torch.testing.assert_close(outs[j - 1][b, p], y, atol=1e-5, rtol=1e-5)
    assert m.sum() > 10  # the last step's mask selected real positions
