"""`axonserve serve|generate ...` — flags mirror `vllm serve` where they exist.

Over 500 lines: one argparse flag per engine setting, each with its help text (the whole
command-line surface in one place, as `vllm serve --help` reads)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

import msgspec
import structlog

from axonserve import __version__
from axonserve.config import (
    ACTIVATION_QUANTIZATIONS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SEQUENCE_PARALLEL_THRESHOLD,
    EngineConfig,
    RequestLimits,
    SpeculativeConfig,
)
from axonserve.engine.buckets import parse_buckets, read_bucket_file
from axonserve.logs import setup_logging

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help="model directory, .gguf file, SmolLM2-135M-Instruct (default) or all-MiniLM-L6-v2",
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--task",
        default="auto",
        choices=["auto", "generate", "embed", "embedding"],
        help="generate (causal LM) or embed (pooling: one vector per input, POST /v1/embeddings); "
        "auto: from the model (BertModel / sentence-transformers files -> embed)",
    )
    p.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="vLLM's spelling of --task: pooling = embed",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--disable-sliding-window",
        action="store_true",
        help="serve a sliding-window model with full attention, max_model_len capped at its window",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=0.1,
        help="fraction of available memory for the KV pool when --num-kv-blocks is unset",
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="plan the next step while the current one runs (ignored with speculative decoding, "
        "bucketing and P/D disaggregation)",
    )
    p.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="multi-step decoding: a pure-decode batch runs up to N forwards per plan (less engine "
        "overhead per token; tokens stream N at a time, arrivals wait up to N-1 forwards)",
    )
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="bound on queued requests; beyond it requests get HTTP 503 (0: unbounded)",
    )
    p.add_argument(
        "--max-waiting-tokens",
        type=int,
        default=1 << 20,
        help="bound on the prompt tokens of queued requests; beyond it HTTP 503 (0: unbounded)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        dest="request_timeout_s",
        help="a request older than this ends with an error (HTTP 408) and frees its KV cache (0: none)",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="independent engines (scheduler + tensor-parallel ranks each) behind one frontend, which "
        "routes each request to the least loaded one (or the one whose prefix cache holds its prompt)",
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default="mp",
        help="mp: worker ranks are local processes; ray: Ray places them (one placement-group bundle per "
        "rank, across the nodes of the cluster at RAY_ADDRESS, or a local one) and the bus goes over "
        "CURVE-authenticated tcp (extra: ray)",
    )
    p.add_argument(
        "--ray-placement-strategy", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"], default="PACK"
    )
    p.add_argument("--ray-cpus-per-worker", type=float, default=1.0, help="CPUs each rank's bundle reserves")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="self-healing: dead or hung actors (worker ranks, scheduler, metrics, encoders, ...) restarted "
        "at most this many times within --restart-window; past it the engine fails (0: fail at once)",
    )
    p.add_argument("--restart-window", type=float, default=600.0, metavar="SECONDS", dest="restart_window_s")
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        dest="heartbeat_timeout_s",
        help="an actor silent this long (its heartbeat thread stopped: a dead or stopped process) is replaced",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        dest="step_timeout_s",
        help="a step the worker ranks have not answered in this long: they are hung and are replaced",
    )
    lim = RequestLimits()
    p.add_argument(
        "--max-request-fanout",
        type=int,
        default=lim.max_fanout,
        dest="max_fanout",
        help="generations one request may start: prompts x n (embeddings: inputs)",
    )
    p.add_argument("--max-stop-strings", type=int, default=lim.max_stop_strings)
    p.add_argument("--max-stop-string-chars", type=int, default=lim.max_stop_string_chars)
    p.add_argument(
        "--max-logit-bias", type=int, default=lim.max_logit_bias, help="entries in logit_bias (and in stop_token_ids)"
    )
    p.add_argument(
        "--max-structured-output-bytes",
        type=int,
        default=lim.max_structured_output_bytes,
        help="size of a JSON schema, regex, grammar or choice list (tools with tool_choice too)",
    )
    p.add_argument("--max-tools", type=int, default=lim.max_tools, help="tools in one chat request")
    p.add_argument("--max-request-id-chars", type=int, default=lim.max_request_id_chars)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: the checkpoint's precision; 16-bit and quantized (GGUF) checkpoints run in "
        "bfloat16 where the CPU has native bf16, float32 checkpoints stay float32",
    )
    p.add_argument(
        "--quantization",
        "-q",
        default="",
        choices=["", *QUANTIZATIONS],
        help="weight-only quantization of the linear layers and LM head (approximate outputs); fp8 = "
        "float8_e4m3fn with a scale per output row, implied by an FP8 checkpoint",
    )
    p.add_argument(
        "--activation-quantization",
        default="",
        choices=["", *ACTIVATION_QUANTIZATIONS],
        help="int8: a GGUF Q4_1 / Q8_0 model served in float32 on an AVX2 CPU multiplies its weight codes by "
        "activations rounded to int8 per block of 32, as llama.cpp does (faster, approximate: check it "
        "with `axonserve validate --activation-quantization int8`)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache storage: auto = the model's dtype; int8 / fp8 (= fp8_e4m3) / fp8_e5m2 = per-(token, "
        "head) scaled codes, half the bytes attention reads (approximate outputs)",
    )
    p.add_argument(
        "--num-workers",
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        dest="num_workers",
        help="worker ranks (tensor parallel over gloo)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="shard long prefills' tokens over the tensor-parallel ranks (norms and residuals per token "
        "shard; all-gather before attention and the MLP, reduce-scatter after); off by default: it did not "
        "pay on 2 CPU cores over gloo (docs/benchmarks.md)",
    )
    p.add_argument(
        "--sequence-parallel-threshold",
        type=int,
        default=SEQUENCE_PARALLEL_THRESHOLD,
        help="steps of at least this many tokens run sequence-parallel (decodes and short steps: plain TP)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE: split the experts over the ranks (all-to-all dispatch) instead of sharding each",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="multi-LoRA serving: requests pick a PEFT LoRA adapter by `model` name (axonserve/lora)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help='adapters served from the start: name=path, or vLLM\'s JSON \'{"name": "a", "path": "/p", '
        '"base_model_name": "..."}\' (needs --enable-lora; each directory is validated at start-up)',
    )
    p.add_argument("--max-loras", type=int, default=1, help="distinct adapters one step may run (the ranks' slots)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="adapters of a higher rank r are refused")
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=0,
        help="adapters kept loaded in host memory, least recently used evicted (0: --max-loras)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "xla"],
        default="cpu",
        help="where the worker ranks run: cpu (eager PyTorch + C++ kernels), xla (torch-xla: NeuronCores "
        "with torch-neuronx, or PJRT CPU; implies --bucketing, every bucket compiled at start-up), auto "
        "(xla when torch_neuronx is installed, else cpu)",
    )
    p.add_argument(
        "--compile-cache-dir",
        default="",
        help="--device xla: root of the persistent compile cache, keyed by model, dtype, buckets, TP "
        "degree and torch-xla version (default ~/.cache/axonserve/xla); never deleted at start",
    )
    p.add_argument(
        "--bucketing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Neuron bucketing mode: pure prefill or pure decode steps, padded to "
        "static bucket shapes (off by default on CPU)",
    )
    p.add_argument(
        "--context-batch-buckets",
        type=parse_buckets,
        default=[],
        metavar="N,N,...",
        help="prefill batch-size buckets (default: powers of two up to min(max_num_seqs, 8))",
    )
    p.add_argument(
        "--context-len-buckets",
        type=parse_buckets,
        default=[],
        metavar="N,N,...",
        help="prefill chunk-length buckets (default: powers of two from 16 up to "
        "min(max_num_batched_tokens, max_model_len))",
    )
    p.add_argument(
        "--decode-batch-buckets",
        type=parse_buckets,
        default=[],
        metavar="N,N,...",
        help="decode batch-size buckets (default: powers of two up to max_num_seqs)",
    )
    p.add_argument(
        "--decode-len-buckets",
        type=parse_buckets,
        default=[],
        metavar="N,N,...",
        help="KV-length buckets for both phases (default: powers of two from 128 up "
        "to max_model_len); max_model_len is capped at the largest",
    )
    p.add_argument(
        "--buckets",
        default=None,
        metavar="FILE",
        help="the four bucket lists from a JSON file (`axonserve buckets plan --out`); implies "
        "--bucketing, excludes the --*-buckets flags",
    )
    p.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s shape: {"method": "ngram"|"eagle"|"draft_model", '
        '"num_speculative_tokens": 3 (eagle: 8, a draft tree), "model": HEAD_DIR, '
        '"tree_width": 4, "tree_depth": 4, "prompt_lookup_max": 3, "disable_by_batch_size": 8, '
        '"max_verify_rows": 24}',
    )
    p.add_argument(
        "--encoder-workers",
        type=int,
        default=0,
        metavar="N",
        help="vision-language models: N encoder processes (vision tower + projector) behind a "
        "router actor that caches image features; 0: the worker ranks encode images",
    )
    p.add_argument("--encoder-cache-mb", type=int, default=256, help="the encoder router's image-feature cache")
    p.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=[],
        metavar="HOST",
        help="hosts image_url may fetch http(s) images from ('*': any); default: data: URLs only",
    )
    p.add_argument("--max-image-bytes", type=int, default=10 * 2**20, help="largest image accepted (encoded bytes)")
    p.add_argument("--max-images-per-request", type=int, default=8)
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=16 * 2**20,
        help="largest image accepted (width * height, checked before decoding)",
    )
    p.add_argument(
        "--max-image-decoded-bytes-per-request",
        type=int,
        default=128 * 2**20,
        help="a request's images, decoded (width * height * channels, summed)",
    )
    p.add_argument(
        "--image-fetch-timeout-s",
        type=float,
        default=10.0,
        help="total time to fetch a request's http(s) image URLs (DNS, connect, headers, body)",
    )
    p.add_argument(
        "--allow-private-image-urls",
        action="store_true",
        help="fetch image URLs that resolve to private, loopback or link-local addresses",
    )
    p.add_argument(
        "--role",
        default="both",
        choices=["both", "decode"],
        help="prefill/decode disaggregation: decode = this engine's worker ranks only decode; a "
        "prefill pool (its own scheduler and ranks) computes prompts and moves their KV over",
    )
    p.add_argument(
        "--bus-transport",
        default="ipc",
        choices=["ipc", "tcp"],
        help="the actors' message bus: ipc = unix sockets in a private run directory (one machine); "
        "tcp = tcp://BUS_HOST:<port> endpoints, every socket CURVE-authenticated with keys made at launch",
    )
    p.add_argument(
        "--bus-host",
        default="127.0.0.1",
        metavar="IP",
        help="--bus-transport tcp: the address of this machine the bus binds and advertises to its peers",
    )
    p.add_argument("--log-format", default="console", choices=["console", "json"])
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--profile-dir",
        default="",
        metavar="DIR",
        help="enable POST /start_profile and /stop_profile (behind --api-key): torch.profiler "
        "traces per worker rank go here (only this flag enables them)",
    )
    p.add_argument(
        "--profile-max-steps",
        type=int,
        default=200,
        help="a profile stops recording after this many engine steps (bounds a trace's size)",
    )
    p.add_argument(
        "--profile-max-traces",
        type=int,
        default=16,
        help="traces kept per worker rank in --profile-dir; older ones are deleted",
    )
    p.add_argument(
        "--snapshot",
        type=_snapshot_rules,
        default=None,
        metavar="RULES",
        help="capture tensors for matching requests/steps into --snapshot-dir. " + _rules_help(),
    )
    p.add_argument(
        "--snapshot-dir",
        default="axonserve-snapshots",
        metavar="DIR",
        help="where the snapshot sink writes safetensors files and index.json "
        "(read them with `axonserve snapshot ls|show DIR`)",
    )


def _speculative_config(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _rules_help() -> str:
    from axonserve.neuron.snapshot import RULES_HELP  # (torch is imported lazily there)

    return RULES_HELP


def _snapshot_rules(text: str) -> str:
    """argparse type: validated rules as canonical JSON (what travels in EngineConfig)."""
    from axonserve.neuron.snapshot import SnapshotRules

    try:
        return SnapshotRules.parse(text).to_json()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def requested_task(task: str, runner: str) -> str:
    """--task combined with vLLM's --runner (pooling = embed); ValueError when they disagree."""
    task = "embed" if task == "embedding" else task
    from_runner = {"auto": "auto", "generate": "generate", "pooling": "embed"}[runner]
    if "auto" not in (task, from_runner) and task != from_runner:
        raise ValueError(f"--task {task} contradicts --runner {runner}")
    return from_runner if task == "auto" else task


