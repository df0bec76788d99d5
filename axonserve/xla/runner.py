"""The worker rank's model runner on a torch-xla device: static shapes, compiled once per bucket.

Same contract as neuron/model_runner.py's ModelRunner (`execute(StepPlan) -> StepResult`), whose
request bookkeeping it inherits; what differs is where tensors live and how a step runs:

* Every step is padded to a bucket shape (engine/buckets.py; the scheduler plans bucketed steps) and
  runs as two graphs: the forward (embedding, layers, paged KV writes by `index_copy_` into device
  pools, attention over the gathered, padded block table, LM head on each sequence's last row), then
  sampling (xla/sampling.py) for the batch bucket. Step inputs travel as one int64 array; the
  attention mask is built on the device from the positions. Only token ids (and logprobs when asked
  for) come back.
* Every forward shape and every (batch, sampling variant) is compiled at start-up (`warm_up`), with
  a progress bar and a log line per bucket; serving then compiles nothing. A compilation while
  serving is logged (`xla.recompiled`) and counted in the step result, as are start-up compiles,
  for the metrics actor.
* Rows that need host-side logits processing (structured output, penalties, logit_bias, allowed
  ids, min_tokens pending) take their logits to the host and the CPU sampler; the others never leave.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np
import structlog
import torch
import torch.nn.functional as F
from tqdm import tqdm

from axonserve.config import EngineConfig
from axonserve.engine.buckets import BucketConfig, bucket_shapes
from axonserve.engine.sliding_window import resolve as resolve_sliding_window
from axonserve.neuron.block_table import BlockTable
from axonserve.neuron.config import ModelConfig
from axonserve.neuron.loader import load_model
from axonserve.neuron.model_runner import DTYPES, ModelRunner, RequestState
from axonserve.neuron.ops import native
from axonserve.neuron.ops.attention import AttentionMetadata, build_static
from axonserve.neuron.parallel import TPInfo, init_tensor_parallel, tp_all_gather_last, tp_broadcast_ids
from axonserve.neuron.sampler import Sampler
from axonserve.protocol.messages import StepPlan, StepResult, TokenLogprobs
from axonserve.structured_output.worker import StructuredDecoding
from axonserve.xla import sampling
from axonserve.xla.device import CompileCounter, cache_key, import_xla, init_compile_cache, pjrt_device

log = structlog.get_logger()

Shape = tuple[str, int, int, int]


class XlaModelRunner(ModelRunner):
    inference_mode = False

    def __init__(self, config: EngineConfig, rank: int = 0, dist_init: str | None = None):
        torch_xla = import_xla()
        self._sync = torch_xla.sync
        native.disable()  # the C++ kernels take host tensors only
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype {config.dtype!r} is not supported; supported: {sorted(DTYPES)}")
        self.config, self.rank = config, rank
        self.dtype = DTYPES[config.dtype]
        torch.manual_seed(config.seed)
        init_tensor_parallel(rank, config.num_workers, dist_init, timeout_s=config.dist_timeout_s, device="xla")
        # its compiled graphs attend to every key: sliding windows only as --disable-sliding-window
        mc, max_len = resolve_sliding_window(config, ModelConfig.from_dir(config.model))
        self.task = config.task
        b = BucketConfig.from_engine_config(config, mc.max_model_len_for(max_len))
        self.max_model_len = min(mc.max_model_len_for(max_len), b.max_kv_len)
        self.buckets = BucketConfig.from_engine_config(config, self.max_model_len)
        self.shapes: set[Shape] = set()
        self.model_config = dataclasses.replace(
            mc, max_position_embeddings=max(mc.max_position_embeddings, self.max_model_len)
        )
        self.eos_token_ids, self.vocab_size, self.block_size = mc.eos_token_ids, mc.vocab_size, config.block_size
        self.structured = StructuredDecoding(config.model, self.vocab_size, self.eos_token_ids, enabled=rank == 0)
        # before anything runs on the device: XLA reads the cache location at its first compile
        self.cache_dir = init_compile_cache(
            config.compile_cache_dir, cache_key(config, self.model_config, self.buckets.as_dict()), rank
        )
        self.counter = CompileCounter()
        self.device = torch_xla.device()
        # a sequence never needs more blocks than max_model_len; all seats full at that length is the cap
        per_seq = -(-self.max_model_len // self.block_size)
        self.num_kv_blocks = config.num_kv_blocks or min(self._auto_num_blocks(), config.max_num_seqs * per_seq)
        self.pad_block = self.num_kv_blocks  # scratch block for padding rows' K/V writes
        model = load_model(self.model_config, self.dtype, progress=rank == 0, pack=False)
        self.model = model.to(self.device)
        mc_ = self.model_config
        shape = (self.num_kv_blocks + 1, self.block_size, max(1, mc_.num_kv_heads // TPInfo.size), mc_.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(mc_.num_layers)
        ]
        self._sync()  # weights and pools become device data: the first step's graph is a step's graph
        self._head_cpu: torch.Tensor | None = None  # prompt logprobs: the LM head on the host, made on demand
        self.result_tensors: list[torch.Tensor] = []
        self.sampler = Sampler(self.eos_token_ids, config.seed)  # rows processed on the host
        self.native = None
        self.requests: dict[str, RequestState] = {}
        self.block_table = BlockTable()
        self.seeds: dict[str, int] = {}  # request -> the seed its uniforms hash (xla/sampling.py)
        self._seed_rng = np.random.default_rng(config.seed)  # seeds of unseeded requests
        self.snapshots = None
        self.images = None
        self.eagle = None
        self._frames: Sequence = ()
        self.startup_compile_s: list[float] = []
        self.startup_compile_cache_hits = 0
        log.info(
            "runner.ready",
            rank=rank,
            device=str(self.device),
            pjrt=pjrt_device(),
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            buckets=self.buckets.as_dict(),
            compile_cache=str(self.cache_dir),
        )

    # ------------------------------------------------------------------ start-up compilation

    def warm_up(self) -> float:
        """Compile every bucket: each forward shape, then sampling for each batch bucket and variant,
        on padding-only inputs (they write only the scratch block). Returns the seconds taken."""
        t_all = time.perf_counter()
        shapes = bucket_shapes(self.buckets, self.max_model_len)
        batches = sorted({s[1] for s in shapes})
        jobs = [("forward", s) for s in shapes] + [("sample", (kind, b)) for b in batches for kind in sampling.VARIANTS]
        for what, key in tqdm(jobs, desc="compiling buckets", unit="graph", disable=self.rank != 0, leave=False):
            t0 = time.perf_counter()
            if what == "forward":
                self._forward(key, [], [], [], [])
                self.shapes.add(key)
            else:
                kind, b = key
                logits = torch.zeros((b, self.vocab_size), device=self.device)
                self._sync()  # device data, as a forward's logits are: else zeros() joins the graph
                floats, ints = sampling.row_params([], [], [], b, self.vocab_size)
                self._run_sampler(logits, floats, ints, kind)
            compiled = self.counter.compiles()
            self.startup_compile_s += compiled
            log.info(
                "xla.bucket_compiled",
                graph=what,
                shape=list(key),
                compiles=len(compiled),
                seconds=round(time.perf_counter() - t0, 3),
            )
        cache = self.counter.cache_deltas()
        self.startup_compile_cache_hits = cache["PersistentCacheHit"]
        seconds = time.perf_counter() - t_all
        log.info(
            "xla.compiled",
            rank=self.rank,
            graphs=len(jobs),
            compiles=len(self.startup_compile_s),
            compile_seconds=round(sum(self.startup_compile_s), 2),
            seconds=round(seconds, 2),
            cache_dir=str(self.cache_dir),
            cache_hits=cache["PersistentCacheHit"],
            cache_misses=cache["PersistentCacheMiss"],
            cache_load_failures=cache["PersistentCacheDeserializeFailure"],
        )
        return seconds

    # ------------------------------------------------------------------ step

    def _apply_diff(self, plan: StepPlan) -> list[RequestState]:
        for rid in plan.finished_request_ids:
            self.seeds.pop(rid, None)
        scheduled = super()._apply_diff(plan)
        for nr in plan.new:  # every rank draws the same seeds: the same plans in the same order
            drawn = int(self._seed_rng.integers(1 << 62))
            self.seeds[nr.request_id] = nr.params.seed if nr.params.seed is not None else drawn
        return scheduled

    def drop_all(self) -> None:
        super().drop_all()
        self.seeds.clear()

    def _execute(self, plan: StepPlan) -> StepResult:
        if plan.draft_token_ids or plan.multi_step:
            raise ValueError("speculative and multi-step plans are not supported on the XLA device")
        work = self._work(plan, self._apply_diff(plan))
        if not work:
            return StepResult(step_id=plan.step_id)
        shape = self.bucket_shape(work, self.buckets)
        if shape not in self.shapes:  # outside the compiled set: it will compile now
            self.shapes.add(shape)
            log.warning("xla.new_shape", shape=list(shape))
        hidden, logits, last = self._forward(
            shape,
            [n for _, n in work],
            [st.num_computed_tokens for st, _ in work],
            [st.block_ids for st, _ in work],
            [st.token_ids[st.num_computed_tokens : st.num_computed_tokens + n] for st, n in work],
        )
        prompt_lps = []
        if any(st.params.prompt_logprobs is not None for st, _ in work):
            h = hidden.cpu()
            prompt_lps = self._prompt_logprobs(
                [(st, n, int(last[i])) for i, (st, n) in enumerate(work)], h, self._host_logits
            )
        for st, n in work:
            st.num_computed_tokens += n
        result = self._sample_rows(plan, work, logits, shape[1])
        result.prompt_logprobs = prompt_lps
        compiled = self.counter.compiles()
        if compiled:
            log.warning(
                "xla.recompiled", step_id=plan.step_id, shape=list(shape), seconds=[round(s, 3) for s in compiled]
            )
        result.compile_s = compiled
        result.compile_cache_hits = self.counter.cache_deltas()["PersistentCacheHit"]
        return result

    def _forward(
        self,
        shape: Shape,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        tokens: list[list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """One padded forward; returns (hidden [batch * query, H], logits of each sequence's last row
        [batch, V], those rows), materialized on the device."""
        phase, nb, nq, kv = shape
        meta_h, src, last = build_static(query_lens, context_lens, block_tables, self.block_size, shape, self.pad_block)
        flat = np.fromiter((t for toks in tokens for t in toks), dtype=np.int64, count=sum(query_lens))
        ids = np.where(src >= 0, flat[np.maximum(src, 0)], 0) if len(flat) else np.zeros(nb * nq, dtype=np.int64)
        rows = np.zeros(nb, dtype=np.int64)
        rows[: len(last)] = last
        table = (meta_h.decode_block_table if phase == "decode" else meta_h.prefill_block_table).numpy()
        t = nb * nq
        packed = np.concatenate([ids, meta_h.positions.numpy(), meta_h.slot_mapping.numpy(), table.reshape(-1), rows])
        dev = torch.from_numpy(packed).to(self.device)  # one host-to-device transfer per step
        pos = dev[t : 2 * t]
        meta = AttentionMetadata(positions=pos, slot_mapping=dev[2 * t : 3 * t])
        table_d = dev[3 * t : 3 * t + table.size].view(table.shape)
        mask = torch.arange(kv, device=self.device)[None, None, :] <= pos.view(nb, nq)[:, :, None]
        if phase == "decode":
            meta.num_decodes, meta.decode_block_table, meta.decode_mask = nb, table_d, mask[:, :, None, :]
        else:
            meta.static_prefill, meta.prefill_block_table, meta.prefill_mask = (nb, nq), table_d, mask[:, None]
        hidden = self.model(dev[:t], pos, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden.index_select(0, dev[-nb:]))
        del dev, pos, meta, table_d, mask
        self._sync()
        return hidden, logits, last

    def _run_sampler(self, logits: torch.Tensor, floats: np.ndarray, ints: np.ndarray, kind: str):
        f = torch.from_numpy(floats).to(self.device)
        i = torch.from_numpy(ints).to(self.device)
        out = sampling.sample(logits, f, i, kind)
        self._sync()
        return out

    def _needs_host(self, st: RequestState) -> bool:
        return st.params.structured_outputs is not None or self.sampler._needs_processing(st)

    def _sample_rows(
        self, plan: StepPlan, work: list[tuple[RequestState, int]], logits: torch.Tensor, batch: int
    ) -> StepResult:
        """One token for each sequence whose prompt is done: on the device, except rows that need the
        host's logits processing."""
        t0 = time.perf_counter()
        pick = [i for i, (st, _) in enumerate(work) if st.num_computed_tokens == len(st.token_ids)]
        if not pick:
            return StepResult(step_id=plan.step_id)
        sts = [work[i][0] for i in pick]
        host = [j for j, st in enumerate(sts) if self._needs_host(st)]
        params = [st.params for st in sts]
        floats, ints = sampling.row_params(
            [work[i][0].params if i in pick else _GREEDY for i in range(len(work))],
            [self.seeds[st.request_id] for st, _ in work],
            [len(st.token_ids) for st, _ in work],
            batch,
            self.vocab_size,
        )
        kind = sampling.variant(params)
        out = self._run_sampler(logits, floats, ints, kind)
        ids_all = out[0].cpu().numpy()
        ids = [int(ids_all[i]) for i in pick]
        want_lp = any(p.logprobs is not None for p in params)
        lps: list[TokenLogprobs | None] | None = None
        if want_lp:
            chosen, rank, top_lp, top_ids = (x.cpu().numpy() for x in out[1:])
            lps = [_token_logprobs(p.logprobs, chosen[i], rank[i], top_lp[i], top_ids[i]) for i, p in zip(pick, params)]
        if host:  # their rows' logits come to the host once, for the CPU sampler
            rows = logits.cpu()[torch.tensor([pick[j] for j in host])]
            hs = [sts[j] for j in host]
            self.structured.mask_logits(rows, hs)
            h_ids, h_lps = self.sampler(rows, hs)
            self.structured.accept(hs, h_ids)
            for j, t, k in zip(host, h_ids, range(len(host))):
                ids[j] = t
                if lps is not None:
                    lps[j] = h_lps[k] if h_lps is not None else None
        ids = tp_broadcast_ids(ids)
        for st, t in zip(sts, ids):
            st.token_ids.append(t)
        return StepResult(
            step_id=plan.step_id,
            request_ids=[st.request_id for st in sts],
            sampled_token_ids=ids,
            logprobs=lps,
            sample_s=time.perf_counter() - t0,
        )

    def _host_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Prompt logprobs: logits of host hidden rows through a host copy of the LM head (made the
        first time a request asks), so the device runs no graph that depends on the request."""
        if self._head_cpu is None:
            self._head_cpu = self.model.lm_head.weight.detach().cpu()
        return tp_all_gather_last(F.linear(hidden, self._head_cpu))[:, : self.vocab_size]


_GREEDY = sampling.GREEDY


def _token_logprobs(n: int | None, chosen, rank, top_lp, top_ids) -> TokenLogprobs | None:
    if n is None:
        return None
    if n == 0:
        return TokenLogprobs(logprob=float(chosen), rank=int(rank))
    return TokenLogprobs(
        logprob=float(chosen), rank=int(rank), top_ids=top_ids[:n].tolist(), top_logprobs=top_lp[:n].tolist()
    )
