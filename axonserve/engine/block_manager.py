"""Paged KV block accounting (the scheduler's side; tensors live in the workers).

Blocks are fixed-size (`block_size` token slots). A request owns a block table that only
grows (append-only, so the worker receives just the new ids) until it finishes, is
aborted or preempted, when every block returns to the free pool at once.
"""

from __future__ import annotations

from collections import deque

from axonserve.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ensure(self, req: Request, num_tokens: int) -> bool:
        """Grow `req.block_ids` to hold `num_tokens` slots; False (nothing taken) if short."""
        need = self.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        req.block_ids.extend(self._free.popleft() for _ in range(need))
        return True

    def free(self, req: Request) -> None:
        self._free.extend(reversed(req.block_ids))
        req.block_ids = []
        req.num_blocks_sent = 0

    def usage(self) -> float:
        return 1.0 - len(self._free) / max(self.num_blocks, 1)
