"""One worker rank's device state: model, paged KV cache, per-request state, sampler.

Over 500 lines: the per-step diff of request state, its batch assembly and the sampling
and drafting hand-offs read the same per-request state.

`execute(StepPlan)` applies the plan as a diff to the requests this worker holds, runs one
forward over the flat token batch (decodes first, then prefill chunks) and samples one token
for each request whose computed count reaches its known token count.
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch

from axonserve.config import EngineConfig
from axonserve.engine import sliding_window
from axonserve.engine.buckets import BucketConfig
from axonserve.multimodal.worker import ImageEncoderCache, RequestImages, batch_rows
from axonserve.neuron import sequence_parallel
from axonserve.neuron.block_table import BlockTable
from axonserve.neuron.config import ModelConfig
from axonserve.neuron.kv_transfer import export_kv, import_kv
from axonserve.neuron.layers.fp8 import kv_code_dtype
from axonserve.neuron.layers.quant import settle_onednn_split
from axonserve.neuron.loader import load_model
from axonserve.neuron.models.bert import EncoderBatch
from axonserve.neuron.ops import native
from axonserve.neuron.ops.attention import AttentionMetadata, DecodeRun, build_static, move_slots, takes_chunks
from axonserve.neuron.parallel import (
    CollectiveError,
    TPInfo,
    init_tensor_parallel,
    tp_broadcast_ids,
    tp_broadcast_ragged,
    tp_min,
)
from axonserve.neuron.sampler import Sampler, greedy_ids
from axonserve.neuron.snapshot import StepSnapshots, contiguous_rows, padded_rows
from axonserve.protocol import tensor_ref
from axonserve.protocol.messages import (
    LoraSpec,
    NewRequestData,
    PoolingParams,
    PromptLogprobs,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from axonserve.speculative.tree import tree_path
from axonserve.structured_output.worker import StructuredDecoding

log = structlog.get_logger()

_LOGPROB_ROWS = 256  # prompt logprobs: positions per [rows, vocab] logits slice
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    generator: torch.Generator | None  # seeded: speculative verification's draws (sampling hashes (seed, position))
    grammar: Any = None  # structured output: GrammarState, made at first sampling (rank 0)
    pooling: PoolingParams | None = None  # embed task: pooled once its whole prompt ran
    images: RequestImages | None = None  # multimodal: placeholder positions and their features
    kv_export: bool = False  # P/D prefill: its prompt KV leaves with its first token
    lora: LoraSpec | None = None  # its LoRA adapter (None: the base model)
    lora_error: str | None = None  # its adapter failed to load here: it is skipped until dropped
    row: int = -1  # its row of the runner's BlockTable (a mirror of block_ids)


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


class ModelRunner:
    inference_mode = True  # steps run under torch.inference_mode (XLA's lazy tensors cannot: no_grad)

    def __init__(self, config: EngineConfig, rank: int = 0, dist_init: str | None = None):
        """rank/dist_init: this worker's place in the tensor-parallel group of config.num_workers
        ranks; every rank must then execute the same plans (rank 0's StepResult is the answer)."""
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype {config.dtype!r} is not supported; supported: {sorted(DTYPES)}")
        self.config, self.rank = config, rank
        self.dtype = DTYPES[config.dtype]
        cores = len(os.sched_getaffinity(0))
        # every rank of every data-parallel engine on this machine shares its cores (2 engines of 2
        # threads each on 2 cores ran 7x slower than one engine: OpenMP teams fighting for cores);
        # a Ray rank gets its bundle's CPUs
        if config.distributed_executor_backend == "ray":
            threads = max(1, int(config.ray_cpus_per_worker))
        else:
            threads = max(1, cores // (config.num_workers * config.data_parallel_size))
        torch.set_num_threads(config.threads or threads)
        torch.manual_seed(config.seed)
        init_tensor_parallel(
            rank,
            config.num_workers,
            dist_init,
            expert_parallel=config.enable_expert_parallel,
            timeout_s=config.dist_timeout_s,
        )
        mc, max_len = sliding_window.resolve(config, ModelConfig.from_dir(config.model))
        self.kv_window = mc.kv_window  # blocks past it are freed by the scheduler (engine/sliding_window.py)
        self.max_model_len = mc.max_model_len_for(max_len)
        self.task = config.task  # (resolved by EngineConfig)
        if self.task == "embed":
            _check_encoder_config(config, mc, self.max_model_len)
        self.buckets: BucketConfig | None = None
        self.shapes: set[tuple[str, int, int, int]] = set()  # bucketing: distinct shapes run
        if config.bucketing:  # a sequence must fit the largest KV-length bucket
            b = BucketConfig.from_engine_config(config, self.max_model_len)
            self.max_model_len = min(self.max_model_len, b.max_kv_len)
            self.buckets = BucketConfig.from_engine_config(config, self.max_model_len)
        # the RoPE table must cover every position we may be asked to run
        self.model_config = dataclasses.replace(
            mc, max_position_embeddings=max(mc.max_position_embeddings, self.max_model_len)
        )
        self.eos_token_ids = mc.eos_token_ids
        self.vocab_size = mc.vocab_size
        self.block_size = config.block_size
        # the grammar tokenizer builds on its own thread while the weights load
        self.structured = StructuredDecoding(config.model, self.vocab_size, self.eos_token_ids, enabled=rank == 0)
        embed = self.task == "embed"  # an encoder keeps no KV cache: each prompt runs whole in one step
        self.num_kv_blocks = 0 if embed else config.num_kv_blocks or self._auto_num_blocks()
        # bucketing: one extra scratch block (index num_kv_blocks, never handed out) takes the
        # K/V writes of padding rows
        self.pad_block = self.num_kv_blocks
        # the KV pool is zeroed on a thread while the weights load: zeroing is page faults (kernel
        # time, seconds for the default pool: docs/benchmarks.md#fig-neuron-model-runner), loading
        # is the interpreter and oneDNN.
        # The thread runs in a copy of this context: its log lines keep the actor's bound fields.
        with ThreadPoolExecutor(1, thread_name_prefix="kv-alloc") as pool:
            kv = (
                pool.submit(
                    contextvars.copy_context().run,
                    self._allocate_kv_cache,
                    self.num_kv_blocks + (self.buckets is not None),
                )
                if not embed
                else None
            )
            self.model = load_model(
                self.model_config,
                self.dtype,
                progress=rank == 0,
                quantization=config.quantization,
                activation_quantization=config.activation_quantization,
            )
            self.kv_caches = kv.result() if kv is not None else []
        sequence_parallel.configure(config, self.model)  # --sequence-parallel: refuses what it cannot run
        self.result_tensors: list[torch.Tensor] = []  # extra frames the last StepResult's TensorRefs name
        self.sampler = Sampler(self.eos_token_ids, config.seed)
        self.native = native.for_dtype(self.dtype)  # fused C++ kernels (None: the torch path)
        self.native_chunks = bool(self.kv_caches) and takes_chunks(
            self.native,
            self.dtype,
            self.kv_caches[0][0].dtype,
            self.model_config.head_dim,
            self.model_config.sliding_window is not None,
        )
        self.lora = None  # --enable-lora: adapter slots on the model's layers (axonserve/lora)
        if config.enable_lora:
            from axonserve.lora.manager import LoraManager

            self.lora = LoraManager(
                self.model, self.model_config, self.dtype, config.max_loras, config.max_lora_rank, config.max_cpu_loras
            )
        self.requests: dict[str, RequestState] = {}
        self.block_table = BlockTable()
        self.snapshots = StepSnapshots.from_config(self.model, config.snapshot, rank)  # --snapshot capture
        # vision-language models: images of requests whose plan brings pixels are encoded here
        self.images = (
            ImageEncoderCache(self.model, self.dtype, config.encoder_cache_mb * 2**20)
            if getattr(self.model, "is_multimodal", False)
            else None
        )
        if self.images is not None and self.buckets is not None:
            raise ValueError("bucketing mode is not supported for multimodal models")
        self._frames: Sequence[Any] = ()  # the current plan's extra frames (multimodal inputs)
        spec = config.speculative
        self.eagle = None  # EAGLE drafts on rank 0, from the hidden states each step leaves here
        if spec is not None and spec.method == "eagle" and rank == 0 and self.task == "generate":
            from axonserve.speculative.eagle import EagleProposer

            # bf16: packed, as the target; its head KV is paged by the target's block ids
            self.eagle = EagleProposer.from_config(
                config, self.dtype, num_blocks=self.num_kv_blocks, max_position=self.max_model_len
            )
        log.info(
            "runner.ready",
            rank=rank,
            threads=torch.get_num_threads(),
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            buckets=self.buckets.as_dict() if self.buckets else None,
            native_kernels=self.native is not None,
            chunk_attention=self.native_chunks,
        )

    def image_info(self) -> dict[str, int]:
        """For the scheduler's image checks (multimodal/scheduler.py); empty for a text-only model."""
        if self.images is None:
            return {}
        m = self.model
        return {
            "image_token_id": m.image_token_id,
            "image_tokens": m.tokens_per_image,
            "image_size": m.vision_tower.image_size,
            "hidden_size": self.model_config.hidden_size,
        }

    # ------------------------------------------------------------------ KV cache

    def _block_bytes(self) -> int:
        return self.block_size * self.model_config.kv_bytes_per_token(
            self.config.dtype, TPInfo.size, self.config.kv_cache_dtype
        )

    def _auto_num_blocks(self) -> int:
        budget = self.config.kv_cache_memory_fraction * mem_available_bytes()
        n = int(budget // self._block_bytes())
        if n < 1:
            raise RuntimeError(f"KV cache budget {budget / 2**20:.0f} MiB holds no {self._block_bytes()}-byte block")
        return n

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, ...]]:
        """Zeroed (never NaN garbage: masked slots still enter the attention matmul). Per layer
        (K, V), or with an int8 / fp8 cache (K codes, V codes, K scales, V scales)."""
        mc = self.model_config
        kv_heads = max(1, mc.num_kv_heads // TPInfo.size)
        shape = (num_blocks, self.block_size, kv_heads, mc.head_dim)
        log.info(
            "kv_cache.allocate",
            blocks=num_blocks,
            mib=round(num_blocks * self._block_bytes() / 2**20, 1),
            dtype=self.config.kv_cache_dtype,
        )
        if self.config.kv_cache_dtype != "auto":  # int8 / fp8 codes (layers/fp8.py) + float32 scales
            codes = kv_code_dtype(self.config.kv_cache_dtype) or torch.int8
            return [
                (
                    torch.zeros(shape, dtype=codes),
                    torch.zeros(shape, dtype=codes),
                    torch.zeros(shape[:3]),
                    torch.zeros(shape[:3]),
                )
                for _ in range(mc.num_layers)
            ]
        return [
            (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)) for _ in range(mc.num_layers)
        ]

    # ------------------------------------------------------------------ warm-up

    WARMUP_SEQ_LEN = 64

    def warm_up(self) -> float:
        """One throw-away prefill of up to max_num_batched_tokens tokens, run before the worker
        says ready: a fresh process's first large step pays the heap's growth to its working set
        (page faults) and oneDNN's kernel generation for large row counts: on SmolLM2 the first
        burst of a fresh server took far longer than later ones, and that step is every burst
        request's TTFT (docs/benchmarks.md#fig-neuron-model-runner). vLLM-CPU runs a dummy batch at
        start-up for the same reason. Skipped for pooling and multimodal models and in bucketing
        mode. Returns the seconds it took (0: skipped).
        Before it, oneDNN's per-row-bucket threading choice is settled for every bucket a step
        may use (layers/quant.py `settle_onednn_split`), for every kind of model."""
        t0 = time.perf_counter()
        products = settle_onednn_split(self.model, self.config.max_num_batched_tokens)
        if products:
            log.info("runner.onednn_settled", products=products, seconds=round(time.perf_counter() - t0, 2))
        if self.task != "generate" or self.buckets is not None or self.images is not None or not self.num_kv_blocks:
            return 0.0
        seq = max(1, min(self.WARMUP_SEQ_LEN, self.max_model_len))
        per_seq = -(-seq // self.block_size)
        # every rank must run the same plan (its collectives pair up): the smallest rank's pool
        count = min(self.config.max_num_batched_tokens // seq, tp_min(self.num_kv_blocks) // per_seq)
        if count < 1:
            return 0.0
        t0 = time.perf_counter()
        greedy = SamplingParams(temperature=0.0)
        new = [
            NewRequestData(
                f"warmup-{i}",
                [(i * 7919 + j) % self.vocab_size for j in range(seq)],
                seq,
                list(range(i * per_seq, (i + 1) * per_seq)),
                0,
                greedy,
            )
            for i in range(count)
        ]
        snapshots, self.snapshots = self.snapshots, None  # not a step anyone asked for
        try:
            result = self.execute(StepPlan(-1, new=new, num_scheduled_tokens=[seq] * count))
            self.execute(StepPlan(-1, finished_request_ids=[r.request_id for r in new]))
        finally:
            self.snapshots = snapshots
        seconds = time.perf_counter() - t0
        log.info(
            "runner.warm_up",
            rank=self.rank,
            seqs=count,
            tokens=count * seq,
            seconds=round(seconds, 2),
            error=result.error,
        )
        return seconds

    # ------------------------------------------------------------------ step

    def execute(self, plan: StepPlan, frames: Sequence[Any] = ()) -> StepResult:
        """frames: the plan message's frames (its TensorRefs name the multimodal inputs of new requests)."""
        t0 = time.perf_counter()
        self.result_tensors = []
        self._frames = frames
        try:
            with torch.inference_mode() if self.inference_mode else torch.no_grad():
                result = self._execute(plan)
        except CollectiveError:  # the tensor-parallel group is broken: this rank cannot go on
            raise
        except Exception as e:  # a bad step must not take the worker down
            log.error(
                "runner.step_failed",
                step_id=plan.step_id,
                error=repr(e),
                tb=traceback.format_exc(),
                request_ids=[r.request_id for r in plan.new] + [r.request_id for r in plan.cached],
            )
            return StepResult(step_id=plan.step_id, error=f"{type(e).__name__}: {e}")
        result.forward_s = time.perf_counter() - t0 - result.sample_s
        result.sp_forwards = sequence_parallel.take_forwards()
        return result

    def drop_all(self) -> None:
        """Forget every request (their scheduler was replaced)."""
        if self.eagle is not None:
            for rid in self.requests:
                self.eagle.drop(rid)
        self.requests.clear()
        self.block_table.clear()

    def drop_request(self, rid: str) -> None:
        """Forget one request (finished, aborted, preempted) and free its block-table row."""
        st = self.requests.pop(rid, None)
        if st is not None:
            self.block_table.free(st.row)
        if self.eagle is not None:
            self.eagle.drop(rid)

    def _apply_diff(self, plan: StepPlan) -> list[RequestState]:
        for rid in plan.finished_request_ids:
            self.drop_request(rid)
        scheduled: list[RequestState] = []
        for nr in plan.new:
            seed = nr.params.seed
            st = RequestState(
                request_id=nr.request_id,
                token_ids=list(nr.token_ids),
                num_prompt_tokens=nr.num_prompt_tokens,
                block_ids=list(nr.block_ids),
                num_computed_tokens=nr.num_computed_tokens,
                params=nr.params,
                generator=torch.Generator().manual_seed(seed) if seed is not None else None,
                pooling=nr.pooling,
                lora=nr.lora,
            )
            if nr.mm is not None:
                if self.images is None:
                    raise ValueError(f"request {nr.request_id} has images but the model takes none")
                st.images = self.images.request_images(nr.mm, self._frames)
            if nr.kv is not None:  # P/D decode: the prompt's KV computed by a prefill worker
                import_kv(self.kv_caches, st.block_ids, self.block_size, nr.kv, self._frames)
            st.kv_export = nr.kv_export
            if (held := self.requests.get(nr.request_id)) is not None:  # re-sent: replaced
                self.block_table.free(held.row)
            st.row = self.block_table.add(st.block_ids)
            self.requests[nr.request_id] = st
            scheduled.append(st)
        for cr in plan.cached:
            st = self.requests.get(cr.request_id)
            if st is None:
                raise KeyError(f"request {cr.request_id} is not held by this worker")
            st.block_ids.extend(cr.new_block_ids)
            self.block_table.extend(st.row, cr.new_block_ids)
            scheduled.append(st)
        if len(scheduled) != len(plan.num_scheduled_tokens):
            raise ValueError(f"{len(scheduled)} scheduled requests but {len(plan.num_scheduled_tokens)} token counts")
        return scheduled

    def _execute(self, plan: StepPlan) -> StepResult:
        scheduled = self._apply_diff(plan)
        # LoRA: adapters into slots; a request whose adapter failed to load ends with its error
        failed = self.lora.load(scheduled) if self.lora is not None else {}
        result = self._execute_work(plan, self._work(plan, scheduled, skip=failed))
        if failed:
            result.failed_request_ids, result.failed_errors = list(failed), list(failed.values())
        return result

    def _execute_work(self, plan: StepPlan, work: list[tuple[RequestState, int]]) -> StepResult:
        drafts = plan.draft_token_ids
        if not work:
            return StepResult(step_id=plan.step_id)
        if self.task == "embed":
            return self._execute_pooling(plan, work)
        if plan.multi_step:
            return self._execute_steps(plan, work)
        if self.buckets is not None:
            if drafts:
                raise ValueError("speculative decoding is not supported in bucketing mode")
            return self._execute_bucketed(plan, work, self.buckets)
        return self._execute_flat(plan, work)

    def _work(
        self, plan: StepPlan, scheduled: list[RequestState], skip: dict[str, str] | None = None
    ) -> list[tuple[RequestState, int]]:
        """(request, tokens this step) for each request with tokens scheduled, checked against
        what the request knows (its tokens, the plan's drafts) and max_model_len; `skip`: ids left out."""
        drafts = plan.draft_token_ids
        work = []
        for st, n in zip(scheduled, plan.num_scheduled_tokens):
            if n <= 0 or (skip and st.request_id in skip):
                continue
            c, k = st.num_computed_tokens, len(drafts.get(st.request_id, ()))
            if plan.multi_step:  # its last n - 1 tokens are its own samples, known once they are made
                k = n - 1
            if c + n > len(st.token_ids) + k or (k and c + n - k != len(st.token_ids)):
                raise ValueError(
                    f"request {st.request_id}: {c}+{n} tokens scheduled ({k} drafts) but {len(st.token_ids)} known"
                )
            if c + n > self.max_model_len:
                raise ValueError(
                    f"request {st.request_id}: position {c + n} exceeds max_model_len {self.max_model_len}"
                )
            work.append((st, n))
        return work

    def _execute_flat(self, plan: StepPlan, work: list[tuple[RequestState, int]]) -> StepResult:
        drafts = plan.draft_token_ids
        # flat batch: decodes (1 token) first, then verifications (1 + k tokens) by length (equal
        # ones share one attention call), then prefill chunks; plan order kept within each group
        verifying = sorted((w for w in work if w[0].request_id in drafts), key=lambda w: w[1]) if drafts else []
        decodes = [w for w in work if w[1] == 1]
        if self.lora is not None:  # one adapter's decodes side by side: one slice each, no gather
            decodes.sort(key=self.lora.row_order)
        flat = decodes + verifying + [w for w in work if w[1] != 1 and w[0].request_id not in drafts]
        input_ids: list[int] = []
        last_tok: dict[str, int] = {}
        for st, n in flat:
            c = st.num_computed_tokens
            d = drafts.get(st.request_id)
            input_ids.extend(st.token_ids[c : c + n] if d is None else [st.token_ids[c], *d])
            last_tok[st.request_id] = len(input_ids) - 1
        trees = {}  # flat index -> its draft tree's parents
        if plan.draft_parents:
            trees = {
                i: plan.draft_parents[st.request_id]
                for i, (st, _) in enumerate(flat)
                if st.request_id in plan.draft_parents
            }
        meta = AttentionMetadata.build(
            [n for _, n in flat],
            [st.num_computed_tokens for st, _ in flat],
            self.block_table.rows([st.row for st, _ in flat]),
            self.block_size,
            native=self.native,
            trees=trees,
            native_chunks=self.native_chunks,
        )
        if self.lora is not None:  # the step's rows mapped to their adapters' slots
            self.lora.map_rows(flat)
        if self.snapshots is not None:
            self.snapshots.begin(plan.step_id, contiguous_rows(flat), torch.tensor(input_ids), meta.positions)
        mm = {}
        if self.images is not None:  # image features replace their placeholder rows
            merged = batch_rows(
                [(st.images, st.num_computed_tokens, n, last_tok[st.request_id] - n + 1) for st, n in flat]
            )
            if merged is not None:
                mm = {"mm_rows": merged[0], "mm_embeds": merged[1]}
        hidden = self.model(
            torch.from_numpy(np.asarray(input_ids, dtype=np.int64)), meta.positions, self.kv_caches, meta, **mm
        )
        prompt_lps = (
            self._prompt_logprobs([(st, n, last_tok[st.request_id]) for st, n in work], hidden)
            if any(st.params.prompt_logprobs is not None for st, _ in work)
            else []
        )
        starts = {st.request_id: st.num_computed_tokens for st, _ in work}
        for st, n in work:
            if st.request_id not in drafts:  # verified requests move on in _sample
                st.num_computed_tokens += n
        samplers = [st for st, _ in work if st.request_id not in drafts and st.num_computed_tokens == len(st.token_ids)]
        verify = [st for st, _ in work if st.request_id in drafts]
        rows = [last_tok[st.request_id] for st in samplers]
        for st in verify:  # the last known token's row and each draft's
            last = last_tok[st.request_id]
            rows.extend(range(last - len(drafts[st.request_id]), last + 1))
        if rows == list(range(len(hidden))):  # every row samples, in order (a decode-only step): no gather
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(hidden[torch.tensor(rows)]) if rows else None
        first = [st for st in samplers if st.kv_export and len(st.token_ids) == st.num_prompt_tokens]
        kv = [
            export_kv(
                self.kv_caches, st.block_ids, self.block_size, st.num_prompt_tokens, st.request_id, self.result_tensors
            )
            for st in first
        ]  # P/D prefill: the prompt KV leaves
        paths: dict[str, list[int]] = {}
        result = self._sample(
            plan, samplers, logits, verify=verify, paths=paths, prompt_logprobs=prompt_lps, kv_exports=kv
        )
        if plan.want_features and self.eagle is not None:
            self._draft(plan, result, work, starts, last_tok, hidden, paths)
        return result

    def _execute_steps(self, plan: StepPlan, work: list[tuple[RequestState, int]]) -> StepResult:
        """Multi-step decoding: each request decodes its n scheduled tokens in n forwards, each fed
        the token the forward before sampled. Longest first, so forward s runs a prefix of the
        batch. One result carries every token: the scheduler applies the stop rules and drops
        whatever follows a stop."""
        for st, _ in work:
            if st.params.logprobs is not None or st.params.structured_outputs is not None:
                raise ValueError(f"request {st.request_id}: logprobs and structured outputs need one token per step")
        work = sorted(work, key=lambda w: -w[1])
        sts = [st for st, _ in work]
        run = DecodeRun(
            [st.num_computed_tokens for st in sts],
            [st.block_ids for st in sts],
            [n for _, n in work],
            self.block_size,
            self.native,
        )
        greedy = self.sampler.greedy_only(sts)  # min_tokens, once met, stays met for the whole run
        m, sample_s = len(work), 0.0
        for s in range(work[0][1]):
            while work[m - 1][1] <= s:
                m -= 1
            active = sts[:m]
            meta = run.meta(s, m)
            ids = torch.tensor([st.token_ids[-1] for st in active])
            if self.lora is not None:
                self.lora.map_rows([(st, 1) for st in active])
            logits = self.model.compute_logits(self.model(ids, meta.positions, self.kv_caches, meta))
            t0 = time.perf_counter()
            toks = tp_broadcast_ids(greedy_ids(logits).tolist() if greedy else self.sampler(logits, active)[0])
            sample_s += time.perf_counter() - t0
            for st, t in zip(active, toks):
                st.num_computed_tokens += 1
                st.token_ids.append(t)
        return StepResult(
            step_id=plan.step_id,
            request_ids=[st.request_id for st in sts],
            sampled_token_ids=[t for st, n in work for t in st.token_ids[-n:]],
            num_sampled=[n for _, n in work],
            sample_s=sample_s,
        )

    def _draft(
        self,
        plan: StepPlan,
        result: StepResult,
        work: list[tuple[RequestState, int]],
        starts: dict[str, int],
        last_tok: dict[str, int],
        hidden: torch.Tensor,
        paths: dict[str, list[int]],
    ) -> None:
        """EAGLE: extend each request's head KV over the positions that became valid this step
        (a prompt chunk, or the last known token plus the accepted drafts) with their hidden
        states and following tokens, and draft for plan.num_drafts. A failure costs only drafts.
        paths: a verified tree's accepted drafts, whose rows hold the features."""
        rids, cs, toks, feats, ks, tables = [], [], [], [], [], []
        for st, n in work:
            c = starts[st.request_id]
            m = st.num_computed_tokens - c  # valid positions c..c+m-1
            follow = st.token_ids[c + 1 : c + 1 + m]
            if m <= 0 or len(follow) < m:
                continue
            first = last_tok[st.request_id] - n + 1
            rids.append(st.request_id)
            cs.append(c)
            toks.append(follow)
            path = paths.get(st.request_id)
            feats.append(
                hidden[first : first + m]
                if path is None
                else hidden[torch.tensor([first, *(first + 1 + a for a in path)])]
            )
            ks.append(plan.num_drafts.get(st.request_id, 0))
            tables.append(st.block_ids)
        try:
            drafts, parents = self.eagle.propose(rids, cs, toks, feats, ks, tables)
        except (ValueError, RuntimeError, IndexError) as e:
            log.error("eagle.propose_failed", step_id=plan.step_id, error=repr(e))
            for rid in rids:  # their head state may be half-updated
                self.eagle.drop(rid)
            return
        for i, (rid, d) in enumerate(zip(rids, drafts)):
            if d:
                result.draft_request_ids.append(rid)
                result.draft_token_ids.append(d)
                if parents is not None:
                    result.draft_parents.append(parents[i])

    def _execute_pooling(self, plan: StepPlan, work: list[tuple[RequestState, int]]) -> StepResult:
        """Encoder step: each scheduled request is a whole prompt; one forward, one pooled
        vector per request ([N, dim] float32, sent as the result's extra frame). Done requests
        leave this worker at once."""
        for st, n in work:
            if st.pooling is None or st.num_computed_tokens or n != len(st.token_ids):
                raise ValueError(f"request {st.request_id}: an embed request must be scheduled whole in one step")
        lens = [n for _, n in work]
        ids = torch.from_numpy(np.fromiter((t for st, _ in work for t in st.token_ids), dtype=np.int64))
        hidden = self.model(ids, EncoderBatch.build(lens))
        pooled = self.model.pool(hidden, lens, [st.pooling.normalize for st, _ in work])  # type: ignore[union-attr]
        for st, _ in work:
            self.drop_request(st.request_id)
        self.result_tensors = [pooled]
        return StepResult(
            step_id=plan.step_id, pooled_request_ids=[st.request_id for st, _ in work], pooled=tensor_ref(1, pooled)
        )

    def _prompt_logprobs(
        self, rows: list[tuple[RequestState, int, int]], hidden: torch.Tensor, compute_logits=None
    ) -> list[PromptLogprobs]:
        """For prompt_logprobs requests: logprobs of the prompt tokens this chunk predicts.

        A chunk covers positions c..c+n-1 in hidden rows last-n+1..last; row j predicts prompt
        token c+j+1 (token 0 has no logprob). Before num_computed_tokens moves on.
        compute_logits: hidden rows -> logits (default: the model's LM head)."""
        compute_logits = compute_logits or self.model.compute_logits
        out = []
        for st, n, last in rows:
            k, c = st.params.prompt_logprobs, st.num_computed_tokens
            m = min(n, st.num_prompt_tokens - 1 - c)  # rows whose target is still a prompt token
            if k is None or m <= 0:
                continue
            entries: list[TokenLogprobs] = []
            first = last - n + 1
            for j in range(0, m, _LOGPROB_ROWS):  # one [rows, vocab] tensor alive at a time
                rows = min(_LOGPROB_ROWS, m - j)
                logits = compute_logits(hidden[first + j : first + j + rows]).float()
                lse = logits.logsumexp(dim=-1, keepdim=True)
                target = torch.tensor(st.token_ids[c + 1 + j : c + 1 + j + rows])
                chosen = logits.gather(1, target[:, None])
                ranks = ((logits > chosen).sum(dim=-1) + 1).tolist()
                top_l, top_ids = logits.topk(k, dim=-1) if k else (logits[:, :0], logits[:, :0].long())
                entries += [
                    TokenLogprobs(logprob=v, rank=r, top_ids=ti, top_logprobs=tl)
                    for v, r, ti, tl in zip(
                        (chosen - lse)[:, 0].tolist(), ranks, top_ids.tolist(), (top_l - lse).tolist()
                    )
                ]
            out.append(PromptLogprobs(st.request_id, c + 1, entries))
        return out

    # ------------------------------------------------------------------ bucketing mode

    def bucket_shape(self, work: list[tuple[RequestState, int]], b: BucketConfig) -> tuple[str, int, int, int]:
        """The smallest bucket shape that fits: token generation when every item is one token
        (and the batch fits a decode bucket), else context encoding (1-token items padded)."""
        kv = max(st.num_computed_tokens + n for st, n in work)
        q = max(n for _, n in work)
        if q == 1 and len(work) <= b.max_decode_batch:
            return b.decode_shape(len(work), kv)
        if len(work) > b.max_context_batch or q > b.max_context_len:
            raise ValueError(
                f"step of {len(work)} sequences, longest chunk {q}, fits no context-encoding "
                f"bucket (batch <= {b.max_context_batch}, length <= {b.max_context_len})"
            )
        return b.prefill_shape(len(work), q, kv)

    def _execute_bucketed(self, plan: StepPlan, work: list[tuple[RequestState, int]], b: BucketConfig) -> StepResult:
        """One forward on a padded static shape; only the bucket choice depends on the data."""
        shape = self.bucket_shape(work, b)
        new_shapes = []
        if shape not in self.shapes:
            self.shapes.add(shape)
            new_shapes.append(shape)
            log.info("runner.new_shape", shape=shape, num_shapes=len(self.shapes))
        meta, src, last = build_static(
            [n for _, n in work],
            [st.num_computed_tokens for st, _ in work],
            [st.block_ids for st, _ in work],
            self.block_size,
            shape,
            self.pad_block,
        )
        flat = np.fromiter(
            (t for st, n in work for t in st.token_ids[st.num_computed_tokens : st.num_computed_tokens + n]),
            dtype=np.int64,
        )
        input_ids = np.where(src >= 0, flat[np.maximum(src, 0)], 0)
        if self.snapshots is not None:
            self.snapshots.begin(plan.step_id, padded_rows(work, src), torch.from_numpy(input_ids), meta.positions)
        hidden = self.model(torch.from_numpy(input_ids), meta.positions, self.kv_caches, meta)
        # logits for every batch row (static [batch, vocab]); padding rows read row 0
        rows = np.zeros(shape[1], dtype=np.int64)
        rows[: len(work)] = last
        logits = self.model.compute_logits(hidden[torch.from_numpy(rows)])
        prompt_lps = self._prompt_logprobs([(st, n, int(last[i])) for i, (st, n) in enumerate(work)], hidden)
        for st, n in work:
            st.num_computed_tokens += n
        pick = [i for i, (st, _) in enumerate(work) if st.num_computed_tokens == len(st.token_ids)]
        samplers = [work[i][0] for i in pick]
        return self._sample(
            plan,
            samplers,
            logits[torch.tensor(pick)] if pick else None,
            new_shapes=new_shapes,
            prompt_logprobs=prompt_lps,
        )

    def _sample(
        self,
        plan: StepPlan,
        samplers: list,
        logits: torch.Tensor | None,
        verify: list[RequestState] = (),
        paths: dict[str, list[int]] | None = None,
        **extra: Any,
    ) -> StepResult:
        """Sample one token per finished request (the first len(samplers) rows of `logits`),
        and verify the drafts of `verify` (the rows after those); append, report. A verified
        tree's accepted drafts go into `paths`, their K/V moved to the consecutive slots after
        the last known token's."""
        if not samplers and not verify:
            return StepResult(step_id=plan.step_id, **extra)
        t0 = time.perf_counter()
        n = len(samplers)
        ids: list[int] = []
        logprobs = None
        if samplers:
            head = logits[:n]
            if self.snapshots is not None:  # raw logits, before any mask or penalty
                self.snapshots.add_logits([st.request_id for st in samplers], head)
            self.structured.mask_logits(head, samplers)
            ids, logprobs = self.sampler(head, samplers)
            ids = tp_broadcast_ids(ids)
            self.structured.accept(samplers, ids)
            for st, t in zip(samplers, ids):
                st.token_ids.append(t)
        counts: list[int] = []
        if verify:
            drafts = [plan.draft_token_ids[st.request_id] for st in verify]
            trees = [plan.draft_parents.get(st.request_id) for st in verify]
            chains = [list(range(-1, len(d) - 1)) for d in drafts]
            width = max(len(d) for d in drafts) + 1
            out = tp_broadcast_ragged(
                self.sampler.verify(logits[n:], verify, drafts, [t or c for t, c in zip(trees, chains)]), width
            )
            for st, d, tree, toks in zip(verify, drafts, trees, out):
                if tree is not None:
                    path = tree_path(d, tree, toks)
                    self._move_path(st, path)
                    if paths is not None:
                        paths[st.request_id] = path
                st.num_computed_tokens += len(toks)  # the last known token and the accepted drafts
                st.token_ids.extend(toks)
                ids.extend(toks)
                counts.append(len(toks))
            if logprobs is not None:
                logprobs.extend([None] * len(verify))
        return StepResult(
            step_id=plan.step_id,
            request_ids=[st.request_id for st in (*samplers, *verify)],
            sampled_token_ids=ids,
            logprobs=logprobs,
            num_sampled=[1] * n + counts if verify else [],
            sample_s=time.perf_counter() - t0,
            **extra,
        )

    def _move_path(self, st: RequestState, path: list[int]) -> None:
        """Draft a of a verified tree sits at slot position c + 1 + a; accepted as the i-th token
        after the last known one (at c), it belongs at c + 1 + i."""
        moves = [(st.num_computed_tokens + 1 + a, st.num_computed_tokens + 1 + i) for i, a in enumerate(path) if a != i]
        if moves:
            bs, ids = self.block_size, st.block_ids
            src, dst = ([ids[p // bs] * bs + p % bs for p in ps] for ps in zip(*moves))
            move_slots(self.kv_caches, src, dst)


def _check_encoder_config(config: EngineConfig, mc: ModelConfig, max_model_len: int) -> None:
    """An encoder runs each prompt whole within its absolute-position table, unbucketed."""
    if config.bucketing:
        raise ValueError("bucketing mode is not supported for the embed task")
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the encoder's {mc.max_position_embeddings} positions")
