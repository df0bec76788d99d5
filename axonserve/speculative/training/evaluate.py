"""How good a draft head is: simulated greedy chain (and tree) drafting, and what one draft step costs.

The simulation replays speculative decoding against the target's own greedy continuation
(whose features were recorded teacher-forced, i.e. exactly what verification would compute):
each round the drafter gets the features and tokens verification accepted, `propose` drafts k
tokens, the longest prefix equal to the greedy continuation is accepted plus the bonus token.
It drives the real `propose` + `DraftKV` path, crops included.
"""

from __future__ import annotations

import time

import torch

from axonserve.speculative.eagle import DraftKV, EagleHead, propose
from axonserve.speculative.training.data import Sequence
from axonserve.speculative.tree import tree_walk


def simulate_acceptance(head: EagleHead, seqs: list[Sequence], k: int, batch: int = 16, min_prob: float = 0.0) -> dict:
    """Mean accepted length (tokens per target forward = 1 + accepted drafts), acceptance per
    position, and drafts per round (fewer than k where min_prob stops chains)."""
    rounds, tokens, drafted = 0, 0, 0
    at_least = [0] * k  # rounds with >= i+1 drafts accepted
    for b0 in range(0, len(seqs), batch):
        group = [s for s in seqs[b0 : b0 + batch] if len(s.ids) >= s.prompt_len + k + 1]
        kvs = [DraftKV.for_head(head, capacity=len(s.ids) + k) for s in group]
        start = [0] * len(group)
        last = [s.prompt_len - 1 for s in group]  # last position whose feature the target has computed
        active = list(range(len(group)))
        while active:
            drafts = propose(
                head,
                [kvs[i] for i in active],
                [start[i] for i in active],
                [group[i].ids[start[i] + 1 : last[i] + 2] for i in active],
                [group[i].feats[start[i] : last[i] + 1] for i in active],
                k,
                min_prob,
            )
            still = []
            for i, d in zip(active, drafts):
                truth = group[i].ids[last[i] + 2 : last[i] + 2 + k].tolist()
                a = 0
                while a < len(d) and d[a] == truth[a]:
                    a += 1
                rounds, tokens, drafted = rounds + 1, tokens + 1 + a, drafted + len(d)
                for j in range(a):
                    at_least[j] += 1
                start[i], last[i] = last[i] + 1, last[i] + 1 + a
                if last[i] + k + 2 <= len(group[i].ids):
                    still.append(i)
            active = still
    p = [x / max(rounds, 1) for x in at_least]
    cond = [at_least[0] / max(rounds, 1)] + [at_least[j] / max(at_least[j - 1], 1) for j in range(1, k)]
    out = {
        "k": k,
        "rounds": rounds,
        "tokens": tokens,
        "mean_accepted_length": tokens / max(rounds, 1),
        "p_accepted_at_least": p,
        "conditional_acceptance": cond,
    }
    if min_prob:
        out.update(min_prob=min_prob, drafts_per_round=drafted / max(rounds, 1))
    return out


@torch.inference_mode()
def reference_tree(
    head: EagleHead, feats: torch.Tensor, toks: torch.Tensor, depth: int, width: int, budget: int
) -> tuple[list[int], list[int]]:
    """EAGLE-2's dynamic tree by full causal recompute of the head (the reference of the serving
    path's TreeDrafts): feats [T, H] are the target's features at positions 0..T-1, toks [T] the
    tokens that followed them. Each depth expands the `width` best nodes of the depth before (by
    cumulative draft log-prob) into their `width` best children; the `budget` best nodes are
    kept. Returns (draft tokens, parents), by depth then creation order; width 1 is the chain."""
    frontier: list[tuple[int, tuple[int, ...], float, list[torch.Tensor]]] = [(-1, (), 0.0, [])]
    nodes: list[tuple[int, int, float, int]] = []  # (token, parent node, score, depth)
    for level in range(1, depth + 1):
        f = torch.stack([torch.cat([feats, *(x[None] for x in fp)]) for _, _, _, fp in frontier])
        t = torch.stack([torch.cat([toks, torch.tensor(path, dtype=torch.long)]) for _, path, _, _ in frontier])
        out = head(f.to(head.dtype), t)[:, -1]
        top = torch.log_softmax(head.draft_logits(out).float(), -1).topk(width, dim=-1)
        children = []
        for (node, path, score, fp), o, lps, ids in zip(frontier, out, top.values.tolist(), top.indices.tolist()):
            for lp, i in zip(lps, ids):
                tok = int(head.d2t[i])
                nodes.append((tok, node, score + lp, level))
                children.append((len(nodes) - 1, path + (tok,), score + lp, fp + [o]))
        frontier = sorted(children, key=lambda c: -c[2])[:width]
    kept = sorted(sorted(range(len(nodes)), key=lambda j: -nodes[j][2])[:budget], key=lambda j: (nodes[j][3], j))
    where = {j: n for n, j in enumerate(kept)}
    return [nodes[j][0] for j in kept], [where.get(nodes[j][1], -1) for j in kept]


@torch.inference_mode()
def simulate_tree_acceptance(head: EagleHead, seqs: list[Sequence], depth: int, width: int, budget: int) -> dict:
    """What tree drafting (EAGLE-2's dynamic tree, `reference_tree`) would accept, greedy: the
    longest path equal to the target's greedy continuation, plus the bonus token. Width 1 is
    the chain of `depth`."""
    rounds = tokens = nodes = 0
    for s in seqs:
        last = s.prompt_len - 1
        while last + depth + 2 <= len(s.ids):
            drafts, parents = reference_tree(head, s.feats[: last + 1], s.ids[1 : last + 2], depth, width, budget)
            a = len(tree_walk(drafts, parents, s.ids[last + 2 : last + 2 + depth].tolist()))
            rounds, tokens, nodes = rounds + 1, tokens + 1 + a, nodes + len(drafts)
            last += 1 + a
    return {
        "depth": depth,
        "width": width,
        "budget": budget,
        "rounds": rounds,
        "mean_accepted_length": tokens / max(rounds, 1),
        "nodes_per_round": nodes / max(rounds, 1),
    }


@torch.inference_mode()
def draft_step_latency(
    head: EagleHead,
    full_lm_head: torch.Tensor,
    vocab_sizes: list[int],
    batches: tuple[int, ...] = (1, 8),
    context: int = 200,
    reps: int = 20,
) -> list[dict]:
    """Median ms of one draft step (propose with one new token, k=1: layer + draft lm_head + argmax)
    for each draft vocabulary size, with `context` cached positions per request."""
    saved = head.d2t, head.lm_head
    h = head.config.hidden_size
    out = []
    try:
        for n in vocab_sizes:
            head.d2t = torch.arange(n)
            head.lm_head = full_lm_head[:n].to(head.dtype).contiguous()
            for b in batches:
                kvs = [DraftKV.for_head(head, capacity=context + 8) for _ in range(b)]
                propose(head, kvs, [0] * b, [torch.randint(0, n, (context,))] * b, [torch.randn(context, h)] * b, 1)
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    propose(head, kvs, [context] * b, [torch.tensor([1])] * b, [torch.randn(1, h)] * b, 1)
                    times.append(time.perf_counter() - t0)
                out.append({"draft_vocab": n, "batch": b, "ms": round(1000 * sorted(times)[len(times) // 2], 3)})
    finally:
        head.d2t, head.lm_head = saved
    return out
