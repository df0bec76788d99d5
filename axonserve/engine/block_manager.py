"""Paged KV block accounting with prefix caching (the scheduler's side; tensors live in workers).

Blocks hold `block_size` token slots. A full block is named by a chained hash of (parent
block's hash, its token ids, extra keys such as image hashes), so equal prefixes map to
equal hash chains. The hash is keyed BLAKE2b (128 bits) over a canonical msgpack encoding,
with a random key per block manager (per engine): a client cannot craft a prompt whose
blocks collide with another request's and read its KV (vLLM's CVE-2025-25183 was Python's
`hash()` here). Hashes are only compared within one scheduler; nothing else relies on them.
A new request reuses every leading block already cached (refcounted, shared read-only) and
computes only the rest. Freed blocks keep their hash and stay findable in an LRU free list
until the pool needs them (lazy eviction), so a finished
conversation's prefix is still a hit for the next turn. Block tables are append-only; with a
sliding-window model (`window`) a running request's leading blocks past the window go back to the
pool and leave placeholders (engine/sliding_window.py).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict

import msgspec

from axonserve.engine import sliding_window
from axonserve.engine.request import Request

_encode = msgspec.msgpack.Encoder().encode


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_key: bytes | None = None,
        window: int | None = None,
    ):
        """hash_key: the prefix-hash key (default: 32 random bytes, fresh per instance).
        window: the model's ModelConfig.kv_window (None: every block is kept while the request runs)."""
        self.window = window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id (full, computed blocks)
        self._hash_key = os.urandom(32) if hash_key is None else hash_key
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        """Fraction of blocks referenced by a request (0 for an empty pool: an encoder's)."""
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    # ------------------------------------------------------------------ hashing

    def update_hashes(self, req: Request) -> None:
        """Extend `req.block_hashes` over every full block of its known tokens."""
        bs, hashes, toks, key = self.block_size, req.block_hashes, req.token_ids, self._hash_key
        while (len(hashes) + 1) * bs <= len(toks):
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            data = _encode((parent, toks[i * bs : (i + 1) * bs], req.extra_keys))
            hashes.append(hashlib.blake2b(data, digest_size=16, key=key).digest())

    # ------------------------------------------------------------------ allocation

    def match_prefix(self, req: Request) -> int:
        """Attach the longest cached prefix to a request with no blocks; returns tokens hit.

        At most `num_tokens - 1` tokens: the last one is recomputed to get logits."""
        if not self.enable_prefix_caching or req.block_ids:
            return 0
        self.update_hashes(req)
        limit = (req.num_tokens - 1) // self.block_size
        for h in req.block_hashes[:limit]:
            bid = self.cached.get(h)
            if bid is None:
                break
            if self.ref_cnt[bid] == 0:
                del self._free[bid]
            self.ref_cnt[bid] += 1
            req.block_ids.append(bid)
        req.num_cached_blocks = len(req.block_ids)
        return len(req.block_ids) * self.block_size

    def ensure(self, req: Request, num_tokens: int) -> bool:
        """Grow `req.block_ids` to hold `num_tokens` slots; False (nothing taken) if short."""
        if self.window is not None:
            sliding_window.release(self, req, self.window)
        need = self.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            bid, _ = self._free.popitem(last=False)
            h = self.block_hash[bid]
            if h is not None:  # evict: this block's old content is gone
                if self.cached.get(h) == bid:
                    del self.cached[h]
                self.block_hash[bid] = None
            self.ref_cnt[bid] = 1
            req.block_ids.append(bid)
        return True

    def cache_computed(self, req: Request, upto: int | None = None) -> None:
        """Publish the request's full blocks whose KV is computed by the end of the plan being
        made or run: those of its first `upto` tokens (default: its computed tokens)."""
        upto = req.num_computed_tokens if upto is None else upto
        if not self.enable_prefix_caching or upto // self.block_size <= req.num_cached_blocks:
            return  # (no block filled since the last call: a decode step, 15 times out of 16)
        self.update_hashes(req)
        full = min(upto // self.block_size, len(req.block_hashes))
        for i in range(max(req.num_cached_blocks, req.num_released_blocks), full):
            bid, h = req.block_ids[i], req.block_hashes[i]
            if self.block_hash[bid] is None:
                self.block_hash[bid] = h
                self.cached.setdefault(h, bid)  # a duplicate computed concurrently stays private
        req.num_cached_blocks = max(req.num_cached_blocks, full)

    def unref(self, bid: int) -> None:
        self.ref_cnt[bid] -= 1
        if self.ref_cnt[bid] == 0:
            self._free[bid] = None

    def drop_cached(self) -> None:
        """Forget every cached prefix (the workers that held its KV are gone)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks

    def free(self, req: Request) -> None:
        """Return the request's blocks; tail blocks first in LRU order (evicted first)."""
        for bid in reversed(req.block_ids[req.num_released_blocks :]):
            self.unref(bid)
        req.block_ids = []
        req.num_released_blocks = 0
        req.num_blocks_sent = 0
        req.num_cached_blocks = 0
