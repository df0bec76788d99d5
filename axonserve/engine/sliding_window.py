"""KV blocks of sliding-window models: give back what no query can see again (the scheduler's side).

When every layer of the model attends within a window (ModelConfig.kv_window: the largest layer
window; None when any layer attends to the whole sequence, and then nothing here runs), a query at
position p reads keys p - window < k <= p only, and the next query a request computes sits at
`num_computed_tokens`. So every block wholly before position num_computed_tokens - window + 1 is
dead for the rest of the request: `BlockManager.ensure` releases those blocks (`release`) before it
allocates new ones, in every path that grows a request (admission with a prefix hit, chunked
prefill, decode, bucketing), and a request's footprint stops growing at about window / block_size
+ 1 or 2 blocks (`blocks_held`; admission and `Scheduler.check` count that, not the full length).

- The block table keeps a placeholder (`PLACEHOLDER`, block 0) at each released index, so positions
  still map to table indices; workers never read it: their attention paths start at the window
  (neuron/ops/window.py, the native kernel's window argument; bucketed steps only mask it).
- Released blocks go back to the pool like finished ones: with their prefix hash, findable and
  reusable until the pool hands them out again (the hash is dropped then), so a prefix hit only
  ever finds blocks whose KV is still the one hashed. A block released before it was published is
  never published (`cache_computed` skips released indices); a later request then matches only up
  to it. This is the simple correct rule; a hit that could skip the blocks before its own window
  (vLLM's sliding-window prefix lookup) is left out.
- Preemption frees the request's held blocks (not the placeholders) and recomputes it from scratch.
- Plans in flight (async scheduling) stay correct: ranks run plans in order, so a block released for
  plan k+1 and reused by another request is written only after plan k has read it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from axonserve.config import EngineConfig
    from axonserve.engine.block_manager import BlockManager
    from axonserve.engine.request import Request
    from axonserve.neuron.config import ModelConfig

PLACEHOLDER = 0  # block table entry of a released block (a valid id: never read, see above)


def first_live_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """The first block a query at num_computed_tokens or later can see."""
    return max(num_computed_tokens - window + 1, 0) // block_size


def release(blocks: BlockManager, req: Request, window: int) -> None:
    """Give back req's blocks wholly before its window (oldest first in the LRU: evicted first)."""
    end = min(first_live_block(req.num_computed_tokens, window, blocks.block_size), len(req.block_ids))
    for i in range(req.num_released_blocks, end):
        blocks.unref(req.block_ids[i])
        req.block_ids[i] = PLACEHOLDER
    req.num_released_blocks = max(req.num_released_blocks, end)


def blocks_held(num_tokens: int, chunk: int, window: int | None, block_size: int) -> int:
    """The most blocks a request of num_tokens tokens, computed in steps of at most `chunk` tokens,
    holds at once: with a window, those of one step's queries and the window before them."""
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    return min(full, -(-(min(chunk, num_tokens) + window - 1) // block_size) + 1)


def check_supported(config: EngineConfig, layer_windows: list[int | None]) -> None:
    """Refuse, at start-up, the settings whose paths do not honour sliding windows (EngineConfig
    checks a model directory's config.json; every runner checks again what it loads)."""
    if not any(layer_windows) or config.disable_sliding_window:
        return
    clash = [
        name
        for name, on in (
            ("--device xla", config.device == "xla"),
            ("speculative decoding", config.speculative is not None),
            ("prefill/decode disaggregation (--role)", config.role != "both"),
        )
        if on
    ]
    if clash:
        w = max(x for x in layer_windows if x)
        raise ValueError(
            f"sliding-window attention (a {w}-token window on {sum(1 for x in layer_windows if x)} of "
            f"{len(layer_windows)} layers) is not supported with {clash[0]}; --disable-sliding-window "
            f"serves the model with full attention, exact up to the window (max_model_len {w})"
        )


def resolve(config: EngineConfig, mc: ModelConfig) -> tuple[ModelConfig, int | None]:
    """The model config a runner serves and the max_model_len it asks for: as loaded, after
    `check_supported`; with --disable-sliding-window (vLLM's flag) full attention on every layer,
    exact only while a sequence fits the smallest window, so max_model_len is capped there."""
    check_supported(config, mc.layer_windows)
    w = min((x for x in mc.layer_windows if x), default=None)
    if not config.disable_sliding_window or w is None:
        return mc, config.max_model_len
    if config.max_model_len and config.max_model_len > w:
        raise ValueError(
            f"--disable-sliding-window serves {mc.architecture} with full attention, exact only within its "
            f"{w}-token window: max_model_len {config.max_model_len} exceeds it; use --max-model-len {w} or less"
        )
    return dataclasses.replace(mc, layer_windows=[None] * len(mc.layer_windows)), min(
        config.max_model_len or w, mc.max_position_embeddings
    )


def check_model_dir(config: EngineConfig) -> None:
    """`check_supported` for a model directory, from its config.json (no torch)."""
    from axonserve.neuron.config import ModelConfig

    try:
        windows = ModelConfig.from_dir(config.model).layer_windows
    except (OSError, KeyError, ValueError, TypeError):
        return  # not a decoder this reads (an encoder, a vision tower): the runner decides
    check_supported(config, windows)
