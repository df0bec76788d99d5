"""What the executor remembers of each request: the axonserve ranks' view of it.

vLLM sends a request's tokens once and then only diffs; so do we, to the ranks. Keeping the
ranks' view here (tokens, blocks, computed count) lets the plan translation notice whenever
vLLM's view differs — a resume after preemption, a request left out of the previous step —
and re-send that request whole instead of trusting a diff that no longer applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from axonserve.protocol.messages import SamplingParams, TokenLogprobs


@dataclass
class RequestMirror:
    params: SamplingParams
    num_prompt_tokens: int
    token_ids: list[int]  # prompt + sampled so far
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # prompt_logprobs: entries by prompt position (1..), emitted once when the prefill completes
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False


@dataclass
class Mirror:
    requests: dict[str, RequestMirror] = field(default_factory=dict)
    pending_finished: set[str] = field(default_factory=set)  # to tell the ranks with the next plan
