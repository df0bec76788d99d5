"""vLLM -> axonserve: one `SchedulerOutput` becomes one `StepPlan`; vLLM's sampling
parameters become ours.

Mapping (vLLM's block ids ARE the ranks' KV block indices, one KV cache group):
- `scheduled_new_reqs` -> `NewRequestData` with the prompt, its blocks and its computed count
  (> 0 on a prefix-cache hit: those blocks already hold the KV);
- `scheduled_cached_reqs` -> `CachedRequestData` with the blocks added this step — unless the
  ranks' view (the mirror) differs from vLLM's: a resumed request (`resumed_req_ids`, blocks
  replaced, computed count reset), or a computed count or token list that does not match. Such
  a request is dropped (`finished_request_ids`) and re-sent whole (`new`, all its tokens from
  `all_token_ids` or the mirror), which is how axonserve's own scheduler resumes preemptions;
- `num_scheduled_tokens` follows our order: every `new` entry, then every `cached` one;
- `finished_req_ids` -> `finished_request_ids`.
vLLM keeps stop/EOS/max_tokens checks; the ranks only need the stop-token set for min_tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from axonserve.frontends.vllm_plugin.mirror import Mirror, RequestMirror
from axonserve.frontends.vllm_plugin.version import check_vllm_version
from axonserve.protocol.messages import CachedRequestData, NewRequestData, ParamError, SamplingParams, StepPlan

check_vllm_version()

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams as VllmSamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput

MAX_LOGPROBS = 20  # the ranks' sampler returns at most this many alternatives

# vLLM sampling features applied inside vLLM's own model runner, which this bridge replaces
_WORKER_SIDE = {
    "structured_outputs": "structured outputs (guided decoding)",
    "bad_words": "bad_words",
    "logprob_token_ids": "logprob_token_ids",
    "prompt_logprob_token_ids": "prompt_logprob_token_ids",
    "prompt_logprob_start": "prompt_logprob_start",
    "thinking_token_budget": "thinking_token_budget",
    "trace_decode_token_ids": "trace_decode_token_ids",
    "watermarking": "watermarking",
}


def unsupported(sp: VllmSamplingParams) -> tuple[str, str] | None:
    """(parameter, why) when axonserve's ranks cannot honour these vLLM sampling parameters."""
    for name, what in _WORKER_SIDE.items():
        if getattr(sp, name, None):
            return name, f"axonserve's vLLM executor does not support {what}"
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(sp, name)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            return name, f"axonserve's vLLM executor supports {name} from 0 to {MAX_LOGPROBS}, not {k}"
    return None


def sampling_params(sp: VllmSamplingParams) -> SamplingParams:
    """Our per-request parameters for the ranks' sampler (NotImplementedError: unsupported)."""
    bad = unsupported(sp)
    if bad is not None:
        raise NotImplementedError(bad[1])
    bias = {int(t): min(100.0, max(-100.0, float(b))) for t, b in sp.logit_bias.items()} if sp.logit_bias else None
    params = SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        seed=sp.seed,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        max_tokens=None,  # vLLM's scheduler stops the request
        min_tokens=sp.min_tokens,
        # vLLM masks all of its stop tokens (EOS included, even with ignore_eos) before min_tokens;
        # ignore_eos here keeps the ranks from adding their own EOS list to that mask
        stop_token_ids=sorted(sp.all_stop_token_ids),
        ignore_eos=True,
        logprobs=sp.logprobs,
        logit_bias=bias,
        allowed_token_ids=list(sp.allowed_token_ids) if sp.allowed_token_ids is not None else None,
        prompt_logprobs=sp.prompt_logprobs,
    )
    try:
        return params.validate()
    except ParamError as e:
        raise NotImplementedError(f"axonserve's vLLM executor cannot run these sampling parameters: {e}") from e


def _blocks(group_blocks: tuple[list[int], ...] | None) -> list[int]:
    if group_blocks is None:
        return []
    if len(group_blocks) != 1:
        raise NotImplementedError(f"axonserve's ranks hold one KV cache group, vLLM sent {len(group_blocks)}")
    return list(group_blocks[0])