def apply_bucket_file(args: argparse.Namespace) -> None:
    """--buckets FILE: its lists replace the --*-buckets flags (given together: an error) and
    bucketing is on."""
    path = getattr(args, "buckets", None)
    if not path:
        return
    names = ("context_batch", "context_len", "decode_batch", "decode_len")
    given = [f"--{n.replace('_', '-')}-buckets" for n in names if getattr(args, f"{n}_buckets")]
    if given:
        raise ValueError(f"--buckets {path} and {', '.join(given)} are exclusive: the file sets every bucket list")
    for name, vals in read_bucket_file(path).items():
        setattr(args, f"{name}_buckets", vals)
    args.bucketing = True


def engine_config(args: argparse.Namespace, **extra) -> EngineConfig:
    from axonserve.neuron.model_source import resolve_model

    apply_bucket_file(args)  # before the model: a bad file fails at once
    model_dir = resolve_model(args.model)
    config = EngineConfig(
        model=model_dir,
        served_model_name=args.served_model_name or args.model,
        task=requested_task(args.task, args.runner),  # resolved against the model by EngineConfig
        max_model_len=args.max_model_len,
        disable_sliding_window=args.disable_sliding_window,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        async_scheduling=args.async_scheduling,
        num_scheduler_steps=args.num_scheduler_steps,
        scheduling_policy=args.scheduling_policy,
        max_waiting=args.max_waiting,
        max_waiting_tokens=args.max_waiting_tokens,
        request_timeout_s=args.request_timeout_s,
        max_restarts=args.max_restarts,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        ray_placement_strategy=args.ray_placement_strategy,
        ray_cpus_per_worker=args.ray_cpus_per_worker,
        restart_window_s=args.restart_window_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        step_timeout_s=args.step_timeout_s,
        limits=RequestLimits(**{f: getattr(args, f) for f in RequestLimits.__struct_fields__}),
        dtype=args.dtype,
        quantization=args.quantization,
        activation_quantization=args.activation_quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        num_workers=args.num_workers,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        enable_expert_parallel=args.enable_expert_parallel,
        sequence_parallel=args.sequence_parallel,
        sequence_parallel_threshold=args.sequence_parallel_threshold,
        threads=args.threads,
        seed=args.seed,
        bucketing=args.bucketing,
        device=args.device,
        compile_cache_dir=os.path.abspath(args.compile_cache_dir) if args.compile_cache_dir else "",
        context_batch_buckets=args.context_batch_buckets,
        context_len_buckets=args.context_len_buckets,
        decode_batch_buckets=args.decode_batch_buckets,
        decode_len_buckets=args.decode_len_buckets,
        log_format=args.log_format,
        log_level=args.log_level,
        bus_transport=args.bus_transport,
        bus_host=args.bus_host,
        profile_dir=os.path.abspath(args.profile_dir) if args.profile_dir else "",
        profile_max_steps=args.profile_max_steps,
        profile_max_traces=args.profile_max_traces,
        snapshot=args.snapshot or "",
        encoder_workers=args.encoder_workers,
        role=args.role,
        encoder_cache_mb=args.encoder_cache_mb,
        allowed_media_domains=list(args.allowed_media_domains),
        max_image_bytes=args.max_image_bytes,
        max_images_per_request=args.max_images_per_request,
        max_image_pixels=args.max_image_pixels,
        max_image_decoded_bytes_per_request=args.max_image_decoded_bytes_per_request,
        image_fetch_timeout_s=args.image_fetch_timeout_s,
        allow_private_image_urls=args.allow_private_image_urls,
        snapshot_dir=os.path.abspath(args.snapshot_dir) if args.snapshot else "",
        speculative=args.speculative_config,
        **extra,
    )
    if args.lora_modules:  # every adapter directory validated now: a bad one fails start-up (exit 2)
        from axonserve.lora.registry import check_startup_modules

        modules = check_startup_modules(
            args.lora_modules,
            enable_lora=config.enable_lora,
            max_lora_rank=config.max_lora_rank,
            model_dir=model_dir,
            base_names={config.served_model_name, model_dir},
        )
        config = msgspec.structs.replace(config, lora_modules=modules)
    return config


