"""EAGLE drafting on the native decoder stack, over a head KV addressed by the target's block tables.

`eagle.propose` (the reference, and the trainer's and evaluator's path) copies each request's
dense head KV into a padded buffer and runs ~60 torch ops per draft step: on SmolLM2 the head's
matmuls were a minority of a proposal's time (docs/benchmarks.md#fig-speculative).
Here the head's one decoder layer is a one-layer `DecoderStack` (models/fused.py, no final norm)
and its keys/values live in a paged cache shaped like one target layer's: position p of a request
sits in the slot the target uses for p, so the native attention kernel reads them in place and
nothing per request is kept or copied. Draft positions past a request's allocated blocks go to
scratch blocks of its own for the call (as do a draft tree's nodes); the next catch-up pass
rewrites every position the target accepted with its real features.

Positions the head never saw (prefix-cache hits, steps that skipped drafting) hold whatever the
slot held: the dense path's zero-fill is as wrong, and drafts are verified either way.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from axonserve.neuron.layers.rotary import RotaryEmbedding
from axonserve.neuron.models import fused
from axonserve.speculative.eagle import ChainDrafts, EagleHead, PackedLinear, TreeDrafts


def _spec(m: torch.nn.Module) -> fused.LinearSpec | None:
    if isinstance(m, PackedLinear):
        return fused.linear_spec(None, m.bias, m.w)
    return fused.linear_spec(m.weight, m.bias)


class PagedDrafter:
    def __init__(
        self,
        head: EagleHead,
        native: Any,
        num_blocks: int,
        block_size: int,
        max_rows: int,
        max_position: int,
        scratch: int = 16,
    ):
        """scratch: positions each request of a call may need past its blocks (a chain's k, a
        tree's width * (depth - 1))."""
        self.head, self.block_size, self.num_blocks = head, block_size, num_blocks
        c, layer, dt = head.config, head.layer, head.dtype
        # the head's rotary table, long enough for any position the target may reach plus a draft chain
        # past it (k <= 16; the dense path clamps instead)
        rot = RotaryEmbedding(
            c.head_dim, max(c.max_position_embeddings, max_position) + 16, c.rope_theta, c.rope_scaling, torch.float32
        )
        self.max_position = rot.cos.shape[0] - 1
        self.stack = native.DecoderStack(
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.rms_norm_eps,
            c.head_dim**-0.5,
            fused.NONE,
            rot.cos.to(dt),
            rot.sin.to(dt),
        )
        if layer.packed_qkv is not None:
            qkv, gate_up = _spec(layer.packed_qkv), _spec(layer.packed_gate_up)
        else:
            qkv, gate_up = (fused.linear_spec(w, None) for w in layer.merged_weights())
        if not fused.add_layer(
            self.stack,
            layer.input_layernorm,
            layer.post_attention_layernorm,
            [qkv, _spec(layer.o_proj), gate_up, _spec(layer.down_proj)],
        ):
            raise ValueError("the head's linears are in a format the native stack does not take")
        # blocks 0..num_blocks-1 mirror the target's; then `spare` scratch blocks per row of a call
        self.max_rows, self.spare = max_rows, -(-scratch // block_size)
        shape = (num_blocks + max_rows * self.spare, block_size, c.num_kv_heads, c.head_dim)
        self.k, self.v = torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt)
        self.stack.set_caches([self.k], [self.v], [], [])

    @classmethod
    def maybe(
        cls, head: EagleHead, num_blocks: int, block_size: int, max_rows: int, max_position: int, scratch: int = 16
    ) -> PagedDrafter | None:
        """The native drafter where the kernels are built (and enabled), else None (the dense path)."""
        from axonserve.neuron.ops import native

        k = native.for_dtype(head.dtype)
        if k is None or not hasattr(k, "DecoderStack") or not fused.enabled():
            return None
        return cls(head, k, num_blocks, block_size, max_rows, max_position, scratch)

    @torch.inference_mode()
    def propose(
        self,
        block_tables: list[list[int]],
        starts: list[int],
        tokens: list[list[int]],
        feats: list[torch.Tensor],
        k: int,
        min_prob: float = 0.0,
        tree: tuple[int, int, list[int]] | None = None,
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        """As eagle.propose: request i's positions starts[i].. got features feats[i] and were followed
        by tokens[i]; returns up to k greedy drafts (target ids) each (k = 0: only the head KV grows)
        and None, or with tree = (width, depth, budgets) and k > 0, EAGLE-2 trees: (drafts, parents)."""
        b, bs, head = len(starts), self.block_size, self.head
        if b == 0 or k < 0:
            return [[] for _ in range(b)], None
        if tree is not None and tree[0] * (tree[1] - 1) > self.spare * bs:
            raise ValueError(f"a {tree[0]}-wide, {tree[1]}-deep tree needs more scratch than {self.spare * bs} slots")
        if b > self.max_rows:
            raise ValueError(f"{b} requests in one draft call, at most {self.max_rows}")
        n = np.array([len(t) for t in tokens], dtype=np.int64)
        start = np.asarray(starts, dtype=np.int64)
        # the last position written (a tree's nodes go to the scratch block), and the last one reached
        last_pos = start + n - 1 + (0 if tree else max(k - 1, 0))
        reach = start + n - 1 + (max(tree[1] - 1, 0) if tree and k > 0 else 0)
        if (n < 1).any() or int(max(last_pos.max(), reach.max())) > self.max_position:
            raise ValueError("every request needs >= 1 new token, within the head's positions")
        width = max(len(t) for t in block_tables) + self.spare
        table = np.zeros((b, width), dtype=np.int64)
        for i, ids in enumerate(block_tables):
            table[i, : len(ids)] = ids
            # scratch: draft positions past the allocated blocks
            table[i, len(ids) : len(ids) + self.spare] = self.num_blocks + i * self.spare + np.arange(self.spare)
            if last_pos[i] // bs >= len(ids) + self.spare:
                raise ValueError(f"request {i}: position {last_pos[i]} is past its blocks and the scratch blocks")
        tab = torch.from_numpy(table)

        def run(
            x: torch.Tensor,
            seq: np.ndarray,
            pos: np.ndarray,
            at: np.ndarray | None = None,
            kv_len: np.ndarray | None = None,
            extra: np.ndarray | None = None,
        ) -> torch.Tensor:
            """Rows at positions pos, their K/V written at position `at` (default: pos), attending to
            keys 0..kv_len-1 (default: through pos) and to the positions in extra [rows, E] (-1 pad)."""
            at = pos if at is None else at
            kv_len = pos + 1 if kv_len is None else kv_len
            slots = table[seq, at // bs] * bs + at % bs
            return self.stack.forward(
                x,
                torch.from_numpy(pos),
                torch.from_numpy(slots),
                tab,
                torch.from_numpy(seq),
                torch.from_numpy(kv_len),
                None if extra is None else torch.from_numpy(extra),
            )

        seq = np.repeat(np.arange(b), n)
        pos = np.concatenate([np.arange(s, s + m) for s, m in zip(start, n)])
        tok = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long)
        out = run(head.inputs(torch.cat(feats), tok), seq, pos)
        last = out[torch.from_numpy(np.cumsum(n) - 1)]  # [B, H]: f̂ at each request's first speculative position
        cur, rows = start + n - 1, np.arange(b)
        if tree is not None and k > 0:
            width, depth, budgets = tree
            # request i's scratch blocks start at its table's column len(block_tables[i])
            drafts = TreeDrafts(head, last, width, depth, np.array([len(t) * bs for t in block_tables]))
            seq = np.repeat(rows, width)
            while drafts.more():
                x, level, at, extra = drafts.inputs()
                drafts.grow(run(x, seq, cur[seq] + level, at, cur[seq] + 1, extra))
            return drafts.lists(budgets)
        chains, more = ChainDrafts(head, b, k, min_prob), k > 0
        while more:
            d, more = chains.add(last)
            if more:
                cur = cur + 1
                last = run(head.inputs(last, d), rows, cur)
        return chains.lists(), None
