"""Paged attention for mixed prefill + decode batches on CPU.

KV cache per layer: K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim].
Token position p of a sequence lives at slot block_ids[p // block_size] * block_size + p % block_size.

The flat token batch is ordered decodes first (one query token each), then prefill chunks.
`AttentionMetadata` holds every index and mask for one step; it is built once by the
runner from Python lists (vectorised with numpy) and shared by all layers, so per-layer
code does no Python work per token and no host syncs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from axonserve.neuron.layers import fp8
from axonserve.neuron.ops.window import apply_window
from axonserve.speculative.tree import tree_depths


def block_table_array(block_tables: list[list[int]] | np.ndarray, need: np.ndarray) -> np.ndarray:
    """[n, max(need)] int64: row i holds sequence i's first need[i] block ids, zeros after.
    `block_tables`: a list per sequence, or an int64 array whose row i holds at least need[i]
    ids (the runner's persistent table, `neuron/block_table.py`: no Python loop per sequence)."""
    width = int(need.max()) if len(need) else 0
    if isinstance(block_tables, np.ndarray):
        if block_tables.shape[1] < width:
            raise ValueError(f"block table of width {block_tables.shape[1]} for {width} blocks")
        table = np.array(block_tables[:, :width], dtype=np.int64)  # (a copy: the caller's stays)
        table[np.arange(width)[None, :] >= need[:, None]] = 0
        return table
    table = np.zeros((len(need), width), dtype=np.int64)
    for i, ids in enumerate(block_tables):
        k = int(need[i])
        table[i, :k] = ids[:k]
    return table


@dataclass
class PrefillSeq:
    """One prefill (or chunked-prefill) sequence: query tokens [start, end) of the flat batch."""

    start: int
    end: int
    context_len: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor | None = None  # blocks covering context + chunk (only if context_len > 0)
    mask: torch.Tensor | None = None  # [q, context + q] bool, causal offset by the context


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long
    num_decodes: int = 0  # flat tokens [0, num_decodes) are single-token decodes
    decode_block_table: torch.Tensor | None = None  # [B, max_blocks] long (padded with block 0)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSeq] = field(default_factory=list)
    # the first prefills when they are short, equal-length chunks with a context (speculative
    # verification: 1 + k tokens each): one batched SDPA instead of one per sequence
    short: tuple[int, int] = (0, 0)  # (number of such sequences, their query length)
    short_block_table: torch.Tensor | None = None  # [S, max_blocks] long
    short_mask: torch.Tensor | None = None  # [S, q, max_blocks * block_size] bool, causal after the context
    # bucketing mode, context encoding: the flat batch is [batch, query_len] row-major, every
    # sequence padded to query_len; K/V come from the cache through a padded block table
    static_prefill: tuple[int, int] | None = None  # (batch, query_len) bucket
    prefill_block_table: torch.Tensor | None = None  # [batch, kv_len / block_size] long
    prefill_mask: torch.Tensor | None = None  # [batch, 1, query_len, kv_len] bool
    # fused C++ kernels (ops/native.py): all rows read their K/V blocks in place instead of the
    # gather + SDPA paths above (whose tables are then not built)
    native: ModuleType | None = None
    native_rows: int = 0
    native_block_table: torch.Tensor | None = None  # [sequences, max_blocks] long
    native_row_seq: torch.Tensor | None = None  # [native_rows] long: the row's block-table row
    native_row_kv_len: torch.Tensor | None = None  # [native_rows] long: keys the row attends to
    native_row_extra: torch.Tensor | None = None  # [native_rows, E] long: draft-tree keys past kv_len (-1: none)
    native_idx: torch.Tensor | None = None  # flat rows the kernel takes when not all (long chunks: SDPA)
    # sliding-window layers (ops/window.py): this metadata's window (None: full attention), and
    # how to build the same step's metadata for another window (`for_window`, once per window)
    window: int | None = None
    rebuild: Callable[[int], AttentionMetadata] | None = None
    by_window: dict[int, AttentionMetadata] = field(default_factory=dict)

    def for_window(self, window: int | None) -> AttentionMetadata:
        """This step's metadata for a layer with this sliding window (None: this one)."""
        if window is None or window == self.window:
            return self
        m = self.by_window.get(window)
        if m is None:  # without a rebuild: native rows only (DecodeRun), which the kernel windows itself
            if self.rebuild is None and (self.native is None or self.prefills):
                raise ValueError("this step's metadata cannot be rebuilt for a sliding window")
            m = self.rebuild(window) if self.rebuild else dataclasses.replace(self, window=window, by_window={})
            self.by_window[window] = m
        return m

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]] | np.ndarray,
        block_size: int,
        native: ModuleType | None = None,
        trees: dict[int, list[int]] | None = None,
        window: int | None = None,
        native_chunks: bool = False,
    ) -> "AttentionMetadata":
        """Sequences must come decodes (query_len == 1) first, then prefills, in flat-batch order.
        native: the kernels module, when the model's dtype has native kernels.
        trees: sequence index -> its drafts' parents (speculative/tree.py; speculative verification of a
        draft tree: query row 0 is the last known token, row 1 + j draft j). Its rows occupy
        consecutive slots but sit at position context + depth and attend to the context plus their
        ancestors.
        window: a sliding window (ops/window.py); layers get it through `for_window`.
        native_chunks: the native kernel takes prefill chunks of any length too (`takes_chunks`),
        so none goes to SDPA."""
        if native is not None and not trees and window is None and query_lens and max(query_lens) == 1:
            meta = cls._native_decodes(context_lens, block_tables, block_size, native)
        else:
            meta = cls._build(query_lens, context_lens, block_tables, block_size, native, trees, window, native_chunks)
        if window is None:
            args = (query_lens, context_lens, block_tables, block_size, native, trees)
            meta.rebuild = functools.partial(cls.build, *args, native_chunks=native_chunks)
        return meta

    @classmethod
    def _native_decodes(
        cls, context_lens: list[int], block_tables: list[list[int]] | np.ndarray, block_size: int, native: ModuleType
    ) -> "AttentionMetadata":
        """`_build` for a batch of single-token decodes on the native kernels (the steady state of
        serving), without the general case's per-token bookkeeping: the same fields, fewer numpy calls."""
        ctx = np.asarray(context_lens, dtype=np.int64)
        n = len(ctx)
        table = block_table_array(block_tables, ctx // block_size + 1)
        slots = table[np.arange(n), ctx // block_size] * block_size + ctx % block_size
        return cls(
            positions=torch.from_numpy(ctx),
            slot_mapping=torch.from_numpy(slots),
            native=native,
            native_rows=n,
            native_block_table=torch.from_numpy(table),
            native_row_seq=torch.arange(n),
            native_row_kv_len=torch.from_numpy(ctx + 1),
        )

    @classmethod
    def _build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]] | np.ndarray,
        block_size: int,
        native: ModuleType | None,
        trees: dict[int, list[int]] | None,
        window: int | None,
        native_chunks: bool = False,
    ) -> "AttentionMetadata":
        n = len(query_lens)
        q = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray(context_lens, dtype=np.int64)
        seq_lens = ctx + q
        num_decodes = int(np.argmax(q != 1)) if (q != 1).any() else n
        assert (q[num_decodes:] != 1).all(), "decode sequences must precede prefills"
        blocks_needed = (seq_lens + block_size - 1) // block_size
        table = block_table_array(block_tables, blocks_needed)
        # positions and slots for every flat token
        seq_of_tok = np.repeat(np.arange(n), q)
        starts = np.cumsum(q) - q
        positions = np.arange(int(q.sum())) - np.repeat(starts, q) + np.repeat(ctx, q)
        slots = table[seq_of_tok, positions // block_size] * block_size + positions % block_size
        shapes = {i: tree_shape(par) for i, par in (trees or {}).items()}  # i -> (depth, ancestor mask)
        slot_pos = positions.copy()  # where each row's K/V is written (a tree row's position is its depth)
        for i, (depth, _) in shapes.items():
            positions[starts[i] : starts[i] + q[i]] = ctx[i] + depth
        meta = cls(positions=torch.from_numpy(positions), slot_mapping=torch.from_numpy(slots), native=native)
        if native is not None:
            # decodes, verifications and short chunks read their keys from the cache in place, one
            # kernel call per layer; chunks of NATIVE_MAX_QUERY+ tokens go to torch's flash SDPA,
            # whose blocked matmuls win once a chunk's queries x keys grow (the kernel's cost is
            # per query row: docs/benchmarks.md#fig-attention), unless the kernel runs chunks on
            # AMX tiles itself (native_chunks)
            long = np.nonzero(q >= NATIVE_MAX_QUERY)[0] if not native_chunks else np.zeros(0, np.int64)
            rows = np.arange(len(positions))
            if len(long):
                keep = np.ones(len(positions), dtype=bool)
                for i in long:
                    keep[starts[i] : starts[i] + q[i]] = False
                rows = np.nonzero(keep)[0]
                meta.native_idx = torch.from_numpy(rows)
            meta.native_rows = len(rows)
            meta.native_block_table = torch.from_numpy(table)
            meta.native_row_seq = torch.from_numpy(seq_of_tok[rows])
            kv_len = slot_pos + 1
            if shapes:
                extra = np.full((len(positions), 1 + max(int(d.max()) for d, _ in shapes.values())), -1, np.int64)
                for i, (_, anc) in shapes.items():
                    kv_len[starts[i] : starts[i] + q[i]] = ctx[i]
                    for r in range(int(q[i])):
                        seen = ctx[i] + np.flatnonzero(anc[r])
                        extra[starts[i] + r, : len(seen)] = seen
                meta.native_row_extra = torch.from_numpy(np.ascontiguousarray(extra[rows]))
            meta.native_row_kv_len = torch.from_numpy(kv_len[rows])
            prefill_seqs = [int(i) for i in long]
        else:
            meta.num_decodes = first = num_decodes
            if num_decodes:
                w = int(blocks_needed[:num_decodes].max())
                meta.decode_block_table = torch.from_numpy(np.ascontiguousarray(table[:num_decodes, :w]))
                mask = np.arange(w * block_size)[None, :] < seq_lens[:num_decodes, None]
                meta.decode_mask = torch.from_numpy(mask)[:, None, None, :]
            if n - first >= 2 and 1 < q[first] <= SHORT_QUERY and ctx[first] > 0:
                same = (q[first:] == q[first]) & (ctx[first:] > 0)
                num_short = int(np.argmin(same)) if not same.all() else n - first
                if num_short >= 2:
                    qs, sl = int(q[first]), slice(first, first + num_short)
                    w = int(blocks_needed[sl].max())
                    meta.short = (num_short, qs)
                    meta.short_block_table = torch.from_numpy(np.ascontiguousarray(table[sl, :w]))
                    key_pos = np.arange(w * block_size)[None, None, :]
                    limit = ctx[sl, None, None] + np.arange(qs)[None, :, None]
                    mask = key_pos <= limit
                    for i in range(first, first + num_short):
                        if i in shapes:
                            mask[i - first, :, ctx[i] : ctx[i] + qs] = shapes[i][1]
                    meta.short_mask = torch.from_numpy(mask)
                    first += num_short
            prefill_seqs = list(range(first, n))
        for i in prefill_seqs:
            p = PrefillSeq(start=int(starts[i]), end=int(starts[i] + q[i]), context_len=int(ctx[i]))
            if p.context_len:
                kv = int(seq_lens[i])
                p.block_ids = torch.from_numpy(table[i, : int(blocks_needed[i])].copy())
                p.mask = torch.ones(int(q[i]), kv, dtype=torch.bool).tril(diagonal=p.context_len)
                if i in shapes:
                    p.mask[:, p.context_len :] = torch.from_numpy(shapes[i][1])
            meta.prefills.append(p)
        if window is not None:
            return apply_window(meta, window, q, ctx, table, block_size, prefill_seqs, bool(shapes))
        return meta


def move_slots(kv_caches: list[tuple[torch.Tensor, ...]], src: list[int], dst: list[int]) -> None:
    """Copy every layer's cache rows (K, V and an int8 / fp8 cache's scales) at slots `src` to `dst`:
    a verified draft tree's accepted path into the consecutive positions it now holds."""
    s, d = torch.tensor(src), torch.tensor(dst)
    for layer in kv_caches:
        for t in layer:
            flat = fp8.as_bytes(t).view(t.shape[0] * t.shape[1], -1)
            flat.index_copy_(0, d, flat.index_select(0, s))


SHORT_QUERY = 16  # longest chunk the batched short-chunk path takes


def tree_shape(parents: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(depth [1 + n], ancestor-or-self mask [1 + n, 1 + n] bool) of the query rows of a draft
    tree given its drafts' parents: row 0 the root, row 1 + j draft j."""
    anc = np.eye(len(parents) + 1, dtype=bool)
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"draft {j} has parent {p}: parents must come first")
        anc[j + 1] |= anc[p + 1]
    return np.asarray(tree_depths(parents), dtype=np.int64), anc


class DecodeRun:
    """Metadata for the forwards of one multi-step plan (`ModelRunner._execute_steps`): every
    block the run writes is allocated before it starts, so the block table is built once and a
    forward only moves the positions on (with argmax-only sampling for greedy batches, a
    null-model forward's loop ran faster than with `build` each forward: docs/benchmarks.md#fig-attention).
    The sequences come longest run first: forward s takes the first m of them."""

    def __init__(
        self,
        context_lens: list[int],
        block_tables: list[list[int]],
        steps: list[int],
        block_size: int,
        native: ModuleType | None = None,
    ):
        self.ctx = np.asarray(context_lens, dtype=np.int64)
        self.block_tables, self.block_size, self.native = block_tables, block_size, native
        need = (self.ctx + np.asarray(steps, dtype=np.int64) + block_size - 1) // block_size
        self.table = block_table_array(block_tables, need)
        self.table_t = torch.from_numpy(self.table)
        self.seq = torch.arange(len(steps))

    def meta(self, s: int, m: int) -> AttentionMetadata:
        """Forward s of the run, over its first m sequences (one token each)."""
        pos = self.ctx[:m] + s
        if self.native is None:  # the torch path's gather tables and masks
            return AttentionMetadata.build([1] * m, pos.tolist(), self.block_tables[:m], self.block_size)
        bs = self.block_size
        slots = self.table[np.arange(m), pos // bs] * bs + pos % bs
        return AttentionMetadata(
            positions=torch.from_numpy(pos),
            slot_mapping=torch.from_numpy(slots),
            native=self.native,
            native_rows=m,
            native_block_table=self.table_t[:m],
            native_row_seq=self.seq[:m],
            native_row_kv_len=torch.from_numpy(pos + 1),
        )


NATIVE_MAX_QUERY = 128  # with native kernels, chunks this long or longer take the SDPA path


def takes_chunks(
    native: ModuleType | None, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, windowed: bool
) -> bool:
    """Whether the native kernel runs prefill chunks of any length (AttentionMetadata.build's
    native_chunks): flash attention on AMX tiles, or on AVX512-BF16's dot product without AMX
    (csrc/amx_attention.h), for bf16 models with a bf16 cache, head_dim 32 or 64 and no
    sliding-window layer (the chunk path has no window; those keep SDPA)."""
    return (
        native is not None
        and dtype == torch.bfloat16
        and cache_dtype == torch.bfloat16
        and not windowed
        and hasattr(native, "chunk_attention")
        and bool(native.chunk_attention(head_dim))
    )


def build_static(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    shape: tuple[str, int, int, int],
    pad_block: int,
    window: int | None = None,
) -> tuple[AttentionMetadata, np.ndarray, np.ndarray]:
    """Metadata for one step padded to a bucket shape (phase, batch, query_len, kv_len).

    Returns (meta, src, last): flat row r of the padded batch takes its input token from
    position src[r] of the unpadded flat batch (-1: padding, feed token 0), and last[i] is the
    padded row of sequence i's last token. Padding rows run at position 0, write their K/V
    into `pad_block` (a scratch block no request owns) and attend only to key 0, so they
    stay finite and touch no real slot; unused block-table entries point at `pad_block` and
    are masked. Shapes depend on the bucket only.
    """
    phase, nb, nq, kv = shape
    n = len(query_lens)
    q = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    width = kv // block_size
    table = np.full((nb, width), pad_block, dtype=np.int64)
    for i, ids in enumerate(block_tables):
        k = -(-int(ctx[i] + q[i]) // block_size)
        table[i, :k] = ids[:k]
    k_idx = np.arange(nq)
    real = np.zeros((nb, nq), dtype=bool)
    real[:n] = k_idx[None, :] < q[:, None]
    pos = np.zeros((nb, nq), dtype=np.int64)
    pos[:n] = ctx[:, None] + k_idx[None, :]
    pos = np.where(real, pos, 0)
    rows = np.arange(nb)[:, None]
    slots = table[rows, pos // block_size] * block_size + pos % block_size
    slots = np.where(real, slots, pad_block * block_size)
    starts = np.zeros(nb, dtype=np.int64)
    starts[:n] = np.cumsum(q) - q
    src = np.where(real, starts[:, None] + k_idx[None, :], -1).reshape(-1)
    last = np.arange(n) * nq + q - 1
    mask = np.arange(kv)[None, None, :] <= pos[:, :, None]  # causal within the real sequence
    if window is not None:  # ... and within the window (a padding row at 0 keeps key 0)
        mask &= np.arange(kv)[None, None, :] > pos[:, :, None] - window
    meta = AttentionMetadata(
        positions=torch.from_numpy(pos.reshape(-1)), slot_mapping=torch.from_numpy(slots.reshape(-1))
    )
    if phase == "decode":
        meta.num_decodes = nb
        meta.decode_block_table = torch.from_numpy(table)
        meta.decode_mask = torch.from_numpy(mask[:, :, None, :])  # [B, 1, 1, kv]
    else:
        meta.static_prefill = (nb, nq)
        meta.prefill_block_table = torch.from_numpy(table)
        meta.prefill_mask = torch.from_numpy(mask[:, None])  # [B, 1, Q, kv]
    meta.window = window
    if window is None:
        args = (query_lens, context_lens, block_tables, block_size, shape, pad_block)
        meta.rebuild = lambda w: build_static(*args, w)[0]
    return meta, src, last


def quantize_kv(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] rows for an int8 KV cache: codes round(x / s), s = max|x| / 127 (at least 1e-30),
    float32 scales [...]; the native rotary_kv_write computes the same bits. An FP8 code dtype:
    layers/fp8.py quantize_rows."""
    if dtype != torch.int8:
        return fp8.quantize_rows(x, dtype)
    xf = x.float()
    s = (xf.abs().amax(-1) / 127).clamp_min(1e-30)
    return (xf / s[..., None]).clamp(-127, 127).round().to(torch.int8), s


def _gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, scales: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Whole blocks as contiguous rows: index_select on a 2-D view beats fancy indexing
    (docs/benchmarks.md#fig-attention).
    An int8 / fp8 cache comes back dequantized (codes x their row's scale) in `dtype`."""
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids)
    if scales is None:
        return rows
    s = scales.view(scales.shape[0], -1).index_select(0, block_ids)
    return (rows.view(*s.shape, -1).float() * s[..., None]).to(dtype).view(rows.shape)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    write_cache: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens, written into the caches first unless
    the caller did (the fused rotary kernel). Returns [T, Hq, D]. k_scale / v_scale: an int8
    or fp8 cache's float32 scales [blocks, block_size, Hkv] (`--kv-cache-dtype int8|fp8*`)."""
    _, bs, hkv, d = k_cache.shape
    if write_cache:
        for x, cache, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            if sc is None:
                cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, x)
            else:
                codes, s = quantize_kv(x, cache.dtype)
                fp8.as_bytes(cache).view(-1, hkv, d).index_copy_(0, meta.slot_mapping, fp8.as_bytes(codes))
                sc.view(-1, hkv).index_copy_(0, meta.slot_mapping, s)
    hq, nd = q.shape[1], meta.num_decodes
    if meta.native is not None:
        out = torch.empty(q.shape, dtype=q.dtype)
        if meta.native_rows:
            idx = meta.native_idx
            qn = q if idx is None else q.index_select(0, idx)
            on = out if idx is None else torch.empty(qn.shape, dtype=q.dtype)
            meta.native.paged_attention(
                on,
                qn,
                k_cache,
                v_cache,
                meta.native_block_table,
                meta.native_row_seq,
                meta.native_row_kv_len,
                scale,
                k_scale,
                v_scale,
                meta.native_row_extra,
                meta.window or 0,
            )
            if idx is not None:
                out.index_copy_(0, idx, on)
        _prefills(q, k, v, k_cache, v_cache, meta, scale, out, k_scale, v_scale)
        return out
    if meta.static_prefill is not None:
        nb, nq = meta.static_prefill
        bt = meta.prefill_block_table.view(-1)  # type: ignore[union-attr]
        kp = _gather_blocks(k_cache, bt, k_scale, q.dtype).view(nb, -1, hkv, d).transpose(1, 2)
        vp = _gather_blocks(v_cache, bt, v_scale, q.dtype).view(nb, -1, hkv, d).transpose(1, 2)
        qp = q.view(nb, nq, hq, d).transpose(1, 2)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.prefill_mask, scale=scale, enable_gqa=True)
        return op.transpose(1, 2).reshape(nb * nq, hq, d)
    out = torch.empty(q.shape, dtype=q.dtype) if meta.prefills or meta.short[0] else None
    if nd:
        # [B, Hkv, group, D]: the query heads sharing a KV head become the "query length" axis,
        # so GQA needs no K/V repeat and one SDPA call covers the whole decode batch.
        qd = q[:nd].view(nd, hkv, hq // hkv, d)
        bt = meta.decode_block_table.view(-1)  # type: ignore[union-attr]
        kd = _gather_blocks(k_cache, bt, k_scale, q.dtype).view(nd, -1, hkv, d).transpose(1, 2)
        vd = _gather_blocks(v_cache, bt, v_scale, q.dtype).view(nd, -1, hkv, d).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        if out is None:
            return od.reshape(nd, hq, d)
        out[:nd] = od.reshape(nd, hq, d)
    ns, qs = meta.short
    if ns:
        # like decode, with the query heads sharing a KV head times the chunk's tokens as the
        # query axis: row j * group + g is token j, query head g of the group
        grp = hq // hkv
        qg = q[nd : nd + ns * qs].view(ns, qs, hkv, grp, d).permute(0, 2, 1, 3, 4).reshape(ns, hkv, qs * grp, d)
        bt = meta.short_block_table.view(-1)  # type: ignore[union-attr]
        kg = _gather_blocks(k_cache, bt, k_scale, q.dtype).view(ns, -1, hkv, d).transpose(1, 2)
        vg = _gather_blocks(v_cache, bt, v_scale, q.dtype).view(ns, -1, hkv, d).transpose(1, 2)
        mask = meta.short_mask.repeat_interleave(grp, dim=1)[:, None]  # type: ignore[union-attr]
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
        out[nd : nd + ns * qs] = og.view(ns, hkv, qs, grp, d).permute(0, 2, 1, 3, 4).reshape(ns * qs, hq, d)
    _prefills(q, k, v, k_cache, v_cache, meta, scale, out, k_scale, v_scale)  # type: ignore[arg-type]
    return out  # type: ignore[return-value]


def _prefills(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The prefill chunks, one SDPA each (a first chunk attends to its own new K/V directly).
    Inputs are 4-D ([1, heads, tokens, D]): torch's CPU SDPA takes its flash kernel only then, and
    its much slower math path for 3-D inputs (docs/benchmarks.md#fig-attention)."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    for p in meta.prefills:
        qp = q[p.start : p.end].transpose(0, 1)[None]
        if p.context_len == 0:  # (a mask only for a chunk longer than a sliding window)
            kp, vp = k[p.start : p.end].transpose(0, 1)[None], v[p.start : p.end].transpose(0, 1)[None]
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
            )
        else:
            kv_len = p.mask.shape[1]  # type: ignore[union-attr]
            kp = _gather_blocks(k_cache, p.block_ids, k_scale, q.dtype).view(-1, hkv, d)[:kv_len].transpose(0, 1)[None]
            vp = _gather_blocks(v_cache, p.block_ids, v_scale, q.dtype).view(-1, hkv, d)[:kv_len].transpose(0, 1)[None]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=True)
        out[p.start : p.end] = op[0].transpose(0, 1)
