"""Run in the XLA venv by test_xla_sampling.py: the device sampler on PJRT CPU.

Prints one JSON line: draw counts per variant for fixed logits (the test does the chi-square),
compile counts while the per-row parameter values change, and whether the uniforms hashed on the
device equal the host's bit for bit."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch_xla
import torch_xla.debug.metrics as met

from axonserve.protocol.messages import SamplingParams
from axonserve.xla.sampling import row_params, sample, seed_words, uniforms


def compiles() -> int:
    return int(met.counter_value("UncachedCompile") or 0)


def main() -> None:
    dev = torch_xla.device()
    vocab, n = 40, 8192
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(vocab, generator=gen) * 1.5
    logits = base.repeat(n, 1).to(dev)
    torch_xla.sync()
    cases = {
        "random": SamplingParams(temperature=0.8),
        "filtered": SamplingParams(temperature=1.3, top_k=12, top_p=0.9, min_p=0.02),
    }
    out: dict = {"logits": base.tolist(), "counts": {}, "compiles": {}}
    for kind, p in cases.items():
        floats, ints = row_params([p] * n, list(range(n)), [7] * n, n, vocab)
        # all five outputs live at the sync, as in the runner: the graph's outputs are part of its identity
        r = sample(logits, torch.from_numpy(floats).to(dev), torch.from_numpy(ints).to(dev), kind)
        torch_xla.sync()
        out["counts"][kind] = np.bincount(r[0].cpu().numpy(), minlength=vocab).tolist()
    # the same shapes with other parameter values (and seeds, positions): nothing compiles again
    before = compiles()
    for i in range(4):
        ps = [SamplingParams(temperature=0.5 + 0.3 * i, top_k=3 + i, top_p=0.6 + 0.1 * i, min_p=0.01 * i, seed=i)] * n
        floats, ints = row_params(ps, [1000 * i + j for j in range(n)], [i] * n, n, vocab)
        for kind in ("random", "filtered"):
            r = sample(logits, torch.from_numpy(floats).to(dev), torch.from_numpy(ints).to(dev), kind)
            torch_xla.sync()
            r[0].cpu()
    out["compiles"] = {"before": before, "after": compiles()}
    words = [seed_words(s) for s in (0, 1, 2**31 - 1, 2**40 + 5, 2**62 - 1, -7, -(2**63))]
    hi = torch.tensor([w[0] for w in words])
    lo = torch.tensor([w[1] for w in words])
    pos = torch.tensor([0, 1, 5, 100000, 3, 9, 2**32 - 1])
    host = uniforms(hi, lo, pos)
    on_dev = uniforms(hi.to(dev), lo.to(dev), pos.to(dev))
    torch_xla.sync()
    out["uniforms_equal"] = bool(torch.equal(host, on_dev.cpu()))
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
