"""Sampler semantics on hand-made logits (no model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from axonserve.neuron.sampler import Sampler
from axonserve.protocol.messages import SamplingParams

V = 50


@dataclass
class S:
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None


def st(prompt=(1, 2), out=(), **kw) -> S:
    """A request's state as the runner builds it: a seeded one also has its generator (verification)."""
    p = SamplingParams(**kw)
    g = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    return S(p, list(prompt) + list(out), len(prompt), g)


def logits(n: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_fast_path_and_mixed_batch():
    lg = logits()
    ids, lps = Sampler([0])(lg, [st(temperature=0.0) for _ in range(4)])
    assert ids == lg.argmax(-1).tolist() and lps is None
    mixed = [st(temperature=0.0), st(temperature=1.0, top_k=1), st(temperature=0.7, top_p=1e-6), st(temperature=0.0)]
    ids, _ = Sampler([0])(lg, mixed)
    assert ids == lg.argmax(-1).tolist()  # top-k=1 and a tiny nucleus are greedy


def test_seeded_requests_are_reproducible_regardless_of_batch():
    lg = logits(3)
    a, _ = Sampler([0], seed=1)(lg, [st(temperature=1.0, seed=7), st(temperature=1.0), st(temperature=1.0)])
    b, _ = Sampler([0], seed=2)(lg[[0]], [st(temperature=1.0, seed=7)])
    assert a[0] == b[0]

    # the position advances: a seeded request draws different tokens over steps, the same sequence each run
    def draws(seed):
        s, r = Sampler([0]), st(temperature=1.0, seed=seed)
        for _ in range(20):
            r.token_ids.append(s(torch.zeros(1, V), [r])[0][0])
        return r.token_ids[2:]

    assert draws(3) == draws(3) and len(set(draws(3))) > 5 and draws(3) != draws(4)


def test_seeded_token_depends_on_seed_and_position_only():
    """A seeded request's token at position i is a function of (seed, i) and the logits: the same
    alone or in batches of any size and place, from samplers seeded differently, and after its state
    is rebuilt from prompt + outputs (a preemption re-sends it as new; so does a restarted worker).
    Both paths: temperature only (the native kernel where built) and top-p (torch)."""
    lg = torch.randn(1, V, generator=torch.Generator().manual_seed(9))  # flat: many tokens likely
    for kw in ({}, {"top_p": 0.95}):

        def run(sampler_seed: int, crowd: int, rebuild_at: tuple[int, ...], kw=kw) -> list[int]:
            s = Sampler([0], seed=sampler_seed)
            r = st(prompt=(4, 5, 6), temperature=1.0, seed=1234, **kw)
            for i in range(16):
                if i in rebuild_at:
                    r = st(prompt=(4, 5, 6), out=r.token_ids[3:], temperature=1.0, seed=1234, **kw)
                others = [st(out=(7,) * j, temperature=1.0, **kw) for j in range((i * crowd) % 5)]
                at = i % (len(others) + 1)
                batch = others[:at] + [r] + others[at:]
                ids, _ = s(lg.repeat(len(batch), 1), batch)
                r.token_ids.append(ids[at])
            return r.token_ids[3:]

        alone = run(0, 0, ())
        assert len(set(alone)) > 5, alone  # the position moves the draw
        assert run(1, 3, (4, 9)) == alone, kw
        assert run(2, 1, (1, 2, 3)) == alone, kw


def test_counter_uniforms_strictly_inside_and_near_the_xla_ones():
    """The CPU sampler's uniform numbers lie strictly inside (0, 1), are uniform over seeds and over
    positions (chi-square on 20 bins), and stay within 2**-23 of the XLA graphs' (24-bit, float32) for
    the same (seed, position): both devices draw the same seeded tokens up to CDF-boundary ties."""
    from collections import Counter

    from conftest import chi2, chi2_critical

    from axonserve.neuron.counter_rng import hash32, seed_words, uniforms64
    from axonserve.xla.sampling import uniforms

    seeds = [0, 1, -1, -7, 2**31 - 1, 2**40 + 5, 2**63 - 1, -(2**63)] + list(range(100, 20100))
    positions = [0, 1, 2**31, 2**32 - 1, 2**32, 5, 77, 2**40] + list(range(20000))
    for ss, ps in ((seeds, [3] * len(seeds)), ([42] * len(positions), positions)):
        u = uniforms64(ss, ps)
        assert u.dtype == torch.float64 and bool((u > 0).all()) and bool((u < 1).all())
        words = [seed_words(x) for x in ss]
        u32 = uniforms(
            torch.tensor([w[0] for w in words]),
            torch.tensor([w[1] for w in words]),
            torch.tensor([p % 2**32 for p in ps]),
        )
        assert float((u - u32.double()).abs().max()) <= 2**-23
        hashed = hash32(*(torch.tensor(c) for c in zip(*words)), torch.tensor([p % 2**32 for p in ps]))
        assert torch.equal((u * 2**32 - 0.5).round().long(), hashed)  # Python ints hash as tensors do
        n = len(u)
        stat, df = chi2(Counter((u * 20).long().tolist()), {b: 1 / 20 for b in range(20)}, n)
        assert stat < chi2_critical(df), stat


def test_sampling_follows_the_distribution_with_top_k_top_p_min_p():
    lg = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    s = Sampler([49], seed=0)

    def counts(**kw):
        r = st(temperature=1.0, **kw)
        c = torch.zeros(V)
        for _ in range(2000):
            c[s(lg, [r])[0][0]] += 1
        return c / 2000

    f = counts()
    assert abs(f[0] - 0.5) < 0.05 and abs(f[1] - 0.3) < 0.05
    assert counts(top_k=2)[2:].sum() == 0
    f = counts(top_p=0.7)  # nucleus {0, 1}: 0.5 + 0.3 >= 0.7
    assert f[2:].sum() == 0 and abs(f[0] - 0.625) < 0.05
    assert counts(min_p=0.5)[2:].sum() == 0  # 0.15 < 0.5 * 0.5


def test_repetition_penalty_hf_semantics():
    lg = torch.tensor([[2.0, -2.0, 1.0, 0.5] + [0.0] * (V - 4)])
    r = st(prompt=(0,), out=(1,), temperature=0.0, repetition_penalty=2.0)
    s = Sampler([49])
    out = lg.clone()
    s._apply_penalties(out, [r])
    assert out[0, :4].tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied, unseen kept
    assert s(lg, [r])[0] == [0]  # 1.0 ties 1.0 at id 2: argmax picks the first


def test_presence_and_frequency_penalties_on_outputs_only():
    lg = torch.zeros(1, V)
    r = st(prompt=(5,), out=(3, 3, 4), temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = lg.clone()
    Sampler([49])._apply_penalties(out, [r])
    assert out[0, 3].item() == -(0.5 + 2 * 0.25)
    assert out[0, 4].item() == -(0.5 + 0.25)
    assert out[0, 5].item() == 0.0  # prompt tokens are not penalised


def test_min_tokens_masks_eos_and_stop_ids():
    lg = torch.zeros(1, V)
    lg[0, 7] = 10.0  # eos
    lg[0, 8] = 9.0  # stop token
    s = Sampler([7])
    assert s(lg, [st(out=(1,), temperature=0.0, min_tokens=2, stop_token_ids=[8])])[0] == [0]
    assert s(lg, [st(out=(1,), temperature=0.0, min_tokens=2)])[0] == [8]
    assert s(lg, [st(out=(1, 2), temperature=0.0, min_tokens=2)])[0] == [7]  # reached: EOS allowed


def test_logprobs_are_raw_log_softmax():
    lg = logits(3)
    reqs = [
        st(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        st(temperature=0.0),
        st(temperature=1.0, seed=1, logprobs=0),
    ]
    ids, lps = Sampler([0])(lg, reqs)
    ref = torch.log_softmax(lg, -1)
    assert lps[1] is None
    for i in (0, 2):
        assert abs(lps[i].logprob - ref[i, ids[i]].item()) < 1e-6
        assert lps[i].rank == int((ref[i] > ref[i, ids[i]]).sum()) + 1
    top = ref[0].topk(3)
    assert lps[0].top_ids == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(lps[0].top_logprobs), top.values)
    assert lps[2].top_ids == []


# ---------------------------------------------------------------- speculative verification


def test_verify_greedy_accepts_the_matching_prefix_then_samples():
    lg = logits(4, seed=3)
    top = lg.argmax(-1).tolist()
    s = Sampler([0])
    wrong = (top[1] + 1) % V
    # request 1: first draft right, second wrong -> 1 accepted + the target's token there
    # request 2: both drafts right -> 2 accepted + a bonus token from the last row
    out = s.verify(
        torch.cat([lg[:3], lg[:3]]), [st(temperature=0.0), st(temperature=0.0)], [[top[0], wrong], [top[0], top[1]]]
    )
    assert out == [[top[0], top[1]], [top[0], top[1], top[2]]]


def test_verify_applies_min_tokens_per_position():
    lg = torch.zeros(3, V)
    lg[:, 0] = 10.0  # EOS (id 0) is every row's argmax
    # one output already, min_tokens 3: rows 0 and 1 (outputs 1 and 2) may not end, row 2 may
    out = Sampler([0]).verify(lg, [st(out=(9,), temperature=0.0, min_tokens=3)], [[0, 7]])
    assert out[0][0] != 0 and len(out[0]) == 1  # EOS banned at row 0, so the draft 0 is rejected
    lg2 = lg.clone()
    lg2[0, 5] = 20.0
    lg2[1, 7] = 20.0
    assert Sampler([0]).verify(lg2, [st(out=(9,), temperature=0.0, min_tokens=3)], [[5, 7]]) == [[5, 7, 0]]


def test_verify_keeps_the_target_distribution():
    """Rejection sampling with fixed drafts: token 1 ~ p0; token 2 given draft 1 accepted ~ p1;
    token 3 given both accepted ~ p2 (chi-square, 20,000 requests in one call)."""
    from collections import Counter

    from conftest import chi2, chi2_critical

    v, n, temp = 8, 20000, 0.9
    lg = torch.randn(3, v, generator=torch.Generator().manual_seed(4)) * 1.5
    p = (lg / temp).softmax(-1)
    drafts = [int(p[0].argsort()[-2]), int(p[1].argmax())]  # a likely-but-not-top draft, then the top one
    reqs = [st(temperature=temp) for _ in range(n)]
    out = Sampler([0], seed=1).verify(lg.repeat(n, 1), reqs, [drafts] * n)
    checks = [
        (Counter(o[0] for o in out), p[0]),
        (Counter(o[1] for o in out if o[0] == drafts[0] and len(o) > 1), p[1]),
        (Counter(o[2] for o in out if o[:2] == drafts and len(o) > 2), p[2]),
    ]
    for obs, probs in checks:
        m = sum(obs.values())
        assert m > 1000
        stat, df = chi2(obs, dict(enumerate(probs.tolist())), m)
        assert stat < chi2_critical(df), (stat, df, obs, probs)
    # every rejected draft position holds a token other than the draft
    assert all(o[0] != drafts[0] for o in out if len(o) == 1)


def test_temperature_draws_follow_softmax_native_and_torch_paths():
    """Temperature-only rows take the native inverse-CDF kernel on the logits as they are (bf16 or
    float32); min_p routes a row through the torch path. Both keep softmax(x / T) (chi-square,
    20,000 rows in one call), and a banned (min_tokens) token is never drawn."""
    from collections import Counter

    from conftest import chi2, chi2_critical

    v, n, temp = 12, 20000, 0.7
    lg = torch.randn(1, v, generator=torch.Generator().manual_seed(5)) * 2
    for dtype, kw in ((torch.float32, {}), (torch.bfloat16, {}), (torch.float32, {"min_p": 1e-12})):
        x = lg.to(dtype)
        p = (x.float() / temp).softmax(-1)[0]
        reqs = [st(temperature=temp, **kw) for _ in range(n)]
        ids, _ = Sampler([0], seed=3)(x.repeat(n, 1), reqs)
        stat, df = chi2(Counter(ids), dict(enumerate(p.tolist())), n)
        assert stat < chi2_critical(df), (dtype, kw, stat, Counter(ids), p)
    eos = int(lg.argmax())
    reqs = [st(temperature=5.0, min_tokens=3) for _ in range(2000)]
    ids, _ = Sampler([eos])(lg.repeat(2000, 1), reqs)
    assert eos not in ids and len(set(ids)) == v - 1


def test_top_k_top_p_candidates_equal_the_full_sort():
    """The top-1024 candidate pass keeps exactly the tokens the full sort keeps: peaked rows (nucleus
    inside the candidates), flat rows (fallback), top-k beyond the candidates, unfiltered rows."""
    from axonserve.neuron.sampler import _top_k_top_p, _top_k_top_p_sorted

    vocab = 5000
    g = torch.Generator().manual_seed(6)
    lg = torch.cat([torch.randn(4, vocab, generator=g) * 8, torch.randn(4, vocab, generator=g) * 0.1])
    top_k = torch.tensor([0, 50, 2000, vocab, vocab, 3, 1500, vocab])
    top_k = torch.where(top_k > 0, top_k, vocab)
    top_p = torch.tensor([0.9, 1.0, 0.95, 0.5, 0.99, 0.7, 1.0, 1.0])
    fast, ref = _top_k_top_p(lg, top_k, top_p), _top_k_top_p_sorted(lg, top_k, top_p)
    assert torch.equal(fast.isinf(), ref.isinf()) and torch.equal(fast[~fast.isinf()], ref[~ref.isinf()])
    kept = (~fast.isinf()).sum(-1).tolist()
    assert kept[7] == vocab and kept[1] == 50 and kept[5] <= 3 and kept[4] > 1024  # a flat row fell back
