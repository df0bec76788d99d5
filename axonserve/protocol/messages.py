"""Every message that crosses a process boundary.

Over 500 lines: the one wire format, every message type in one place (by design).

Structs are array-like msgpack (compact, positional), omit defaults (cheap to evolve: add
fields at the end with a default) and carry an integer tag so one decoder per socket can
dispatch a tagged union. Tensors never go inside a body: a `TensorRef` names the extra ZMQ
frame that holds the raw buffer (see `codec.py`).
"""

from __future__ import annotations

from typing import Union

import msgspec

from axonserve.config import RequestLimits
from axonserve.protocol.codec import TensorRef


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag_field="k"):
    """Base for wire messages (tag is the first array element)."""


# --------------------------------------------------------------------------- sampling


class StructuredOutputsParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """Output constrained to a grammar: `kind` "json" (JSON schema text), "regex", "choice"
    (JSON list of strings) or "grammar" (Lark/GBNF). JSON is compact unless any_whitespace."""

    kind: str
    spec: str
    any_whitespace: bool = False


_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def caller_request_id(engine_id: str) -> str:
    """The id the caller chose, from the engine's id for one of its choices: the client library
    sends `<id>@<tag>` (`<id>@<tag>-<i>` for choice i of n), fresh per generation."""
    base, _, rest = engine_id.partition("@")
    choice = rest.partition("-")[2]
    return f"{base}-{choice}" if choice else base


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """Per-request decoding parameters, vLLM-compatible names and defaults.

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` disable those filters.
    `stop` strings are matched by the client side (it detokenizes); the engine checks token ids.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (structured_output/grammar.py)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to +-100)
    allowed_token_ids: list[int] | None = None  # vLLM: only these may be sampled
    prompt_logprobs: int | None = None  # vLLM: logprobs (+ top-N) of every prompt token after the first

    def validate(self) -> "SamplingParams":
        """Raise ValueError with the offending parameter named; return self."""
        checks = [
            (self.n == 1, "n", "only n=1 is supported by the engine (the frontend fans out n>1)"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or a positive integer"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "must be <= max_tokens",
            ),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (all(s for s in self.stop), "stop", "stop strings must be non-empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0"),
            (
                all(-100.0 <= v <= 100.0 for v in (self.logit_bias or {}).values()),
                "logit_bias",
                "values must be in [-100, 100]",
            ),
            (all(t >= 0 for t in (self.logit_bias or {})), "logit_bias", "token ids must be >= 0"),
            (
                self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                "allowed_token_ids",
                "must not be empty",
            ),
            (all(t >= 0 for t in self.allowed_token_ids or []), "allowed_token_ids", "must be >= 0"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                "must be in [0, 20]",
            ),
        ]
        for param in ("seed", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            v = getattr(self, param)
            if v is not None and not _I64_MIN <= v <= _I64_MAX:
                raise ParamError(param, f"{param} must fit a signed 64-bit integer")
        for param in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            if any(t > _I64_MAX for t in getattr(self, param) or ()):
                raise ParamError(param, f"{param} token ids must fit a signed 64-bit integer")
        for ok, param, why in checks:
            if not ok:
                raise ParamError(param, f"{param} {why}")
        if self.structured_outputs is not None:
            from axonserve.structured_output.grammar import check  # llguidance, only when used

            check(self.structured_outputs)
        return self

    def check_limits(self, limits: RequestLimits) -> None:
        """Raise ParamError naming the first parameter past the engine's size bounds."""
        if len(self.stop) > limits.max_stop_strings:
            raise ParamError("stop", f"at most {limits.max_stop_strings} stop strings are allowed")
        if any(len(s) > limits.max_stop_string_chars for s in self.stop):
            raise ParamError("stop", f"a stop string may have at most {limits.max_stop_string_chars} characters")
        for name in ("logit_bias", "stop_token_ids"):
            if len(getattr(self, name) or ()) > limits.max_logit_bias:
                raise ParamError(name, f"{name} may have at most {limits.max_logit_bias} entries")
        so = self.structured_outputs
        if so is not None and len(so.spec.encode()) > limits.max_structured_output_bytes:
            raise ParamError(
                "structured_outputs",
                "the structured output constraint (schema, regex, grammar or "
                f"choices) is larger than {limits.max_structured_output_bytes} bytes",
            )

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ParamError naming the first token-id parameter with an id past the vocabulary
        (the sampler indexes logits with them: one bad id would fail the whole step)."""
        for name, ids in (
            ("logit_bias", self.logit_bias or {}),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("stop_token_ids", self.stop_token_ids),
        ):
            if any(t >= vocab_size for t in ids):
                raise ParamError(name, f"{name} token ids must be in [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


class ParamError(ValueError):
    """A request parameter is invalid; `param` names it (OpenAI error `param`)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


