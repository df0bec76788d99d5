"""Engine configuration: one struct, built by the CLI or the offline API, handed to every actor.

It travels to child processes as JSON on their command line (msgspec, never pickle).
"""

from __future__ import annotations

import ipaddress
import os
import socket

import msgspec

METHODS = ("ngram", "eagle", "draft_model")


class SpeculativeConfig(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM's --speculative-config: who proposes draft tokens and how many per step."""

    # ngram (prompt lookup, in the scheduler) | eagle (draft head, run by worker rank 0 on the
    # step's own hidden states) | draft_model (a smaller LM, in the drafter actor)
    method: str
    # drafts verified per step: a chain's length, a draft tree's nodes. 0: the method's default, 12 for
    # eagle (a draft tree: 8, 10 and 12 nodes served at equal speed, 12 accepting the most; a 3-chain
    # accepted less; see docs/benchmarks.md#fig-config), 3 otherwise
    num_speculative_tokens: int = 0
    model: str = ""  # eagle: head directory ("" = the head shipped for the default model); draft_model: the model
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    prompt_lookup_max: int = 3  # ngram: longest suffix matched (tried first)
    # fall back to plain decoding while more requests than this decode at once (0: never);
    # verification turns compute-bound as the batch grows, so speculation stops paying. 8: eight
    # 3-row EAGLE verifications still fit the AMX path's flat cost (up to 32 rows), and served chat
    # at 8 and 16 streams still gained over plain decoding (docs/benchmarks.md#fig-config)
    disable_by_batch_size: int = 8
    # draft tokens plus their roots verified in one step across the batch (0: no limit): each request's
    # drafts shrink to fit (1 request: all k; 8 requests: 2 each). Each verified row adds to the
    # forward: three drafts for each of 8 requests cost more than they saved, and uncapped draft trees
    # at 8 streams ran slower than plain decoding (docs/benchmarks.md#fig-config)
    max_verify_rows: int = 24
    # a request whose recent acceptance rate falls below this pauses drafting for a while. Break-even
    # on SmolLM2 with the native stack: a k=3 EAGLE verification + proposal costs a little more than a
    # decode, so it pays from ~0.1 accepted per draft (docs/benchmarks.md#fig-config)
    min_acceptance_rate: float = 0.1
    # eagle: a draft chain stops after a draft the head gives less than this probability, so
    # num_speculative_tokens becomes the longest chain (0: always k; speculative/eagle.py ChainDrafts)
    min_draft_confidence: float = 0.0
    # eagle: EAGLE-2 draft trees when a step's drafts outnumber tree_depth (else a chain): each depth
    # expands the tree_width likeliest nodes into their tree_width best children, tree_depth deep, and
    # the likeliest nodes are verified in one forward (tree attention). 0: 4 wide; 1: chains only.
    # tree_width * (tree_depth - 1) <= 16
    tree_width: int = 0
    tree_depth: int = 4

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From --speculative-config JSON or the offline API's dict (vLLM's field names)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        try:
            return msgspec.convert(msgspec.json.decode(value) if isinstance(value, str) else value, cls).validate()
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ValueError(f"bad speculative config: {e}") from e

    def __post_init__(self) -> None:
        if not self.num_speculative_tokens:
            self.num_speculative_tokens = 12 if self.method == "eagle" else 3

    @property
    def tree(self) -> tuple[int, int] | None:
        """(width, depth) of EAGLE-2 draft trees (used when a step's drafts outnumber the depth),
        or None: chains only."""
        width = self.tree_width or (4 if self.method == "eagle" else 1)
        return (width, self.tree_depth) if width > 1 else None

    @property
    def uses_drafter(self) -> bool:
        """Proposals come from the drafter actor (else from the scheduler or worker rank 0)."""
        return self.method == "draft_model"

    def validate(self) -> "SpeculativeConfig":
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; supported: {', '.join(METHODS)}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method "draft_model" needs "model"')
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if self.tree is not None:
            if self.method != "eagle":
                raise ValueError('draft trees (tree_width > 1) are for method "eagle"')
            width, depth = self.tree
            if not 2 <= depth or width * (depth - 1) > 16:
                raise ValueError("draft trees need tree_depth >= 2 and tree_width * (tree_depth - 1) <= 16")
            if self.min_draft_confidence and self.num_speculative_tokens > self.tree_depth:
                raise ValueError("min_draft_confidence is for chains: a tree keeps its likeliest nodes already")
        if self.tree_width < 0:
            raise ValueError("tree_width must be >= 0")
        if self.max_verify_rows < 0 or self.disable_by_batch_size < 0:
            raise ValueError("max_verify_rows and disable_by_batch_size must be >= 0 (0: no limit)")
        if not 0.0 <= self.min_draft_confidence < 1.0:
            raise ValueError("min_draft_confidence must be in [0, 1)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        return self


def cpu_has_bf16() -> bool:
    """Native bfloat16 arithmetic (AVX512-BF16 or AMX): bf16 linears then beat float32
    (docs/benchmarks.md#fig-config)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(model_dir: str) -> str:
    """`--dtype auto` (the default of `serve` and `LLM`, as in vLLM): the checkpoint's precision.
    16-bit and quantized checkpoints (a GGUF's converted config says which) run in bfloat16
    where the CPU computes it natively, else float32 (float16 has no fast CPU path: vLLM-CPU
    casts it to bfloat16 too). Float32 checkpoints stay float32 (vLLM would downcast them;
    `--dtype bfloat16` trades transformers' reference precision for speed)."""
    import json

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return "float32"
    # transformers 5 writes `dtype`; a multimodal model's text config may carry it instead
    declared = (
        cfg.get("dtype")
        or cfg.get("torch_dtype")
        or (cfg.get("text_config") or {}).get("dtype")
        or (cfg.get("text_config") or {}).get("torch_dtype")
    )
    return "bfloat16" if declared in ("bfloat16", "float16") and cpu_has_bf16() else "float32"


class RequestLimits(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Bounds on what one request may ask of the engine: a request is hostile until bounded.

    The engine announces them in `EngineInfo`, so the client library refuses an oversized
    request before it is sent (HTTP 400 naming the parameter); the scheduler checks them again
    for clients that do not. vLLM leaves most of these unbounded."""

    # engine requests one API call may start: prompts x n for completions, inputs for embeddings
    max_fanout: int = 128
    max_stop_strings: int = 16  # OpenAI allows 4; vLLM any number
    max_stop_string_chars: int = 512  # a stop string holds back up to this many characters of a stream
    max_logit_bias: int = 1024  # logit_bias entries (also bounds stop_token_ids)
    max_structured_output_bytes: int = 64 * 1024  # a JSON schema, regex, grammar or choice list, serialized
    max_tools: int = 128  # tools in one chat request
    max_request_id_chars: int = 128  # request_id: also [A-Za-z0-9._:-] only (it is echoed in chunks and logs)

    def validate(self) -> "RequestLimits":
        for name in self.__struct_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        return self


QUANTIZATIONS = ("int8", "int4", "fp8")  # weight formats (neuron/layers/quant.py)
ACTIVATION_QUANTIZATIONS = ("int8",)  # block-code weights times int8 activations (layers/quant.py PanelWeight)
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names; fp8 = fp8_e4m3


# --sequence-parallel-threshold's default: the step token count from which sequence parallelism
# runs (docs/benchmarks.md#fig-sequence-parallel)
SEQUENCE_PARALLEL_THRESHOLD = 1024


class EngineConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str  # resolved model directory (config.json, weights, tokenizer)
    served_model_name: str = ""
    # generate | embed (pooling: whole prompt in one step, one vector); auto: from the model. Resolved (and
    # checked against the model) here, once, when the config is made: every actor reads the concrete task
    task: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # vLLM's flag: serve a sliding-window model with full attention, max_model_len capped at its
    # window (engine/sliding_window.py); off: windows honoured at any length
    disable_sliding_window: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.1  # of MemAvailable at worker start
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # schedule step N+1 while step N runs (vLLM's --async-scheduling): the ranks find the next plan
    # waiting when a step ends. Ignored with speculative decoding, bucketing and P/D disaggregation.
    # Off by default: on this 2-core machine the hand-off's idle time was other processes' CPU time
    # anyway (no throughput change measured: docs/benchmarks.md#fig-config); it pays where the scheduler
    # has a core of its own
    async_scheduling: bool = False
    # multi-step decoding (vLLM v0's --num-scheduler-steps): when every running request is
    # decoding and none waits for a seat, one plan has each decode up to this many tokens, the
    # worker feeding back its own samples between forwards. The scheduler, the bus and the
    # clients then work once per N tokens instead of once per token; the price: a request that
    # arrives meanwhile starts up to N-1 forwards later, tokens reach clients N at a time, and a
    # request that stops early computes up to N-1 discarded tokens (2N-1 with async scheduling,
    # which then has the next multi-step plan waiting when one ends)
    num_scheduler_steps: int = 1
    scheduling_policy: str = "fcfs"  # fcfs | priority
    # admission: beyond either bound a request gets 503 at once (0: unbounded). Requests count,
    # and so do their prompt tokens: a few huge prompts can hold the queue as long as many small ones
    max_waiting: int = 1024
    max_waiting_tokens: int = 1 << 20  # minutes of prefill on a 2-core CPU (docs/benchmarks.md#fig-config)
    # a request older than this (from its arrival at the scheduler) ends with an error (HTTP 408) and
    # frees its KV blocks; 0: no deadline
    request_timeout_s: float = 0.0
    limits: RequestLimits = msgspec.field(default_factory=RequestLimits)
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (resolve_dtype; the CLI and LLM default)
    quantization: str = ""  # weight-only int8 | int4 | fp8 (neuron/layers/quant.py); "" = as loaded
    # "int8": GGUF Q4_1 / Q8_0 weights served in float32 on AVX2 multiply activations rounded to int8
    # per block of 32 (llama.cpp's arithmetic): faster, approximate, opt-in; "" = exact float32
    activation_quantization: str = ""
    # KV cache storage (vLLM's --kv-cache-dtype): auto = the model's dtype; int8 / fp8 (= fp8_e4m3) /
    # fp8_e5m2 = codes with a float32 scale per (token, KV head), half the bytes a decode step's
    # attention reads (neuron/layers/fp8.py)
    kv_cache_dtype: str = "auto"
    num_workers: int = 1  # worker ranks (tensor parallel) of one engine
    # sequence parallelism over the tensor-parallel ranks (NxDI's): norms and residuals sharded along
    # tokens, all-gather before attention and the MLP, reduce-scatter after (neuron/parallel.py)
    sequence_parallel: bool = False
    # steps of at least this many tokens run sequence-parallel (smaller ones, decodes: plain TP)
    sequence_parallel_threshold: int = SEQUENCE_PARALLEL_THRESHOLD
    # multi-LoRA serving (axonserve/lora), vLLM's flags: adapters selected per request by model name
    enable_lora: bool = False
    lora_modules: list[str] = []  # name=path (PEFT directories) served from the start
    max_loras: int = 1  # adapters one step may hold (the ranks' adapter slots)
    max_lora_rank: int = 16  # adapters of a higher rank are refused
    max_cpu_loras: int = 0  # adapters kept loaded in host memory (LRU); 0: max_loras
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    # data parallelism: N independent engines (scheduler + num_workers ranks each) behind one frontend,
    # whose client routes each request (frontends/dp_client.py); this engine's index among them
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # where worker ranks run: mp = local processes; ray = Ray actors in a placement group, one bundle per
    # rank, possibly on other nodes (distributed/ray_executor.py; the bus then goes over CURVE tcp)
    distributed_executor_backend: str = "mp"
    ray_placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    ray_cpus_per_worker: float = 1.0
    enable_expert_parallel: bool = False  # MoE: experts split over the ranks (else each expert is sharded)
    seed: int = 0
    threads: int | None = None  # torch threads per worker; None: all cores / num_workers
    # Neuron bucketing mode: every step padded to static shapes (see engine/buckets.py);
    # empty bucket lists are derived from max_num_seqs / max_num_batched_tokens / max_model_len
    bucketing: bool = False
    # where the worker ranks run (axonserve/xla): cpu = eager PyTorch and our C++ kernels; xla = a
    # torch-xla device (PJRT: NeuronCores with torch-neuronx, TPU, or PJRT CPU), always bucketed and
    # compiled once per bucket at start-up; auto = xla when torch_neuronx imports, else cpu
    device: str = "cpu"
    compile_cache_dir: str = ""  # xla: the persistent compile cache's root ("": ~/.cache/axonserve/xla)
    context_batch_buckets: list[int] = []  # prefill (context encoding) batch sizes
    context_len_buckets: list[int] = []  # prefill chunk (query) lengths
    decode_batch_buckets: list[int] = []  # decode (token generation) batch sizes
    decode_len_buckets: list[int] = []  # KV lengths attended, both phases
    # multimodal (vision-language models): 0 encoder workers = the worker ranks encode images
    encoder_workers: int = 0  # encoder actor processes (vision tower + projector), fed by the router actor
    encoder_cache_mb: int = 256  # the router's image-feature cache (by image hash)
    encode_timeout_s: float = 60.0  # an encoder job older than this fails its request
    allowed_media_domains: list[str] = []  # hosts image_url may fetch http(s) from ("*": any); none: data: URLs only
    max_image_bytes: int = 10 * 2**20  # one image, encoded (PNG/JPEG...) bytes
    max_images_per_request: int = 8
    # one image's width * height, read from its header before decoding. 16 Mpx holds 4K frames
    # (8.3 Mpx) and 12-16 MP camera photos, which the processor shrinks to a few hundred pixels
    # anyway; it is 5x under PIL's 89 Mpx bomb warning, and one such image decodes to 48 MiB (RGB)
    max_image_pixels: int = 16 * 2**20
    # a request's images decoded, summed (width * height * channels), charged before each decode:
    # 128 MiB = two 16 Mpx images or a few phone photos; it bounds what one request can make the
    # frontend hold (a tiny PNG or 8 of them can otherwise decode to GBs)
    max_image_decoded_bytes_per_request: int = 128 * 2**20
    image_fetch_timeout_s: float = 10.0  # total (DNS, connect, headers, body) for all of a request's image URLs
    allow_private_image_urls: bool = False  # fetch image URLs resolving to private/loopback/link-local addresses
    # prefill/decode disaggregation (engine/disagg.py): both = one engine does everything;
    # decode = this engine decodes while a prefill engine (its own scheduler + worker pool, which
    # the supervisor starts with role prefill) computes prompts and sends their KV
    role: str = "both"  # both | prefill | decode
    # frontend
    host: str = "127.0.0.1"
    port: int = 8000
    # CORS, as vLLM's flags; no origin by default (no CORS middleware): browsers on other sites
    # cannot call the API unless --allowed-origins names them
    allowed_origins: list[str] = []
    allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    max_request_body_bytes: int = 32 * 2**20  # larger bodies get 413
    # bus: the largest frame a data socket accepts (ZMQ_MAXMSGSIZE; larger: the sender is
    # disconnected). 0: max(1 GiB, 128 MiB x max_images_per_request) (actors/runtime.py)
    max_bus_message_bytes: int = 0
    # bus transport: ipc = unix sockets in a 0700 run directory (one machine; the engine socket,
    # plans and results on channels, actors/channel.py, the rest ZeroMQ ipc://); tcp = every endpoint
    # tcp://bus_host:<free port> (`Addresses.tcp`: what actors on other machines need), every socket
    # CURVE-authenticated with keys made per launch (actors/security.py). bus_host: the address the
    # launcher's node binds and advertises (an IP address of this machine, not a wildcard)
    bus_transport: str = "ipc"
    bus_host: str = "127.0.0.1"
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser), as vLLM's flag
    tool_call_parser: str = ""  # hermes | llama3_json (frontends/openai/tools.py)
    # chat templates: a request may bring its own (`chat_template`, or in chat_template_kwargs) only
    # with this flag (vLLM's --trust-request-chat-template); every render runs off the event loop
    # and is stopped past the time limit (HTTP 400)
    trust_request_chat_template: bool = False
    chat_template_timeout_s: float = 10.0
    # the API key is not here: it travels in the environment (AXONSERVE_API_KEY), never argv
    # supervision
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    step_timeout_s: float = 300.0  # a step result later than this: the workers are stuck
    dist_timeout_s: float = 15.0  # a rank waiting this long in one collective fails: a peer rank died or hung
    ready_timeout_s: float = 600.0
    # self-healing (actors/supervisor.py): a dead or hung worker group, scheduler, metrics actor, snapshot
    # sink, encoder, router or drafter is replaced, its requests resumed; past max_restarts restarts
    # within restart_window_s the engine fails as with max_restarts = 0 (fail-stop)
    max_restarts: int = 5
    restart_window_s: float = 600.0
    failure_grace_s: float = 3.0  # after a death: time to flush errors before everything stops
    log_format: str = "console"  # console | json
    log_level: str = "info"
    # observability
    profile_dir: str = ""  # torch.profiler traces per worker rank (POST /start_profile); "" = off
    profile_max_steps: int = 200  # a profile stops recording after this many steps (bounds a trace's size)
    profile_max_traces: int = 16  # trace files kept in profile_dir; older ones are deleted
    snapshot: str = ""  # tensor snapshot rules as JSON (neuron/snapshot.py SnapshotRules); "" = off
    snapshot_dir: str = ""  # where the snapshot sink writes safetensors files + index.json
    speculative: SpeculativeConfig | None = None  # speculative decoding (speculative/scheduler.py)

    def __post_init__(self) -> None:
        if self.dtype == "auto":  # resolved once here: every actor gets the concrete dtype
            # (int8 activations multiply float32 inputs: auto means float32 with them, on any CPU)
            self.dtype = "float32" if self.activation_quantization else resolve_dtype(self.model)
        if os.path.isdir(self.model):  # auto (or vLLM's "embedding"): from the model; a task it cannot serve: here
            from axonserve.neuron.pooling import resolve_task  # (reads config.json; no torch)

            self.task = resolve_task(self.model, self.task)
            from axonserve.neuron.config import checkpoint_quantization

            # an FP8 checkpoint implies --quantization fp8 (before the device checks); others are refused
            self.quantization = checkpoint_quantization(self.model, self.quantization)
        self.device = resolve_device(self.device)
        if self.device == "xla":
            self._check_xla()
        if os.path.isdir(self.model):  # a sliding-window model's unsupported settings
            from axonserve.engine.sliding_window import check_model_dir  # (reads config.json; no torch)

            check_model_dir(self)
        self._check_activation_quantization()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; supported: {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.kv_cache_dtype != "auto" and (self.bucketing or self.role != "both"):
            raise ValueError(
                f"an {self.kv_cache_dtype} KV cache is not supported with bucketing or prefill/decode disaggregation"
            )
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        if self.num_scheduler_steps > 1:
            clash = [
                name for name, on in (("bucketing", self.bucketing), ("tensor snapshots", bool(self.snapshot))) if on
            ]
            if clash:
                raise ValueError(f"multi-step decoding (num_scheduler_steps > 1) is not supported with {clash[0]}")
        self.limits.validate()
        if self.data_parallel_size < 1 or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError("data_parallel_size must be >= 1 (and data_parallel_rank below it)")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be mp or ray, not {self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "ray":  # ranks on other nodes: they reach the bus over tcp
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'axonserve[ray]'")
            self.bus_transport = "tcp"
        if self.ray_placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(f"ray_placement_strategy {self.ray_placement_strategy!r} is not a Ray strategy")
        if self.data_parallel_size > 1:
            clash = [
                name
                for name, on in (
                    ("speculative decoding", self.speculative is not None),
                    ("encoder workers", self.encoder_workers > 0),
                    ("prefill/decode disaggregation", self.role != "both"),
                    ("tensor snapshots", bool(self.snapshot)),
                )
                if on
            ]
            if clash:
                raise ValueError(f"--data-parallel-size > 1 does not support {clash[0]} yet")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0 (0: fail-stop)")
        if self.max_waiting < 0 or self.max_waiting_tokens < 0 or self.request_timeout_s < 0:
            raise ValueError("max_waiting, max_waiting_tokens and request_timeout_s must be >= 0 (0: no bound)")
        positive = (
            "profile_max_steps",
            "profile_max_traces",
            "chat_template_timeout_s",
            "max_image_pixels",
            "max_image_decoded_bytes_per_request",
            "image_fetch_timeout_s",
            "max_image_bytes",
            "max_images_per_request",
            "restart_window_s",
            "heartbeat_timeout_s",
            "step_timeout_s",
        )
        bad = [name for name in positive if not getattr(self, name) > 0]
        if bad:
            raise ValueError(f"{', '.join(bad)} must be > 0")
        self._check_bus()
        if self.speculative is not None:
            self.speculative.validate()
            if self.bucketing:
                raise ValueError("speculative decoding is not supported in bucketing mode yet")
        from axonserve.lora.checks import check_engine_config  # (no torch)

        check_engine_config(self)
        self._check_sequence_parallel()

    def _check_sequence_parallel(self) -> None:
        """--sequence-parallel shards a step's tokens over the tensor-parallel ranks of the eager CPU
        path (neuron/sequence_parallel.py); what it does not run is refused here, at start-up."""
        if self.sequence_parallel_threshold < 1:
            raise ValueError(f"sequence_parallel_threshold must be >= 1, got {self.sequence_parallel_threshold}")
        if not self.sequence_parallel:
            return
        if self.num_workers < 2:
            raise ValueError("--sequence-parallel needs --num-workers >= 2 (it shards tokens over the TP ranks)")
        clash = [
            name
            for name, on in (
                ("--device xla", self.device == "xla"),
                ("bucketing", self.bucketing),
                ("speculative decoding", self.speculative is not None),
                ("prefill/decode disaggregation", self.role != "both"),
                ("LoRA adapters", self.enable_lora),
                ("expert parallelism", self.enable_expert_parallel),
                ("the embed task", self.task == "embed"),
                ("tensor snapshots", bool(self.snapshot)),
            )
            if on
        ]
        if clash:
            raise ValueError(f"--sequence-parallel is not supported with {clash[0]}")

    def _check_activation_quantization(self) -> None:
        """int8 activations multiply block codes in float32 panels: nothing else carries them."""
        aq = self.activation_quantization
        if not aq:
            return
        if aq not in ACTIVATION_QUANTIZATIONS:
            raise ValueError(f"activation_quantization {aq!r} is not supported; supported: int8")
        if self.dtype != "float32":
            raise ValueError(f"--activation-quantization int8 needs --dtype float32 (not {self.dtype})")
        if self.quantization:
            raise ValueError("--activation-quantization multiplies the checkpoint's codes: not with --quantization")

    def _check_bus(self) -> None:
        """The bus host is advertised to peers and bound: a wildcard or a name is refused here."""
        if self.bus_transport not in ("ipc", "tcp"):
            raise ValueError(f"bus_transport must be ipc or tcp, not {self.bus_transport!r}")
        try:
            ip = ipaddress.ip_address(self.bus_host)
        except ValueError:
            raise ValueError(f"bus_host must be an IP address of this machine, not {self.bus_host!r}") from None
        if ip.is_unspecified:
            raise ValueError(f"bus_host {self.bus_host} is a wildcard: give the address peers reach this machine at")
        if self.bus_transport == "ipc" and self.bus_host != "127.0.0.1":
            raise ValueError("bus_host is for --bus-transport tcp")

    def _check_xla(self) -> None:
        """The XLA runner always runs bucketed (static shapes); what it does not run is refused here,
        at start-up, rather than failing steps later."""
        self.bucketing = True
        clash = [
            name
            for name, on in (
                ("the embed task", self.task == "embed"),
                ("speculative decoding", self.speculative is not None),
                ("weight quantization", bool(self.quantization)),
                ("activation quantization", bool(self.activation_quantization)),
                (f"an {self.kv_cache_dtype} KV cache", self.kv_cache_dtype != "auto"),
                ("prefill/decode disaggregation", self.role != "both"),
                ("tensor snapshots", bool(self.snapshot)),
                ("multi-step decoding", self.num_scheduler_steps > 1),
                ("encoder workers", self.encoder_workers > 0),
                ("expert parallelism", self.enable_expert_parallel),
            )
            if on
        ]
        if clash:
            raise ValueError(f"--device xla does not support {clash[0]} yet")
        import importlib.util

        from axonserve.xla.device import MISSING

        if importlib.util.find_spec("torch_xla") is None:  # fail here, not in a worker after start-up
            raise ValueError(MISSING)


DEVICES = ("auto", "cpu", "xla")


def resolve_device(device: str) -> str:
    """auto -> xla when torch_neuronx is installed (a Trainium/Inferentia host), else cpu. Looked
    up without importing it: importing torch-xla takes seconds and must happen in the worker."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not supported; supported: {', '.join(DEVICES)}")
    if device != "auto":
        return device
    import importlib.util

    return "xla" if importlib.util.find_spec("torch_neuronx") is not None else "cpu"


def engine_suffix(dp_rank: int) -> str:
    """Name suffix of data-parallel engine `dp_rank`'s actors: engine 0 keeps the plain names
    ("scheduler", "worker-0", the "workers" restart event), engine i > 0 adds "-dp<i>"."""
    return f"-dp{dp_rank}" if dp_rank else ""


def engine_of(name: str) -> int:
    """The data-parallel engine an actor (or restart event) name belongs to."""
    head, sep, tail = name.rpartition("-dp")
    return int(tail) if sep and tail.isdigit() else 0


class Addresses(msgspec.Struct, kw_only=True):
    """Bus endpoints (URLs: unix:// channels and ipc:// on one host, tcp:// across hosts)."""

    control: str  # supervisor ROUTER
    engine: str  # scheduler ROUTER, clients' DEALERs (unix://: a routed channel, actors/channel.py)
    plan: str  # scheduler -> every worker rank (unix://: actors/channel.py; else XPUB -> SUBs)
    result: str  # worker rank 0 -> scheduler (unix://: the plan's channel; else PUSH -> PULL)
    stats: str = ""  # every actor PUSH (non-blocking) -> metrics actor PULL
    metrics: str = ""  # metrics actor ROUTER: GetMetrics -> MetricsText
    dist_init: str = ""  # torch.distributed init_method for worker ranks (tcp://host:port)
    snapshot: str = ""  # worker rank 0 PUSH (non-blocking) -> snapshot sink PULL
    drafter: str = ""  # drafter ROUTER (speculative decoding with a draft model) <- scheduler DEALER
    router: str = ""  # encoder router ROUTER: the scheduler's and every encoder's DEALER
    prefill: str = ""  # P/D: the prefill engine's scheduler ROUTER (the decode scheduler is its client)
    engines: list[str] = []  # data parallel: every engine's scheduler ROUTER, in engine order (the frontend's)

    @classmethod
    def in_dir(cls, d: str, dist_port: int = 0, channel: bool = True) -> "Addresses":
        """Every endpoint in run directory `d`; the engine socket and the step's plans and results
        on channels (actors/channel.py) unless `channel` is False (then ZeroMQ, as the rest)."""
        return cls(
            control=f"ipc://{d}/control",
            engine=f"unix://{d}/engine" if channel else f"ipc://{d}/engine",
            plan=f"unix://{d}/plan" if channel else f"ipc://{d}/plan",
            result=f"unix://{d}/plan" if channel else f"ipc://{d}/result",
            stats=f"ipc://{d}/stats",
            metrics=f"ipc://{d}/metrics",
            dist_init=f"tcp://127.0.0.1:{dist_port}" if dist_port else "",
            snapshot=f"ipc://{d}/snapshot",
            drafter=f"ipc://{d}/drafter",
            router=f"ipc://{d}/router",
        )

    @classmethod
    def tcp(cls, host: str, *, dist_init: bool = False, avoid: set[int] | frozenset[int] = frozenset()) -> Addresses:
        """Every endpoint tcp://host:<free port> (the torch.distributed rendezvous too, with
        `dist_init`): a bus that actors on other machines can reach, CURVE-authenticated
        (actors/security.py). Ports are probed free now and bound by their actors later; `avoid`:
        ports already promised (the HTTP port, another engine's endpoints)."""
        names = [*TCP_ENDPOINTS, *(("dist_init",) if dist_init else ())]
        return cls(**{name: tcp_url(host, port) for name, port in zip(names, free_ports(host, len(names), avoid))})

    def tcp_ports(self) -> set[int]:
        """The ports of this bus's tcp:// endpoints (for `avoid`)."""
        urls = [getattr(self, name) for name in self.__struct_fields__]
        flat = [u for url in urls for u in (url if isinstance(url, list) else [url])]
        return {int(u.rsplit(":", 1)[1]) for u in flat if u.startswith("tcp://")}


TCP_ENDPOINTS = ("control", "engine", "plan", "result", "stats", "metrics", "snapshot", "drafter", "router")


def tcp_url(host: str, port: int) -> str:
    """tcp://host:port, an IPv6 host in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def free_ports(host: str, n: int, avoid: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """`n` distinct TCP ports free on `host` now (each probe stays bound until all are chosen)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probes: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(family, socket.SOCK_STREAM)
            probes.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in avoid:
                ports.append(port)
    finally:
        for s in probes:
            s.close()
    return ports


class ActorSpec(msgspec.Struct, kw_only=True):
    """Everything a child process needs to become one actor."""

    kind: str  # frontend | scheduler | worker | metrics | snapshot | router | encoder | drafter
    name: str
    config: EngineConfig
    addresses: Addresses
    rank: int = 0
