"""The batched LoRA matmul inside the base layers (Punica / S-LoRA style, segment-wise).

Every LoRA-carrying linear layer (qkv_proj, o_proj, gate_up_proj, down_proj) gets a `LoraSlots`:
`max_loras` adapter slots as stacked tensors, each padded to `max_lora_rank` with zero rows, so
an adapter of any rank (and any subset of target modules) fits any slot. A fused layer keeps one
A and one B per sub-projection (q/k/v, gate/up): A is stacked along the rank axis ([S*R, in]),
B is block-diagonal ([out, S*R]), so one shrink and one expand serve every sub-projection.

One forward serves rows of different adapters and base-model rows: `LoraBatch` (built once per
step by the runner, shared by every layer) groups the step's token rows by slot, and each
adapter's segment adds (x_seg A^T) B^T to the base output; base rows cost nothing. The scaling
is folded into B at load time. Row-parallel layers add their partial before the all-reduce,
so the sum over ranks is exact (the shrink is linear in the sharded input).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from axonserve.neuron.parallel import TPInfo

MAX_RUNS = 4  # a slot whose rows form more runs than this is gathered (index_select + index_add_)


@dataclass
class LoraBatch:
    """Which token rows of the current step run which slot: (slot, rows), rows a slice for each
    contiguous run of the slot's rows (no gather; the runner puts one adapter's decodes side by
    side, so a slot usually has a run of decodes and one per prefill chunk), or one index tensor
    when the rows are scattered. Empty: a base-only step."""

    segments: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)

    def set_rows(self, slot_per_request: list[int], tokens_per_request: list[int]) -> None:
        """The step's rows are the requests' tokens in order; slot -1 is the base model."""
        self.segments = []
        if not any(s >= 0 for s in slot_per_request):
            return
        per_row = np.repeat(np.asarray(slot_per_request, dtype=np.int64), tokens_per_request)
        for s in np.unique(per_row):
            if s < 0:
                continue
            idx = np.flatnonzero(per_row == s)
            cuts = np.flatnonzero(np.diff(idx) != 1) + 1  # where a new run starts
            if len(cuts) < MAX_RUNS:
                for run in np.split(idx, cuts):
                    self.segments.append((int(s), slice(int(run[0]), int(run[-1]) + 1)))
            else:
                self.segments.append((int(s), torch.from_numpy(idx)))


class LoraSlots:
    """The adapter slots of one base linear layer on this rank (see the module docstring).

    subs: per sub-projection (checkpoint module name, output offset in this rank's output, rows
    on this rank, first row of the full output this rank holds); row_parallel: A's input
    columns are sharded (o_proj, down_proj) instead of B's output rows."""

    def __init__(
        self,
        batch: LoraBatch,
        in_features: int,
        out_features: int,
        subs: list[tuple[str, int, int, int]],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        row_parallel: bool = False,
    ):
        self.batch, self.subs, self.max_rank, self.row_parallel = batch, subs, max_rank, row_parallel
        self.in_features = in_features
        n = len(subs) * max_rank
        self.a = torch.zeros(max_loras, n, in_features, dtype=dtype)
        self.b = torch.zeros(max_loras, out_features, n, dtype=dtype)
        self.active = [False] * max_loras  # a slot whose adapter targets none of this layer's modules is skipped

    def modules(self) -> tuple[str, ...]:
        return tuple(s[0] for s in self.subs)

    def shard(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a full (A [r, in], B [out, r]) pair: A like the base layer's input,
        B like its output."""
        for name, _off, size, start in self.subs:
            if name == module:
                if self.row_parallel:
                    n = self.in_features
                    return a.narrow(1, TPInfo.rank * n, n).contiguous(), b.contiguous()
                return a.contiguous(), b.narrow(0, start, size).contiguous()
        raise KeyError(module)

    def load(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill `slot` with an adapter's sharded (A, scaled B) per module (absent modules: zeros)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        r0 = 0
        active = False
        for i, (name, off, size, _start) in enumerate(self.subs):
            pair = weights.get(name)
            r0 = i * self.max_rank
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            self.a[slot, r0 : r0 + r].copy_(a)
            self.b[slot, off : off + size, r0 : r0 + r].copy_(b)
            active = True
        self.active[slot] = active

    def clear(self, slot: int) -> None:
        self.active[slot] = False

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output for rows x) plus each segment's adapter delta, in place."""
        for slot, rows in self.batch.segments:
            if not self.active[slot]:
                continue
            a, b = self.a[slot], self.b[slot]
            if isinstance(rows, slice):
                y[rows].addmm_(x[rows] @ a.t(), b.t())
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return y