# --------------------------------------------------------------------------- client <-> scheduler


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """Marks a request for the pooling (embed) task: the whole prompt runs in one step and the
    request ends with one vector instead of tokens."""

    normalize: bool | None = None  # L2-normalize; None: the model's sentence-transformers default


class MultiModalInput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A prompt's images: where their placeholder runs sit in the prompt, their content hashes
    (encoder cache and prefix-cache keys), and the preprocessed pixels or the encoded features,
    each an extra frame of the message that carries this."""

    hashes: list[str]
    offsets: list[int]  # prompt position of each image's first placeholder token
    lengths: list[int]  # placeholder tokens of each image
    pixel_values: TensorRef | None = None  # [images, channels, height, width], to be encoded
    embeddings: TensorRef | None = None  # [sum(lengths), hidden]: the features, already encoded


class KVBlocks(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Prefill/decode disaggregation: a request's prompt KV, moved block by block, each block
    one extra frame [layers, 2 (K, V), block_size, kv_heads, head_dim] (the last block may
    hold slots past `num_tokens`; they are ignored)."""

    num_tokens: int
    blocks: list[TensorRef]
    request_id: str = ""


class LoraSpec(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The LoRA adapter a request runs with (axonserve/lora): `lora_id` is unique per loaded
    adapter for the engine's lifetime (a reloaded name gets a new id), `path` its PEFT directory."""

    name: str
    lora_id: int
    path: str


class AddRequest(_Msg, tag=1):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    pooling: PoolingParams | None = None  # set: an embed request (params are then unused)
    mm: MultiModalInput | None = None  # images (vision-language models)
    kv_export: bool = False  # P/D: send the prompt's KV back with the first token (delta.kv)
    # a request resumed after a scheduler restart (frontends/client.py): the tokens it had already
    # generated, which count as its outputs (max_tokens, min_tokens, penalties, seeded positions)
    output_token_ids: list[int] = []
    lora: LoraSpec | None = None  # run with this LoRA adapter (None: the base model)


class AbortRequest(_Msg, tag=2):
    request_ids: list[str]


class GetEngineInfo(_Msg, tag=3):
    """Ask the scheduler for `EngineInfo` (model, limits); a client's first message."""


class GetStats(_Msg, tag=4):
    """Ask the scheduler for an `EngineStats` snapshot."""


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprob of one sampled token plus the top-N alternatives (raw model distribution)."""

    logprob: float
    rank: int
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What changed for one request this step: new tokens only, plus finish info."""

    request_id: str
    new_token_ids: list[int] = []
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it, if any
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error_code: int = 0  # HTTP-style status for errors: 400 bad request, 503 overloaded, 500
    embedding: TensorRef | None = None  # pooling requests: the vector, an extra frame of `Outputs`
    # prompt_logprobs requests: entries for prompt tokens 1.. (token 0 has none), sent once,
    # with the first new token
    prompt_logprobs: list[TokenLogprobs] | None = None
    kv: KVBlocks | None = None  # kv_export requests: the prompt's KV, extra frames of `Outputs`


class Outputs(_Msg, tag=10):
    deltas: list[RequestDelta]
    timestamp: float = 0.0


class EngineInfo(_Msg, tag=11):
    model: str  # resolved model directory (tokenizer and config live there)
    served_model_name: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    eos_token_ids: list[int]
    vocab_size: int
    version: str = ""
    task: str = "generate"  # generate | embed (pooling.resolve_task)
    limits: RequestLimits = msgspec.field(default_factory=RequestLimits)  # what one request may ask


class EngineStats(_Msg, tag=13):
    """Scheduler counters and gauges (cumulative counters since start)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found
    num_preemptions: int = 0
    num_steps: int = 0  # plans
    num_forwards: int = 0  # model forwards they ran (more than plans with multi-step decoding)
    num_rejected_overload: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # bucketing mode: distinct static shapes the workers ran, (phase, batch, query_len, kv_len)
    # with phase "decode" (query_len 1) or "prefill"; empty when bucketing is off
    num_shapes: int = 0
    shapes: list[tuple[str, int, int, int]] = []
    # speculative decoding totals (vLLM's spec_decode counters)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # multimodal: images seen, of which served by the encoder cache (the encoder router's)
    mm_images: int = 0
    mm_cache_hits: int = 0
    sequence_parallel_forwards: int = 0  # forwards that ran sequence-parallel (--sequence-parallel)


class EngineDead(_Msg, tag=12):
    """The engine can no longer serve: every in-flight request has been failed."""

    reason: str


# --------------------------------------------------------------------------- scheduler <-> workers


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """First time a worker sees a request (or after preemption): all known tokens."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    pooling: PoolingParams | None = None
    mm: MultiModalInput | None = None  # its frames are extra frames of the StepPlan
    kv_export: bool = False  # P/D prefill: export the prompt's KV when the first token is sampled
    kv: KVBlocks | None = None  # P/D decode: the prompt's KV to import (extra frames of the StepPlan)
    lora: LoraSpec | None = None  # the request's LoRA adapter (None: the base model)


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the worker already holds: only the blocks added this step."""

    request_id: str
    new_block_ids: list[int] = []


class StepPlan(_Msg, tag=20):
    """One engine step. Scheduled requests are `new` then `cached`, in that order;
    `num_scheduled_tokens[i]` tokens starting at the request's computed count.
    A request samples when its computed count reaches its known token count."""

    step_id: int
    new: list[NewRequestData] = []
    cached: list[CachedRequestData] = []
    num_scheduled_tokens: list[int] = []
    finished_request_ids: list[str] = []  # finished, aborted or preempted: drop state
    # speculative decoding: draft tokens to verify, by request id. They are the last
    # len(drafts) of the request's scheduled tokens (not yet in its known tokens).
    draft_token_ids: dict[str, list[int]] = {}
    # a draft tree: draft j follows draft parents[j] (-1: the last known token); absent: a chain
    draft_parents: dict[str, list[int]] = {}
    # EAGLE (run by worker rank 0 right after the forward): extend the draft head over the
    # positions that become valid this step, then propose num_drafts[id] tokens for those requests
    want_features: bool = False
    num_drafts: dict[str, int] = {}
    # multi-step decoding: every scheduled request is a decode (one token left to compute) and
    # decodes its n scheduled tokens in n forwards, each fed the token the one before sampled
    multi_step: bool = False

    @property
    def num_forwards(self) -> int:
        """Model forwards this plan runs on each rank."""
        if not self.num_scheduled_tokens:
            return 0
        return max(self.num_scheduled_tokens) if self.multi_step else 1


class PromptLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprobs of prompt tokens `start`, `start`+1, ... of one request, computed this step."""

    request_id: str
    start: int
    logprobs: list[TokenLogprobs]


class StepResult(_Msg, tag=21):
    """Rank 0's answer: one sampled token per request that reached its end this step."""

    step_id: int
    request_ids: list[str] = []
    sampled_token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] | None = None  # aligned with request_ids
    forward_s: float = 0.0
    sample_s: float = 0.0
    error: str | None = None
    # bucketing mode: (phase, batch, query_len, kv_len) shapes this worker ran for the first time
    new_shapes: list[tuple[str, int, int, int]] = []
    prompt_logprobs: list[PromptLogprobs] = []
    # pooling requests finished this step and their vectors: a [len, dim] float32 extra frame
    pooled_request_ids: list[str] = []
    pooled: TensorRef | None = None
    # speculative decoding: tokens per request in request_ids (accepted drafts + one sampled);
    # empty means one each
    num_sampled: list[int] = []
    # EAGLE: drafts for the next step of the plan's num_drafts requests (a request may end first)
    draft_request_ids: list[str] = []
    draft_token_ids: list[list[int]] = []
    draft_parents: list[list[int]] = []  # aligned with draft_token_ids when they are trees; empty: chains
    kv_exports: list[KVBlocks] = []  # P/D prefill: prompt KV of kv_export requests sampled this step
    # XLA: seconds of each graph compilation this worker ran since its previous result, and the
    # persistent compile-cache hits since then (the scheduler forwards them as CompileStats)
    compile_s: list[float] = []
    compile_cache_hits: int = 0
    sp_forwards: int = 0  # forwards this step ran sequence-parallel (neuron/sequence_parallel.py)
    # requests the step could not run (their LoRA adapter failed to load on a rank): each ends with
    # its error (400); the rest of the step ran
    failed_request_ids: list[str] = []
    failed_errors: list[str] = []


