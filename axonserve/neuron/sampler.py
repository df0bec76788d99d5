"""Batched sampling where every request brings its own parameters.

Order (vLLM semantics): structured-output grammar mask (applied by the runner, see
structured_output/worker.py) -> raw logprobs -> allowed_token_ids / logit_bias -> penalties ->
min_tokens mask -> greedy argmax, or
temperature -> min_p -> top_k/top_p -> sample. A draw is the inverse CDF at one uniform
number per row. A seeded request's is a hash of (seed, position of the token drawn)
(neuron/counter_rng.py, as on the XLA device), so its tokens are the same whatever shares the
batch, after a preemption (re-sent as new) and after a worker restart; unseeded rows draw from the
sampler's generator. Speculative verification still draws from per-request generators. The common
case - greedy or plain temperature rows, no penalties - runs in one native call on the logits as they are
(`sample_rows`); the exponential race this replaced drew a random number per vocabulary entry,
two orders of magnitude slower at 32 rows (docs/benchmarks.md#fig-neuron-sampler).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from axonserve.neuron.counter_rng import uniforms64
from axonserve.neuron.ops import native
from axonserve.protocol.messages import SamplingParams, TokenLogprobs
from axonserve.speculative.tree import tree_children, tree_depths


class SamplingState(Protocol):
    params: SamplingParams
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    generator: torch.Generator | None  # seeded requests: speculative verification's draws only


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, L] ids padded with 0 and a [R, L] float weight that is 0 on padding."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    w = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.tensor(r)
            w[i, : len(r)] = 1.0
    return ids, w


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, the first index of a tie (tests compare against argmax). The native kernel
    where built; else torch's CPU max(dim), vectorised and faster than argmax (both against torch's
    argmax: docs/benchmarks.md#fig-neuron-sampler)."""
    k = native.for_dtype(logits.dtype)
    if k is not None and logits.dim() == 2 and logits.stride(-1) == 1:
        return k.argmax_rows(logits)
    return logits.max(dim=-1).indices


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int], seed: int = 0):
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded requests

    def __call__(
        self, logits: torch.Tensor, reqs: Sequence[SamplingState]
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        k = native.for_dtype(logits.dtype)
        want_lp, fast, all_greedy, banning = self._classify(reqs, logits.shape[-1])
        if fast and k is not None and logits.stride(-1) == 1:
            raw_lp = torch.log_softmax(logits.float(), dim=-1) if want_lp else None
            if banning:
                logits = logits.clone()
                self._apply_min_tokens(logits, reqs)
            if all_greedy:
                ids = greedy_ids(logits)
            else:  # no float32 copy of the logits at all
                inv_t = torch.tensor([0.0 if r.params.greedy else 1.0 / r.params.temperature for r in reqs])
                ids = k.sample_rows(logits, inv_t, self._uniforms(reqs))
            return ids.tolist(), (self._logprobs(raw_lp, ids, reqs) if raw_lp is not None else None)
        logits = logits.float()
        raw_lp = torch.log_softmax(logits, dim=-1) if want_lp else None
        if all(self._plain_greedy(r) for r in reqs):
            ids = greedy_ids(logits)
        else:
            ids = self._sample(logits.clone(), reqs)
        out = ids.tolist()
        return out, (self._logprobs(raw_lp, ids, reqs) if raw_lp is not None else None)

    def _classify(self, reqs: Sequence[SamplingState], vocab: int) -> tuple[bool, bool, bool, bool]:
        """(any row wants logprobs, every row greedy or temperature-only with its logits as they
        are, every row greedy, some row's min_tokens bans ids): one pass over the batch, run every step."""
        want_lp = banning = False
        fast = all_greedy = True
        for r in reqs:
            p = r.params
            if p.logprobs is not None:
                want_lp = True
            greedy = p.greedy
            all_greedy = all_greedy and greedy
            if fast and ((not greedy and not _temperature_only(p, vocab)) or self._adjusts_logits(r)):
                fast = False
            if p.min_tokens and not banning:
                banning = self._min_tokens_pending(r)
        return want_lp, fast, all_greedy, banning

    def greedy_only(self, reqs: Sequence[SamplingState]) -> bool:
        """Every row's token is its argmax as the logits stand, with nothing else to do (no
        logprobs, no adjustments, min_tokens met): `greedy_ids` alone answers."""
        return all(self._plain_greedy(r) and r.params.logprobs is None for r in reqs)

    def _plain_greedy(self, r: SamplingState) -> bool:
        """Greedy, and its logits need no adjustment before the argmax."""
        return r.params.greedy and not self._needs_processing(r)

    def _needs_processing(self, r: SamplingState) -> bool:
        return self._adjusts_logits(r) or self._min_tokens_pending(r)

    @staticmethod
    def _adjusts_logits(r: SamplingState) -> bool:
        """Penalties, biases or an allow-list: anything but min_tokens' banned ids."""
        p = r.params
        return (
            p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or bool(p.logit_bias)
            or p.allowed_token_ids is not None
        )

    def _min_tokens_pending(self, r: SamplingState) -> bool:
        """min_tokens not reached yet and something to ban (stop ids, or EOS unless ignored)."""
        p = r.params
        return (len(r.token_ids) - r.num_prompt_tokens) < p.min_tokens and bool(
            p.stop_token_ids or (not p.ignore_eos and self.eos_token_ids)
        )

    def _sample(self, logits: torch.Tensor, reqs: Sequence[SamplingState]) -> torch.Tensor:
        self._apply_bias(logits, reqs)
        self._apply_penalties(logits, reqs)
        self._apply_min_tokens(logits, reqs)
        ids = greedy_ids(logits)
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            idx = torch.tensor(rand)
            ids[idx] = self._random(logits[idx], [reqs[i] for i in rand])
        return ids

    @staticmethod
    def _apply_bias(logits: torch.Tensor, reqs: Sequence[SamplingState]) -> None:
        """allowed_token_ids masks everything else; logit_bias adds to single logits."""
        for i, r in enumerate(reqs):
            p = r.params
            if p.allowed_token_ids is not None:
                keep = torch.tensor(p.allowed_token_ids)
                row = torch.full_like(logits[i], float("-inf"))
                row[keep] = logits[i, keep]
                logits[i] = row
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias.keys()))
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)

    def _apply_penalties(self, logits: torch.Tensor, reqs: Sequence[SamplingState]) -> None:
        rep = [i for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0]
        if rep:
            idx = torch.tensor(rep)
            toks, w = _padded([reqs[i].token_ids for i in rep])
            seen = torch.zeros(len(rep), logits.shape[1]).scatter_add_(1, toks, w) > 0
            pen = torch.tensor([reqs[i].params.repetition_penalty for i in rep])[:, None]
            sub = logits[idx]
            logits[idx] = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)
        pf = [i for i, r in enumerate(reqs) if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
        if pf:
            idx = torch.tensor(pf)
            toks, w = _padded([reqs[i].token_ids[reqs[i].num_prompt_tokens :] for i in pf])
            counts = torch.zeros(len(pf), logits.shape[1]).scatter_add_(1, toks, w)
            freq = torch.tensor([reqs[i].params.frequency_penalty for i in pf])[:, None]
            pres = torch.tensor([reqs[i].params.presence_penalty for i in pf])[:, None]
            logits[idx] -= freq * counts + pres * (counts > 0).float()

    def _apply_min_tokens(self, logits: torch.Tensor, reqs: Sequence[SamplingState], ahead: Sequence[int] = ()) -> None:
        """ahead[i]: tokens row i's position lies beyond the request's known ones (drafts)."""
        for i, r in enumerate(reqs):
            if len(r.token_ids) - r.num_prompt_tokens + (ahead[i] if ahead else 0) < r.params.min_tokens:
                banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else self.eos_token_ids)
                if banned:
                    row = logits[i].clone()
                    logits[i, torch.tensor(banned)] = float("-inf")
                    if torch.isinf(logits[i]).all():  # a complete grammar admits only EOS: it wins
                        logits[i] = row

    def _random(self, logits: torch.Tensor, reqs: list[SamplingState]) -> torch.Tensor:
        return self._draw(self._probs(logits, reqs), self._uniforms(reqs))

    def _uniforms(self, reqs: Sequence[SamplingState]) -> torch.Tensor:
        """float64 [rows] strictly inside (0, 1), one per row. A seeded row's depends on (seed,
        position) only, the position being len(token_ids): the index of the token being drawn,
        which a request re-sent after a preemption (prompt + outputs so far) keeps."""
        u = torch.rand(len(reqs), dtype=torch.float64, generator=self.generator)
        seeded = [i for i, r in enumerate(reqs) if r.params.seed is not None]
        if seeded:
            u[seeded] = uniforms64([reqs[i].params.seed for i in seeded], [len(reqs[i].token_ids) for i in seeded])
        return u

    @staticmethod
    def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One draw per row from `probs` (unnormalised is fine) at its uniform number `u` (float64
        [rows]): the first index whose float64 running sum passes u x the row's total, so a
        zero-probability token is never drawn."""
        cum = probs.double().cumsum(dim=-1)
        target = (u * cum[:, -1])[:, None]
        ids = torch.searchsorted(cum, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
        # rounding can leave the target on the last entries' plateau: take the last nonzero token
        bad = probs.gather(1, ids[:, None])[:, 0] <= 0
        if bad.any():
            pos = torch.arange(probs.shape[-1])
            ids[bad] = torch.where(probs[bad] > 0, pos, -1).amax(dim=-1)
        return ids

    def _probs(self, logits: torch.Tensor, reqs: Sequence[SamplingState]) -> torch.Tensor:
        """The distribution a random request samples from: temperature, min_p, top-k/top-p."""
        temp = torch.tensor([r.params.temperature for r in reqs])[:, None]
        logits = logits / temp
        min_p = torch.tensor([r.params.min_p for r in reqs])[:, None]
        if (min_p > 0).any():
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
        vocab = logits.shape[1]
        top_k = torch.tensor([min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in reqs])
        top_p = torch.tensor([r.params.top_p for r in reqs])
        if (top_k < logits.shape[1]).any() or (top_p < 1.0).any():
            logits = _top_k_top_p(logits, top_k, top_p)
        return logits.softmax(dim=-1)

    def verify(
        self,
        logits: torch.Tensor,
        reqs: Sequence[SamplingState],
        drafts: list[list[int]],
        parents: list[list[int]] | None = None,
    ) -> list[list[int]]:
        """Speculative decoding: request i owns len(drafts[i]) + 1 consecutive rows of `logits`
        (the position of its last known token, then each draft's). Draft j follows draft
        parents[i][j] (-1: the last known token; parents before children); None: each request's
        drafts are a chain. Returns the accepted path's drafts plus one sampled token per request.

        Greedy: walk from the root to the child whose token is the argmax while there is one.
        Random (Leviathan et al. 2023, and SpecInfer's multi-draft form for a tree, the proposer
        deterministic): at a node, its children's tokens are tried in order, each accepted with
        probability p(x) / (mass of p not yet rejected); a rejected token leaves p. If all are
        rejected, the token is drawn from what is left of p (a leaf: from p itself). This is
        sampling from p one candidate at a time, so the output has exactly the target
        distribution. min_tokens is applied per position; callers pass only requests whose
        sampling has no other dependence on the tokens before it in the step (speculative/scheduler.py
        `eligible`)."""
        if parents is None:
            parents = [list(range(-1, len(d) - 1)) for d in drafts]
        kids = [tree_children(par) for par in parents]
        logits = logits.float().clone()
        rows = [r for r, d in zip(reqs, drafts) for _ in range(len(d) + 1)]
        self._apply_bias(logits, rows)
        self._apply_min_tokens(logits, rows, [int(x) for par in parents for x in tree_depths(par)])
        argmax_ids = greedy_ids(logits).tolist()
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        probs = {}
        if rand:
            idx = torch.tensor(rand)
            probs = dict(zip(rand, self._probs(logits[idx], [rows[i] for i in rand])))
        out, at = [], 0
        for r, d, ch in zip(reqs, drafts, kids):
            toks: list[int] = []
            node = -1
            while True:
                row = at + node + 1
                if r.params.greedy:
                    tok = argmax_ids[row]
                    toks.append(tok)
                    node = next((c for c in ch[node + 1] if d[c] == tok), -2)
                else:
                    node = self._accept_child(probs[row], d, ch[node + 1], r, toks)
                if node == -2:
                    break
            out.append(toks)
            at += len(d) + 1
        return out

    def _accept_child(
        self, p: torch.Tensor, d: list[int], children: list[int], r: SamplingState, toks: list[int]
    ) -> int:
        """One node of random verification: the child accepted (its token appended), or -2 after
        appending the token drawn from what the rejected children left of p. Its draws come from
        the request's generator (seeded) or the sampler's, not the (seed, position) hash: a node
        may need several numbers, and the tokens a step accepts depend on the drafts anyway."""
        gen = r.generator if r.generator is not None else self.generator
        left = p
        for c in children:
            x = d[c]
            if torch.rand((), generator=gen).item() * float(left.sum()) < left[x].item():
                toks.append(x)
                return c
            left = left.clone() if left is p else left
            left[x] = 0.0
        toks.append(int(self._draw(left[None], torch.rand(1, dtype=torch.float64, generator=gen))[0]))
        return -2

    def _logprobs(
        self, raw_lp: torch.Tensor, ids: torch.Tensor, reqs: Sequence[SamplingState]
    ) -> list[TokenLogprobs | None]:
        sampled = raw_lp.gather(1, ids[:, None])
        ranks = ((raw_lp > sampled).sum(dim=-1) + 1).tolist()
        n_top = max(r.params.logprobs or 0 for r in reqs)
        top_lp, top_ids = raw_lp.topk(n_top, dim=-1) if n_top else (None, None)
        sampled_l = sampled[:, 0].tolist()
        out: list[TokenLogprobs | None] = []
        for i, r in enumerate(reqs):
            n = r.params.logprobs
            if n is None:
                out.append(None)
            elif n == 0:
                out.append(TokenLogprobs(logprob=sampled_l[i], rank=ranks[i]))
            else:
                out.append(
                    TokenLogprobs(
                        logprob=sampled_l[i],
                        rank=ranks[i],
                        top_ids=top_ids[i, :n].tolist(),  # type: ignore[index]
                        top_logprobs=top_lp[i, :n].tolist(),  # type: ignore[index]
                    )
                )
        return out


def _temperature_only(p: SamplingParams, vocab: int) -> bool:
    """Random sampling with nothing but a temperature (the OpenAI API's default request)."""
    return (p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p <= 0.0


NUCLEUS_CANDIDATES = 1024  # top-p looks at the top 1024 logits first (a full sort is costly per row)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus (the top token always survives).

    Works on the top max(1024, top-k) candidates; a row whose nucleus does not end inside them
    (a flat distribution) falls back to the full sort."""
    vocab = logits.shape[1]
    ks = top_k[top_k < vocab]
    c = min(vocab, max(NUCLEUS_CANDIDATES, int(ks.max()) if len(ks) else 0))
    if c == vocab:
        return _top_k_top_p_sorted(logits, top_k, top_p)
    vals, order = logits.topk(c, dim=-1)
    kmask = torch.arange(c)[None, :] >= top_k[:, None]
    masked = vals.masked_fill(kmask, float("-inf"))
    in_cands = top_k <= c  # the top-k renormalisation lies inside the candidates
    lse = torch.where(in_cands[:, None], masked.logsumexp(-1, keepdim=True), logits.logsumexp(-1, keepdim=True))
    probs = (masked - lse).exp()
    mask = kmask | ((probs.cumsum(dim=-1) - probs) > top_p[:, None])
    mask[:, 0] = False
    out = torch.full_like(logits, float("-inf")).scatter_(1, order, vals.masked_fill(mask, float("-inf")))
    unfiltered = (top_k >= vocab) & (top_p >= 1.0)  # a row of the batch that asked for neither
    out[unfiltered] = logits[unfiltered]
    flat = ~(in_cands | mask[:, -1] | unfiltered)  # the nucleus runs past the candidates
    if flat.any():
        out[flat] = _top_k_top_p_sorted(logits[flat], top_k[flat], top_p[flat])
    return out


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    pos = torch.arange(logits.shape[1])[None, :]
    mask = pos >= top_k[:, None]
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    mask |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]
    mask[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(mask, float("-inf")))