def _check_new(nr) -> None:
    if nr.sampling_params is None or nr.pooling_params is not None:
        raise NotImplementedError(f"request {nr.req_id}: axonserve's vLLM executor serves generation only")
    if nr.prompt_token_ids is None or nr.prompt_embeds is not None:
        raise NotImplementedError(f"request {nr.req_id}: prompt embeddings are not supported by axonserve's ranks")
    if nr.mm_features:
        raise NotImplementedError(f"request {nr.req_id}: multimodal inputs are not supported by axonserve's ranks")
    if nr.lora_request is not None:
        raise NotImplementedError(f"request {nr.req_id}: LoRA is not supported by axonserve's ranks")


def _check_output(so: SchedulerOutput) -> None:
    if so.scheduled_spec_decode_tokens:
        raise NotImplementedError("speculative decoding tokens reached axonserve's vLLM executor")
    if so.scheduled_encoder_inputs:
        raise NotImplementedError("encoder inputs reached axonserve's vLLM executor")
    if so.kv_cache_block_copies:
        raise NotImplementedError("KV block copies (copy-on-write) are not supported by axonserve's ranks")
    if so.kv_connector_metadata is not None or so.ec_connector_metadata is not None:
        raise NotImplementedError("KV/EC connectors are not supported by axonserve's vLLM executor")


def _whole(rid: str, m: RequestMirror) -> NewRequestData:
    return NewRequestData(
        rid, list(m.token_ids), m.num_prompt_tokens, list(m.block_ids), m.num_computed_tokens, m.params
    )


def step_plan(so: SchedulerOutput, step_id: int, mirror: Mirror) -> StepPlan | None:
    """The ranks' plan for vLLM's step, None when it runs no token (its finished ids then wait
    for the next plan). Updates the mirror's blocks and views; the step's results update its
    tokens and computed counts (see output.py)."""
    _check_output(so)
    for rid in so.finished_req_ids:
        mirror.requests.pop(rid, None)
    if so.total_num_scheduled_tokens == 0:
        mirror.pending_finished |= so.finished_req_ids
        return None
    finished = mirror.pending_finished | set(so.finished_req_ids)
    mirror.pending_finished = set()
    new: list[NewRequestData] = []
    new_n: list[int] = []
    cached: list[CachedRequestData] = []
    cached_n: list[int] = []
    for nr in so.scheduled_new_reqs:
        _check_new(nr)
        prompt = list(nr.prompt_token_ids)
        m = RequestMirror(
            sampling_params(nr.sampling_params), len(prompt), prompt, _blocks(nr.block_ids), nr.num_computed_tokens
        )
        if nr.req_id in mirror.requests:  # a request id the ranks still hold: replace it
            finished.add(nr.req_id)
        mirror.requests[nr.req_id] = m
        new.append(_whole(nr.req_id, m))
        new_n.append(so.num_scheduled_tokens[nr.req_id])
    cr = so.scheduled_cached_reqs
    for i, rid in enumerate(cr.req_ids):
        m = mirror.requests.get(rid)
        if m is None:
            raise RuntimeError(f"vLLM scheduled request {rid}, which axonserve's vLLM executor never saw")
        added = _blocks(cr.new_block_ids[i])
        tokens = cr.all_token_ids.get(rid)
        resend = (
            rid in cr.resumed_req_ids
            or m.num_computed_tokens != cr.num_computed_tokens[i]
            or (tokens is not None and tokens != m.token_ids)
        )
        if resend:
            m.block_ids = added if rid in cr.resumed_req_ids else m.block_ids + added
            m.num_computed_tokens = cr.num_computed_tokens[i]
            if tokens is not None:
                m.token_ids = list(tokens)
            finished.add(rid)
            new.append(_whole(rid, m))
            new_n.append(so.num_scheduled_tokens[rid])
        else:
            m.block_ids.extend(added)
            cached.append(CachedRequestData(rid, added))
            cached_n.append(so.num_scheduled_tokens[rid])
    return StepPlan(
        step_id=step_id,
        new=new,
        cached=cached,
        num_scheduled_tokens=new_n + cached_n,
        finished_request_ids=sorted(finished),
    )