class DraftRequest(_Msg, tag=22):
    """Scheduler -> drafter (draft model), after each step: request i's whole known sequence
    (tokens[offsets[i] : offsets[i] + counts[i]]) and `num_drafts[i]` wanted. The drafter
    drops the state of `finished_request_ids`."""

    step_id: int
    request_ids: list[str] = []
    counts: list[int] = []
    offsets: list[int] = []
    tokens: list[int] = []
    num_drafts: list[int] = []
    finished_request_ids: list[str] = []
    reply: bool = True  # False: no drafts wanted (only finished requests to drop), answer nothing


class DraftResult(_Msg, tag=23):
    """Drafter -> scheduler: draft token ids per request of the DraftRequest with k > 0."""

    step_id: int
    request_ids: list[str] = []
    draft_token_ids: list[list[int]] = []
    propose_s: float = 0.0
    error: str | None = None


# --------------------------------------------------------------------------- control plane


class Hello(_Msg, tag=30):
    name: str
    pid: int


class Ready(_Msg, tag=31):
    name: str
    info: dict[str, int | float | str | list[int | float]] = {}  # (floats: XLA compile seconds)


class Heartbeat(_Msg, tag=32):
    name: str
    t: float


class Shutdown(_Msg, tag=33):
    reason: str = ""


