"""axonserve -> vLLM: one `StepResult` becomes vLLM's `ModelRunnerOutput`.

Every request of the plan gets a row (vLLM indexes by `req_id_to_index`); a request that did
not sample (a partial prefill chunk) gets `[]`. Sample logprobs become `LogprobsLists` rows of
[sampled, top-1..top-k] (zeros where a row has no logprobs; vLLM slices each request's own
count). Prompt logprobs arrive per chunk and are returned whole, as vLLM's runner does, in
the step that completes the prefill.
"""

from __future__ import annotations

import numpy as np
from vllm.v1.outputs import LogprobsLists, LogprobsTensors, ModelRunnerOutput

from axonserve.frontends.vllm_plugin.mirror import Mirror, RequestMirror
from axonserve.frontends.vllm_plugin.version import check_vllm_version
from axonserve.protocol.messages import StepPlan, StepResult, TokenLogprobs

check_vllm_version()


def plan_order(plan: StepPlan) -> list[str]:
    return [r.request_id for r in plan.new] + [r.request_id for r in plan.cached]


def runner_output(plan: StepPlan, result: StepResult, mirror: Mirror) -> ModelRunnerOutput:
    """vLLM's view of the step; advances the mirror (computed counts, sampled tokens)."""
    req_ids = plan_order(plan)
    index = {rid: i for i, rid in enumerate(req_ids)}
    for rid, n in zip(req_ids, plan.num_scheduled_tokens):
        mirror.requests[rid].num_computed_tokens += n
    sampled: list[list[int]] = [[] for _ in req_ids]
    lps: list[TokenLogprobs | None] = [None] * len(req_ids)
    for j, (rid, tok) in enumerate(zip(result.request_ids, result.sampled_token_ids)):
        i = index.get(rid)
        if i is None:
            raise RuntimeError(f"axonserve rank 0 sampled for request {rid}, which step {plan.step_id} did not run")
        sampled[i] = [tok]
        mirror.requests[rid].token_ids.append(tok)
        if result.logprobs is not None:
            lps[i] = result.logprobs[j]
    for chunk in result.prompt_logprobs:
        m = mirror.requests[chunk.request_id]
        for k, entry in enumerate(chunk.logprobs):
            m.prompt_logprobs[chunk.start + k] = entry
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index=index,
        sampled_token_ids=sampled,
        logprobs=_logprobs_lists(lps, sampled) if any(x is not None for x in lps) else None,
        prompt_logprobs_dict=_prompt_logprobs(req_ids, mirror),
    )


def _logprobs_lists(lps: list[TokenLogprobs | None], sampled: list[list[int]]) -> LogprobsLists:
    k = max(len(x.top_ids) for x in lps if x is not None)
    ids = np.zeros((len(lps), k + 1), dtype=np.int64)
    vals = np.zeros((len(lps), k + 1), dtype=np.float32)
    ranks = np.zeros(len(lps), dtype=np.int64)
    for i, x in enumerate(lps):
        if x is None:
            continue
        n = len(x.top_ids)
        ids[i, 0], vals[i, 0], ranks[i] = sampled[i][0], x.logprob, x.rank
        ids[i, 1 : n + 1], vals[i, 1 : n + 1] = x.top_ids, x.top_logprobs
    return LogprobsLists(ids, vals, ranks)


def _prompt_logprobs(req_ids: list[str], mirror: Mirror) -> dict[str, LogprobsTensors | None]:
    """Whole-prompt tensors for the requests whose prefill completed this step."""
    out: dict[str, LogprobsTensors | None] = {}
    for rid in req_ids:
        m = mirror.requests[rid]
        k = m.params.prompt_logprobs
        if k is None or m.prompt_logprobs_sent or m.num_computed_tokens < m.num_prompt_tokens:
            continue
        m.prompt_logprobs_sent = True
        out[rid] = _prompt_tensors(m, k)
        m.prompt_logprobs.clear()
    return out


def _prompt_tensors(m: RequestMirror, k: int) -> LogprobsTensors:
    import torch

    n = m.num_prompt_tokens - 1  # token 0 has no logprob
    missing = [p for p in range(1, n + 1) if p not in m.prompt_logprobs]
    if missing:
        raise RuntimeError(f"axonserve's ranks returned no prompt logprobs for positions {missing[:5]}...")
    ids = torch.zeros(n, k + 1, dtype=torch.int32)
    vals = torch.zeros(n, k + 1, dtype=torch.float32)
    ranks = torch.zeros(n, dtype=torch.int32)
    for row in range(n):
        e = m.prompt_logprobs[row + 1]
        ids[row, 0], vals[row, 0], ranks[row] = m.token_ids[row + 1], e.logprob, e.rank
        ids[row, 1 : len(e.top_ids) + 1] = torch.tensor(e.top_ids, dtype=torch.int32)
        vals[row, 1 : len(e.top_logprobs) + 1] = torch.tensor(e.top_logprobs, dtype=torch.float32)
    return LogprobsTensors(ids, vals, ranks)
