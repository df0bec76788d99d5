"""The worker's persistent block table: one int64 row per request it holds.

A step's table for the attention metadata is then one fancy-index copy of the scheduled rows
instead of a Python loop over every request's block list (vLLM v1 keeps its `BlockTable` the
same way). Rows are updated by the plan's diff: a new request writes its blocks once, a cached
one appends the blocks it got this step, a dropped one frees its row.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, rows: int = 64, width: int = 64):
        self.table = np.zeros((rows, width), dtype=np.int64)
        self.count = np.zeros(rows, dtype=np.int64)  # block ids held by each row
        self._free = list(range(rows - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        """A row for a new request holding `block_ids`."""
        if not self._free:
            old = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.count = np.concatenate([self.count, np.zeros_like(self.count)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self.count[row] = 0
        self.extend(row, block_ids)
        return row

    def extend(self, row: int, block_ids: list[int]) -> None:
        """Append block ids to a row (the blocks a request got this step)."""
        if not block_ids:
            return
        n = int(self.count[row])
        end = n + len(block_ids)
        if end > self.table.shape[1]:
            width = max(end, 2 * self.table.shape[1])
            grown = np.zeros((len(self.table), width), dtype=np.int64)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown
        self.table[row, n:end] = block_ids
        self.count[row] = end

    def free(self, row: int) -> None:
        self.count[row] = 0
        self._free.append(row)

    def clear(self) -> None:
        self.count[:] = 0
        self._free = list(range(len(self.table) - 1, -1, -1))

    def rows(self, rows: list[int]) -> np.ndarray:
        """[len(rows), their longest count] copy of these rows, in this order (entries past a
        row's own count are stale ids of earlier requests: `block_table_array` zeroes them)."""
        idx = np.asarray(rows, dtype=np.int64)
        width = int(self.count[idx].max()) if len(idx) else 0
        return self.table[:, :width][idx]