class ActorFailed(_Msg, tag=34):
    """Sent by an actor about itself (fatal error) or by the supervisor about a peer."""

    name: str
    reason: str


class Configure(_Msg, tag=35):
    """Supervisor -> actor after all peers are ready: facts learned at start-up."""

    info: dict[str, int | float | str | list[int | float]] = {}


class ActorRestarting(_Msg, tag=36):
    """Supervisor -> survivors: `name` (an actor, or "workers": a whole rank group) died or hung and
    is being replaced; work that depends on it pauses instead of failing."""

    name: str
    reason: str


class ActorRestarted(_Msg, tag=37):
    """Supervisor -> survivors: `name`'s replacement is ready (after `seconds`); `info`: what its
    Ready said (for "workers": the facts their scheduler was configured with)."""

    name: str
    seconds: float
    info: dict[str, int | float | str | list[int | float]] = {}


class RestartStats(_Msg, tag=38):
    """Stats bus: an actor was restarted (the supervisor has no stats socket: the scheduler sends it),
    and how many requests its restart resumed."""

    actor: str
    seconds: float
    requests_resumed: int = 0


# --------------------------------------------------------------------------- stats bus


class StepStats(_Msg, tag=40):
    """The scheduler's steps since its last StepStats, coalesced into one event (the publisher,
    engine/step.py, sends one per STATS_INTERVAL_S at most, and at once when the engine goes
    idle): counters are deltas summed over those steps, gauges the values after the last one,
    and what is observed once per step comes as lists with an entry per step. Requests that
    finished meanwhile ride along in `finished`. Dropped under back-pressure."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_forwards: int = 0  # model forwards the steps ran (a multi-step plan: several)
    dropped: int = 0  # earlier stats events this publisher dropped
    ttft_s: list[float] = []  # requests that got their first token in these steps
    itl_s: list[float] = []  # gaps before the other tokens of these steps
    # speculative decoding (deltas): verifications, drafted and accepted tokens, accepted by position
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # per step, one entry each (the step count is len(num_tokens)): tokens scheduled, and the
    # step's timeline: building the plan, encoding and publishing it to the workers, the worker's
    # forward and sampling, the rest of the round trip (transit, worker bookkeeping), applying the
    # result and building deltas; roundtrip: plan sent -> result received
    num_tokens: list[int] = []
    schedule_s: list[float] = []
    send_s: list[float] = []
    forward_s: list[float] = []
    sample_s: list[float] = []
    return_s: list[float] = []
    update_s: list[float] = []
    roundtrip_s: list[float] = []
    # shapes served (for `axonserve buckets plan`): per scheduled sequence, tokens this step
    # (query) and computed + scheduled tokens (KV), by phase (prefill chunk / decode token),
    # concatenated over the steps; *_seqs: how many of those entries each step has (a phase's
    # batch size; empty: the lists are one step's). decode_query_lens empty: one each.
    prefill_query_lens: list[int] = []
    prefill_kv_lens: list[int] = []
    prefill_seqs: list[int] = []
    decode_query_lens: list[int] = []
    decode_kv_lens: list[int] = []
    decode_seqs: list[int] = []
    finished: list[RequestStats] = []  # requests that finished meanwhile (any reason)
    engine: int = 0  # the data-parallel engine it is from (set when published: SchedulerActor.publish)


class RequestStats(_Msg, tag=41):
    """A request finished (any reason): published inside the next StepStats (`finished`)."""

    finish_reason: str
    e2e_s: float
    queue_s: float
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    max_tokens: int = 0
    engine: int = 0  # the data-parallel engine it is from (set when published: SchedulerActor.publish)


class ActorAlive(_Msg, tag=42):
    """Periodic liveness on the stats bus (every actor, with its heartbeat)."""

    actor: str
    pid: int
    dropped: int = 0


class GetMetrics(_Msg, tag=43):
    """Ask the metrics actor for the Prometheus text exposition."""


class MetricsText(_Msg, tag=44):
    text: str


# --------------------------------------------------------------------------- profiler, snapshots


class StartProfile(_Msg, tag=60):
    """Client -> scheduler: start torch.profiler on every worker rank (vLLM /start_profile)."""


class StopProfile(_Msg, tag=61):
    """Client -> scheduler: stop profiling; every rank writes its trace."""


class ProfileStatus(_Msg, tag=62):
    """Scheduler -> client: outcome of a Start/StopProfile. `code` is HTTP-style on failure
    (400: profiling not configured, 409: already running / not running, 500)."""

    action: str  # start | stop
    error: str | None = None
    code: int = 0
    files: list[str] = []  # traces written (rank 0's view of every rank's file)


class ProfileCommand(_Msg, tag=63):
    """Scheduler -> every worker rank, between steps."""

    action: str  # start | stop
    seq: int = 0
    stamp: int = 0  # shared by every rank's trace file name (time_ns at the scheduler)


class ProfileAck(_Msg, tag=64):
    """Worker rank 0 -> scheduler, once every rank has applied the command."""

    action: str
    seq: int = 0
    error: str | None = None
    code: int = 0
    files: list[str] = []


class SnapshotRecord(_Msg, tag=70):
    """Worker -> snapshot sink: one request's captured tensors for one forward pass.
    `step` is the output-token index the pass produces (0 = prefill); `tensors` names the
    extra frames (input_ids, positions, hidden.<layer>, logits)."""

    request_id: str
    step: int
    step_id: int
    rank: int = 0
    tensors: dict[str, TensorRef] = {}
    time: float = 0.0
    dropped: int = 0  # records this worker dropped before this one (sink lagging)


# --------------------------------------------------------------------------- multimodal encoding


class EncodeImages(_Msg, tag=80):
    """Scheduler -> encoder router (every image of a request), router -> one encoder (the
    images not in its cache): `pixel_values` is an extra frame, one row per hash."""

    request_id: str
    hashes: list[str]
    pixel_values: TensorRef


class ImagesEncoded(_Msg, tag=81):
    """Encoder -> router: `embeddings` [images, tokens, hidden] for the hashes asked.
    Router -> scheduler: [sum of tokens, hidden] for every image of the request, in order.
    `error` set: no embeddings (the request fails with `error_code`)."""

    request_id: str
    embeddings: TensorRef | None = None
    error: str | None = None
    error_code: int = 0
    num_cached: int = 0  # images served from the router's cache


class EncoderStats(_Msg, tag=45):
    """Encoder router -> metrics (deltas since the last event)."""

    images: int = 0
    cache_hits: int = 0
    encode_s: float = 0.0  # time the encoders spent on this router's jobs
    retries: int = 0  # jobs sent again after their encoder died


class CompileStats(_Msg, tag=46):
    """Scheduler -> metrics: XLA graph compilations worker rank 0 reported (at start-up, or
    with a step result): seconds of each, and persistent compile-cache hits."""

    seconds: list[float] = []
    cache_hits: int = 0
    engine: int = 0  # the data-parallel engine it is from (set when published: SchedulerActor.publish)


class BucketInfo(_Msg, tag=47):
    """Scheduler -> metrics, once ready: the engine limits and the buckets in force (empty
    lists: bucketing off), so `axonserve buckets plan` can compare against them."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    context_batch: list[int] = []
    context_len: list[int] = []
    decode_batch: list[int] = []
    decode_len: list[int] = []
    engine: int = 0  # the data-parallel engine it is from (set when published: SchedulerActor.publish)


StatsEvent = Union[StepStats, RequestStats, ActorAlive, EncoderStats, CompileStats, BucketInfo, RestartStats]

ClientToEngine = Union[AddRequest, AbortRequest, GetEngineInfo, GetStats, StartProfile, StopProfile]
EngineToClient = Union[Outputs, EngineInfo, EngineDead, EngineStats, ProfileStatus]
WorkerMsg = Union[StepPlan, Shutdown, ProfileCommand]
WorkerReply = Union[StepResult, ProfileAck]
Control = Union[Hello, Ready, Heartbeat, Shutdown, ActorFailed, Configure, ActorRestarting, ActorRestarted]