async def _serve(config: EngineConfig) -> int:
    from axonserve.actors.supervisor import StartupCancelled, StartupError, Supervisor

    sup = Supervisor(config, frontend=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.request_stop)
    try:
        await sup.start()
    except StartupCancelled:
        structlog.get_logger().info("stopped_during_startup")
        return 0
    except StartupError as e:
        structlog.get_logger().error("startup_failed", error=str(e))
        return 1
    structlog.get_logger().info("serving", url=f"http://{config.host}:{config.port}/v1")
    return await sup.wait()


def cmd_serve(args: argparse.Namespace) -> int:
    from axonserve.lora.registry import runtime_updating_from_env

    config = engine_config(
        args,
        host=args.host,
        port=args.port,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        max_request_body_bytes=args.max_request_body_bytes,
    )
    if args.api_key:  # children inherit the environment; argv is visible to every local user
        os.environ["AXONSERVE_API_KEY"] = args.api_key
    if args.allow_runtime_lora_updating and not config.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    # vLLM's environment switch counts only with --enable-lora: a shell that exports it for other
    # servers must not stop one without LoRA from starting
    runtime_lora = args.allow_runtime_lora_updating or (config.enable_lora and runtime_updating_from_env())
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    config = msgspec.structs.replace(
        config,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser or "",
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_timeout_s=args.chat_template_timeout,
        allow_runtime_lora_updating=runtime_lora,
    )
    import uvloop

    return uvloop.run(_serve(config))


