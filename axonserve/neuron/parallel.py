"""Tensor-parallel group state and the three collectives the model needs (gloo on CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import structlog

log = structlog.get_logger()


class TPInfo:
    """Rank and world size of the tensor-parallel group (1 process = rank 0 of 1)."""

    rank: int = 0
    size: int = 1


def init_tensor_parallel(rank: int, size: int, init_method: str | None) -> None:
    """Join the group (unless the caller already did) before any model is built."""
    if size > 1 and not dist.is_initialized():
        if not init_method:
            raise ValueError("tensor parallelism needs an init_method (tcp://host:port) for torch.distributed")
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
        log.info("tp.joined", rank=rank, size=size)
    TPInfo.rank, TPInfo.size = rank, size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if TPInfo.size > 1:
        if x.dtype == torch.float32:
            dist.all_reduce(x)
        else:  # reduce low-precision partial sums in float32
            y = x.float()
            dist.all_reduce(y)
            x.copy_(y)
    return x


def tp_all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dim."""
    if TPInfo.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(TPInfo.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def tp_broadcast_ids(ids: list[int]) -> list[int]:
    """Rank 0's sampled ids, so every rank appends the same tokens to its request state."""
    if TPInfo.size == 1:
        return ids
    t = torch.tensor(ids, dtype=torch.long)
    dist.broadcast(t, src=0)
    return t.tolist()
