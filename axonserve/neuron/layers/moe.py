"""Sparse mixture-of-experts block (Qwen3-MoE): softmax top-k router and SwiGLU experts.

Two ways to spread the experts over the tensor-parallel ranks:
- default (vLLM's): every rank holds every expert with its intermediate dim split, like a
  column/row-parallel MLP per expert; the combined output is all-reduced once.
- expert parallel (`TPInfo.expert_parallel`): rank r holds experts [r*E/N, (r+1)*E/N) whole.
  The hidden states are replicated over the ranks, so each rank routes its own slice of the
  tokens, sends every (token, expert) pair to the expert's owner with all_to_all, gets the
  expert outputs back the same way, combines its slice, and the slices are all-gathered.

Checkpoints come with one tensor per expert and projection (`experts.{e}.gate_proj.weight`,
as transformers saves them) or fused 3-D (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); both load through `weight_loader`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axonserve.neuron.layers.linear import linear
from axonserve.neuron.parallel import TPInfo, all_to_all, all_to_all_equal, tp_all_gather_rows, tp_all_reduce


class FusedMoE(nn.Module):
    """This rank's experts: gate+up [E_local, 2*I_local, H] and down [E_local, H, I_local]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        tp, rank = TPInfo.size, TPInfo.rank
        self.num_experts = num_experts
        self.expert_parallel = TPInfo.expert_parallel and tp > 1
        if self.expert_parallel:
            if num_experts % tp:
                raise ValueError(f"expert parallelism needs the {num_experts} experts to split evenly over {tp} ranks")
            self.num_local, self.first, self.inter = num_experts // tp, rank * (num_experts // tp), intermediate
        else:
            if intermediate % tp:
                raise ValueError(f"expert intermediate size {intermediate} does not split over {tp} ranks")
            self.num_local, self.first, self.inter = num_experts, 0, intermediate // tp
        self.full_inter = intermediate
        self.gate_up_proj = _param((self.num_local, 2 * self.inter, hidden), dtype, self._load_gate_up)
        self.down_proj = _param((self.num_local, hidden, self.inter), dtype, self._load_down)

    # ------------------------------------------------------------------ loading

    def _local(self, e: int) -> int | None:
        """Local index of global expert e, or None when another rank owns it."""
        i = e - self.first
        return i if 0 <= i < self.num_local else None

    def _inter_slice(self, w: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of an expert's intermediate dim (all of it under expert parallelism)."""
        return w if self.expert_parallel else w.narrow(dim, TPInfo.rank * self.inter, self.inter)

    def _load_gate_up(self, param: nn.Parameter, w: torch.Tensor, shard: tuple[int, int] | None = None) -> None:
        """shard (expert, 0 gate | 1 up) for a per-expert [I, H] tensor; None for fused [E, 2I, H]."""
        if shard is None:
            w = w.narrow(0, self.first, self.num_local)
            for part in (0, 1):
                half = w.narrow(1, part * self.full_inter, self.full_inter)
                param.data.narrow(1, part * self.inter, self.inter).copy_(self._inter_slice(half, 1))
            return
        e, part = shard
        i = self._local(e)
        if i is not None:
            param.data[i].narrow(0, part * self.inter, self.inter).copy_(self._inter_slice(w, 0))

    def _load_down(self, param: nn.Parameter, w: torch.Tensor, shard: int | None = None) -> None:
        """shard: expert for a per-expert [H, I] tensor; None for fused [E, H, I]."""
        if shard is None:
            param.data.copy_(self._inter_slice(w.narrow(0, self.first, self.num_local), 2))
            return
        i = self._local(shard)
        if i is not None:
            param.data[i].copy_(self._inter_slice(w, 1))

    # ------------------------------------------------------------------ compute

    def run_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: rows grouped by local expert, counts[i] rows for local expert i. SwiGLU per group."""
        out = torch.empty_like(x)
        start = 0
        for i, n in enumerate(counts):
            if n:
                gate, up = linear(x[start : start + n], self.gate_up_proj[i]).chunk(2, dim=-1)
                out[start : start + n] = linear(F.silu(gate) * up, self.down_proj[i])
            start += n
        return out

    def forward(self, x: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] with each token's top-k (weights, expert ids) -> [T, H] weighted expert sum
        (partial over the intermediate shards: the caller all-reduces)."""
        k = topk_ids.shape[1]
        flat = topk_ids.flatten()
        order = flat.argsort(stable=True)  # (token, k) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        y = self.run_experts(x[order // k], counts)
        return _combine(y, order, topk_w)

    def forward_expert_parallel(self, x: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's routed token slice x [t, H] -> [t, H]: pairs travel to the expert owners and back."""
        n, k, e_local = TPInfo.size, topk_ids.shape[1], self.num_local
        flat = topk_ids.flatten()
        order = flat.argsort(stable=True)  # grouped by expert, hence by owner rank
        counts = torch.bincount(flat, minlength=self.num_experts)  # [E]: chunk d = rank d's experts
        recv_counts = all_to_all_equal(counts).view(n, e_local)  # [source, my expert]
        send_splits = counts.view(n, e_local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        got = all_to_all(x[order // k], send_splits, recv_splits)  # source-major, expert-minor
        expert_of_row = torch.arange(e_local).repeat(n).repeat_interleave(recv_counts.flatten())
        by_expert = expert_of_row.argsort(stable=True)
        y = torch.empty_like(got)
        y[by_expert] = self.run_experts(got[by_expert], recv_counts.sum(0).tolist())
        back = all_to_all(y, recv_splits, send_splits)  # in this rank's `order`
        return _combine(back, order, topk_w)


def _combine(y: torch.Tensor, order: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """Expert outputs y (rows in `order` of the flat (token, k) pairs) -> sum_k w * y per token."""
    t, k = topk_w.shape
    pairs = torch.empty_like(y)
    pairs[order] = y
    return (pairs.view(t, k, y.shape[-1]) * topk_w.unsqueeze(-1)).sum(1)


class SparseMoeBlock(nn.Module):
    """transformers' Qwen3MoeSparseMoeBlock: router `gate` (replicated) + `experts`."""

    def __init__(
        self, num_experts: int, top_k: int, hidden: int, intermediate: int, norm_topk_prob: bool, dtype: torch.dtype
    ):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.gate.weight.requires_grad_(False)
        self.experts = FusedMoE(num_experts, hidden, intermediate, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (weights, expert ids) per token, with transformers' float32 softmax and rounding."""
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.experts.expert_parallel:
            w, ids = self.route(x)
            return tp_all_reduce(self.experts(x, w, ids))
        per_rank = -(-x.shape[0] // TPInfo.size)  # rank r routes tokens [r*per_rank, (r+1)*per_rank)
        mine = x[TPInfo.rank * per_rank : (TPInfo.rank + 1) * per_rank]
        w, ids = self.route(mine)
        return tp_all_gather_rows(self.experts.forward_expert_parallel(mine, w, ids), per_rank, x.shape[0])


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p