def cmd_generate(args: argparse.Namespace) -> int:
    from axonserve.frontends.offline import LLM
    from axonserve.protocol.messages import SamplingParams

    llm = LLM(config=engine_config(args))
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        for out in llm.generate(args.prompt, params):
            print(out.text)
    finally:
        llm.shutdown()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """`axonserve bench ...`: its modules (httpx, aiohttp, matplotlib) load only here, so a plain
    `pip install .` serves without the bench extra."""
    from axonserve.bench.cli import main as bench_main

    try:
        return bench_main(args.argv)
    except ModuleNotFoundError as e:
        if e.name not in ("httpx", "aiohttp", "matplotlib"):
            raise
        raise SystemExit(
            f"axonserve bench needs the bench extra ({e.name} is missing): pip install 'axonserve[bench]'"
        ) from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="axonserve", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health, /version, /metrics, "
        "/ping, /openapi.json (safer: set AXONSERVE_API_KEY or VLLM_API_KEY)",
    )
    serve.add_argument(
        "--allowed-origins",
        type=json.loads,
        default=[],
        help="CORS origins (JSON list, e.g. '[\"https://app.example\"]'); default none: no CORS",
    )
    serve.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS methods (JSON list)")
    serve.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS headers (JSON list)")
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    serve.add_argument(
        "--max-request-body-bytes", type=int, default=32 * 2**20, help="larger HTTP request bodies get 413"
    )
    serve.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat template (`chat_template`); off: HTTP 400",
    )
    serve.add_argument(
        "--chat-template-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a chat template render taking longer is stopped (HTTP 400)",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto": the model decides, --tool-call-parser reads its calls',
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=None,
        help='how the model writes tool calls: hermes <tool_call>{...}</tool_call>, llama3_json {"name", "parameters"}',
    )
    serve.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="mount POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key); also on with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as in vLLM",
    )
    serve.set_defaults(func=cmd_serve)
    gen = sub.add_parser("generate", help="generate offline for prompts given on the command line")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=cmd_generate)
    bench = sub.add_parser(
        "bench",
        add_help=False,
        prefix_chars="\0",
        help="benchmarks: load generator, peer comparison, machine limits (extra: bench)",
    )
    bench.add_argument("argv", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    from axonserve.actors.snapshot import add_snapshot_parser
    from axonserve.validate import add_validate_parser

    add_snapshot_parser(sub)
    add_validate_parser(sub)
    from axonserve.engine.bucket_plan import add_buckets_parser

    add_buckets_parser(sub)
    from axonserve.speculative.training.cli import add_train_eagle_parser

    add_train_eagle_parser(sub)
    args = parser.parse_args(argv)
    setup_logging(getattr(args, "log_format", "console"), getattr(args, "log_level", "info"), actor="launcher")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        code = args.func(args)
    except ValueError as e:  # bad model path, unsupported architecture, bad flag value
        structlog.get_logger().error("error", error=str(e))
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
