"""Sequence parallelism over the tensor-parallel ranks (NxDI's), for long prefills.

Plain tensor parallelism runs the residual stream, the RMSNorms and the residual adds on all T
tokens of a step on every rank, and all-reduces after o_proj and down_proj. With sequence
parallelism each rank holds only its token shard of the residual stream (T padded to a multiple
of the group size, s = T / size rows each): the norms and adds run on s rows; an all-gather along
tokens rebuilds the whole batch before qkv_proj and gate_up_proj (attention and the MLP need
every token); the row-parallel layers reduce-scatter along tokens instead of all-reducing
(`parallel.tp_reduce` while `TPInfo.sequence_parallel` is set); the final norm runs on the shard
and one all-gather hands the whole [T, H] back, so callers see the plain forward's output.

An all-reduce moves what a reduce-scatter plus an all-gather move, so the traffic is the same;
what SP saves is the norm/add work and activation memory of the (size - 1) / size tokens a rank
no longer holds. It runs only for steps of at least `threshold` tokens (decodes stay plain TP)
and only for dense Llama-family decoders: the MoE block's own collectives (expert parallelism,
sharded experts) expect the whole batch, so those models are refused at start-up. The fused
native stack runs at TP=1 only, where this never applies. Every rank runs the same plan, so
every rank takes the same branch and the collectives pair up.

docs/benchmarks.md#fig-sequence-parallel has when it pays on this machine (it did not, on gloo
and 2 cores: the default is off).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
import torch
from torch import nn

from axonserve.neuron.parallel import TPInfo, tp_all_gather_tokens, tp_token_shard

if TYPE_CHECKING:
    from axonserve.config import EngineConfig
    from axonserve.neuron.models.llama import LlamaModel

log = structlog.get_logger()


class SequenceParallel:
    """This process's setting (one rank per process) and its counter."""

    threshold: int = 0  # steps of at least this many tokens run sequence-parallel; 0: off
    forwards: int = 0  # forwards that ran sequence-parallel since the last take_forwards()


def configure(config: EngineConfig, model: nn.Module) -> None:
    """Turn SP on for this rank's model (after loading), or refuse a model it cannot run."""
    SequenceParallel.threshold, SequenceParallel.forwards = 0, 0
    if not config.sequence_parallel or TPInfo.size == 1:
        return
    from axonserve.neuron.layers.moe import SparseMoeBlock
    from axonserve.neuron.models.llama import LlamaModel

    arch = type(model).__name__
    if not any(isinstance(m, LlamaModel) for m in model.modules()):
        raise ValueError(f"--sequence-parallel is not supported for {arch} (Llama-family decoders only)")
    if any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        raise ValueError(f"--sequence-parallel is not supported for MoE models ({arch})")
    SequenceParallel.threshold = config.sequence_parallel_threshold
    log.info("sequence_parallel.on", threshold=SequenceParallel.threshold, ranks=TPInfo.size)


def takes(num_tokens: int) -> bool:
    """Whether a forward over this many tokens runs sequence-parallel (the same on every rank)."""
    return 0 < SequenceParallel.threshold <= num_tokens and TPInfo.size > 1


def take_forwards() -> int:
    """Forwards that ran sequence-parallel since the last call (StepResult.sp_forwards)."""
    n, SequenceParallel.forwards = SequenceParallel.forwards, 0
    return n


def forward(
    model: LlamaModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[Any],
    meta: Any,
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """LlamaModel.forward with the residual stream sharded along tokens: the same math, the same
    [T, H] final-norm output on every rank."""
    total = positions.shape[0]
    SequenceParallel.forwards += 1
    TPInfo.sequence_parallel = True
    try:
        # the embedding's partial sums are reduce-scattered; images' rows arrive whole: sliced
        x = model.embed_tokens(input_ids) if inputs_embeds is None else tp_token_shard(inputs_embeds)
        cos, sin = (model.rotary.cos, model.rotary.sin) if meta.native is not None else model.rotary(positions)
        for layer, kv in zip(model.layers, kv_caches):
            n = layer.input_layernorm(x)
            h = layer.self_attn(tp_all_gather_tokens(n, total), cos, sin, kv, meta)  # o_proj: reduce-scatter
            n = layer.post_attention_layernorm(x, residual=h)  # h += x (the new residual), n = norm(h)
            x = h + layer.mlp(tp_all_gather_tokens(n, total))  # down_proj: reduce-scatter
        return tp_all_gather_tokens(model.norm(x), total)
    finally:
        TPInfo.sequence_parallel = False
