"""Scheduler actor: owns request state and drives the worker ranks one step at a time.

Sockets: ROUTER (clients' DEALERs: requests in, per-client output batches out by identity),
XPUB (one step plan reaches every rank), PULL (rank 0's step results). Client messages are
handled by their own task between steps, so requests join the running batch at the next
step and aborts apply before the next plan. Any worker failure fails every in-flight
request with an error delta and tells every client the engine is dead — never a hang.
Profiler start/stop requests are queued and sent to the ranks between steps (they share the
plan and result sockets with steps, so the two never interleave).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque

import msgspec
import zmq

from axonserve import __version__
from axonserve.actors.runtime import Actor, bus_socket, data_message_bytes
from axonserve.engine.buckets import BucketConfig
from axonserve.engine.disagg import PrefillPool, attach_kv, exported_kv
from axonserve.engine.request import Request, Status
from axonserve.engine.scheduler import Scheduler, SchedulerConfig
from axonserve.multimodal.scheduler import ImageSpec, check_images
from axonserve.neuron.pooling import resolve_task
from axonserve.protocol import ClientToEngine, Codec, DecodeError, TensorRef
from axonserve.protocol.codec import ref_frame
from axonserve.protocol.messages import (
    AbortRequest,
    AddRequest,
    DraftRequest,
    DraftResult,
    EngineDead,
    EngineInfo,
    EncodeImages,
    EngineStats,
    GetEngineInfo,
    GetStats,
    ImagesEncoded,
    KVBlocks,
    Outputs,
    ParamError,
    ProfileAck,
    ProfileCommand,
    ProfileStatus,
    RequestDelta,
    StartProfile,
    StepPlan,
    StepResult,
    StepStats,
    StopProfile,
    WorkerReply,
)

_client_codec = Codec(ClientToEngine)
_result_codec = Codec(WorkerReply)
_draft_codec = Codec(DraftResult)
_encoded_codec = Codec(ImagesEncoded)
PROFILE_TIMEOUT_S = 120.0  # stopping writes every rank's trace


class SchedulerActor(Actor):
    kind = "scheduler"
    dead_reason: str | None = None  # set once the engine can serve no more (also before setup ends)

    async def setup(self) -> dict:
        a = self.addresses
        self.router = self.socket(zmq.ROUTER, a.engine, bind=True)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.pub = bus_socket(self.ctx, zmq.XPUB, data_message_bytes(self.config))
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every rank's subscription, not just the first
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.setsockopt(zmq.LINGER, 2000)
        self.pub.bind(a.plan)
        self.pull = self.socket(zmq.PULL, a.result, bind=True)
        self.result_frames: list = []  # the last step result's frames (tensor frames forwarded as they are)
        self._drafted: set[str] = set()  # requests the drafter holds state for
        spec = self.config.speculative
        self.drafter = self.socket(zmq.DEALER, a.drafter) if spec and spec.uses_drafter else None
        info = await asyncio.wait_for(self.configured, self.config.ready_timeout_s)
        await self._wait_subscribers(self.config.num_workers)
        max_len = int(info["max_model_len"])
        self.task = resolve_task(self.config.model, self.config.task)
        embed = self.task == "embed"  # an encoder: no KV pool, every prompt runs whole in one step
        buckets = BucketConfig.from_engine_config(self.config, max_len) if self.config.bucketing else None
        pool_tokens = int(info["num_kv_blocks"]) * self.config.block_size
        if pool_tokens < max_len and not embed:  # one sequence must always fit, or preemption cannot help
            self.log.warning("max_model_len_clamped", max_model_len=max_len, kv_pool_tokens=pool_tokens)
            max_len = pool_tokens
        self.sched = Scheduler(
            SchedulerConfig(
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=max(self.config.max_num_batched_tokens, max_len if embed else 1),
                max_model_len=max_len,
                block_size=self.config.block_size,
                num_kv_blocks=int(info["num_kv_blocks"]),
                vocab_size=int(info["vocab_size"]),
                eos_token_ids=frozenset(info["eos_token_ids"]),  # type: ignore[arg-type]
                enable_prefix_caching=self.config.enable_prefix_caching,
                enable_chunked_prefill=self.config.enable_chunked_prefill,
                policy=self.config.scheduling_policy,
                buckets=buckets,
                task=self.task,
                speculative=self.config.speculative,
                async_scheduling=self.config.async_scheduling and self.config.speculative is None
                and buckets is None and self.config.role == "both",
                num_scheduler_steps=self.config.num_scheduler_steps,
            )
        )
        self.engine_info = EngineInfo(
            model=self.config.model,
            served_model_name=self.config.served_model_name or self.config.model,
            max_model_len=max_len,
            block_size=self.config.block_size,
            num_kv_blocks=self.sched.cfg.num_kv_blocks,
            max_num_seqs=self.config.max_num_seqs,
            eos_token_ids=sorted(self.sched.cfg.eos_token_ids),
            vocab_size=self.sched.cfg.vocab_size,
            version=__version__,
            task=self.task,
            limits=self.config.limits,
        )
        self.clients: set[bytes] = set()
        self.num_rejected_overload = 0
        self._last_counters = (0,) * 8
        self._last_per_pos: list[int] = []
        self._owner: dict[str, bytes] = {}  # request id -> client identity
        self._deadlines: dict[str, float] = {}  # request id -> monotonic deadline (--request-timeout)
        self.pooled_rows: dict[str, memoryview] = {}  # the last result's vectors, by request id
        self._dead = asyncio.Event()
        self._work = asyncio.Event()
        self._profile_q: deque[tuple[bytes, str]] = deque()  # (client, start|stop), run between steps
        self._profile_seq = 0
        self._profiling = False
        # vision-language models: image checks; with an encoder pool, requests wait here for
        # their features (request id -> request) before they join the queue
        self.image_spec = ImageSpec.from_info(info)
        self.encoding: dict[str, Request] = {}
        self.encoder_router = self.socket(zmq.DEALER, a.router, identity=b"scheduler") \
            if self.config.encoder_workers and a.router else None
        self.mm_images = self.mm_cache_hits = 0
        # P/D disaggregation: a decode engine hands prompts to the prefill engine first
        self.prefill = PrefillPool(self, a.prefill) \
            if self.config.role == "decode" else None
        self.kv_rows: dict = {}  # P/D prefill: the last result's exported KV, by request id
        return {"num_kv_blocks": self.sched.cfg.num_kv_blocks, "max_model_len": max_len}

    async def _wait_subscribers(self, n: int) -> None:
        """XPUB reports each SUB's subscription: plans sent before that would be lost."""
        seen = 0
        while seen < n:
            frame = await asyncio.wait_for(self.pub.recv(), self.config.ready_timeout_s)
            if frame[:1] == b"\x01":
                seen += 1

    async def run(self) -> None:
        tasks = [
            asyncio.create_task(self._client_loop(), name="clients"),
            asyncio.create_task(self._step_loop(), name="steps"),
        ]
        if self.encoder_router is not None:
            tasks.append(asyncio.create_task(self._encoded_loop(), name="encoded"))
        if self.prefill is not None:
            tasks.append(asyncio.create_task(self.prefill.run(), name="prefilled"))
        if self.config.request_timeout_s:
            tasks.append(asyncio.create_task(self._expire_loop(), name="deadlines"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()
        finally:
            for t in tasks:
                t.cancel()

    # ------------------------------------------------------------------ clients

    async def _client_loop(self) -> None:
        while True:
            frames = await self.router.recv_multipart(copy=False)
            ident = frames[0].bytes
            try:
                msg, _ = _client_codec.decode(frames[1:])
            except DecodeError as e:
                self.dropped("client message", e, sender=ident.decode(errors="replace"))
                continue
            self.clients.add(ident)
            if isinstance(msg, AddRequest):
                await self._add(ident, msg, frames[1:])
            elif isinstance(msg, AbortRequest):
                aborted = self.sched.abort(msg.request_ids)
                aborted += [r for rid in msg.request_ids if (r := self.encoding.pop(rid, None)) is not None]
                if self.prefill is not None:
                    aborted += await self.prefill.abort(msg.request_ids)
                if aborted:
                    await self._send_deltas([self._final(r) for r in aborted])
            elif isinstance(msg, GetStats):
                await self._send(ident, self._engine_stats())
            elif isinstance(msg, (StartProfile, StopProfile)):
                await self._profile_command(ident, "start" if isinstance(msg, StartProfile) else "stop")
            elif isinstance(msg, GetEngineInfo):
                await self._send(ident, self.engine_info)
                if self.dead_reason is not None:
                    await self._send(ident, EngineDead(self.dead_reason))

    async def _profile_command(self, ident: bytes, action: str) -> None:
        """Queue a profiler start/stop for the step loop, or refuse it at once (409) when it
        cannot apply: one command at a time, no start while profiling, no stop while not."""
        refuse: tuple[int, str] | None = None
        if not self.config.profile_dir:
            refuse = 400, "profiling is disabled: start the server with --profile-dir DIR"
        elif self.dead_reason is not None:
            refuse = 503, f"engine is dead: {self.dead_reason}"
        elif self._profile_q:
            refuse = 409, "a profiler command is already in progress"
        elif action == "start" and self._profiling:
            refuse = 409, "the profiler is already running"
        elif action == "stop" and not self._profiling:
            refuse = 409, "the profiler is not running"
        if refuse is not None:
            await self._send(ident, ProfileStatus(action, code=refuse[0], error=refuse[1]))
            return
        self._profile_q.append((ident, action))
        self._work.set()

    async def _add(self, ident: bytes, msg: AddRequest, frames: list) -> None:
        def reject(why: str, code: int = 400) -> RequestDelta:
            self.log.warning("request.rejected", request_id=msg.request_id, reason=why, code=code)
            return RequestDelta(msg.request_id, finish_reason="error", error=why, error_code=code)

        if self.dead_reason is not None:
            await self._send(ident, Outputs([reject(f"engine is dead: {self.dead_reason}", 503)]))
            return
        overload = self._overloaded(len(msg.prompt_token_ids))
        if overload is not None:
            self.num_rejected_overload += 1
            await self._send(ident, Outputs([reject(f"server overloaded: {overload}; retry later", 503)]))
            return
        try:
            msg.params.check_limits(self.config.limits)
            msg.params.validate()
        except ParamError as e:
            await self._send(ident, Outputs([reject(str(e))]))
            return
        req = Request(
            msg.request_id,
            ident,
            msg.prompt_token_ids,
            msg.params,
            self.sched.cfg.max_model_len,
            priority=msg.priority,
            arrival_time=msg.arrival_time or None,
            pooling=msg.pooling,
        )
        req.kv_export = msg.kv_export and self.config.role == "prefill"
        why = self.sched.check(req)
        if why is None and self.prefill is not None:
            why = self.prefill.dead or self.prefill.check(req)
        if why is None and msg.mm is not None:
            why, req.mm_frames = check_images(msg.mm, msg.prompt_token_ids, frames, self.image_spec)
            req.mm, req.extra_keys = msg.mm, tuple(msg.mm.hashes)  # different images: different KV blocks
        if why is not None:
            await self._send(ident, Outputs([reject(why)]))
            return
        self._owner[req.request_id] = ident
        if self.config.request_timeout_s:
            self._deadlines[req.request_id] = time.monotonic() + self.config.request_timeout_s
        if req.mm is not None:
            self.mm_images += len(req.mm.hashes)
            if self.encoder_router is not None and req.mm.pixel_values is not None:  # the encoder pool encodes
                self.encoding[req.request_id] = req
                pixels = req.mm_frames.pop("pixel_values")
                ref = TensorRef(1, req.mm.pixel_values.dtype, req.mm.pixel_values.shape)
                await self.encoder_router.send_multipart(
                    Codec.encode(EncodeImages(req.request_id, req.mm.hashes, ref), [pixels]), copy=False)
                return
        await self._queue(req)

    def _overloaded(self, prompt_tokens: int) -> str | None:
        """Why the waiting queue cannot take a request of `prompt_tokens` (None: it can). Queued
        prompt tokens count too: a few huge prompts hold the queue as long as many small ones."""
        cfg, waiting = self.config, self.sched.waiting
        if cfg.max_waiting and len(waiting) >= cfg.max_waiting:
            return f"{cfg.max_waiting} requests already waiting"
        if cfg.max_waiting_tokens and waiting:
            queued = sum(r.num_prompt_tokens for r in waiting)
            if queued + prompt_tokens > cfg.max_waiting_tokens:
                return f"{queued} prompt tokens already waiting (limit {cfg.max_waiting_tokens})"
        return None

    async def _expire_loop(self) -> None:
        """--request-timeout: a request past its deadline ends with an error (HTTP 408) and frees
        its KV blocks, whether it waits, runs or is being encoded."""
        timeout = self.config.request_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            late = [rid for rid, t in self._deadlines.items() if t < now]
            if not late:
                continue
            gone = self.sched.abort(late) + [r for rid in late if (r := self.encoding.pop(rid, None)) is not None]
            if self.prefill is not None:
                gone += await self.prefill.abort(late)
            for rid in late:
                self._deadlines.pop(rid, None)
            if gone:
                self.log.warning("request.timeout", request_ids=[r.request_id for r in gone], timeout_s=timeout)
                await self._send_deltas([RequestDelta(r.request_id, finish_reason="error", error_code=408,
                                                      error=f"request exceeded the server's request timeout "
                                                            f"({timeout:g} s)",
                                                      num_prompt_tokens=r.num_prompt_tokens) for r in gone])

    async def _queue(self, req: Request) -> None:
        """Into the scheduler's waiting queue: it runs from the next step on (P/D decode: once
        the prefill engine has sent its first token and KV)."""
        if self.prefill is not None and req.kv is None and req.pooling is None:
            await self.prefill.send(req)
            return
        self.sched.add(req)
        self.log.debug("request.added", request_id=req.request_id, prompt_tokens=req.num_prompt_tokens,
                       max_tokens=req.params.max_tokens, priority=req.priority)
        self._work.set()

    async def _encoded_loop(self) -> None:
        """The encoder router's answers: features join their request, which is then queued."""
        assert self.encoder_router is not None
        async for msg, frames in self.messages(self.encoder_router, _encoded_codec, "encoder router"):
            req = self.encoding.pop(msg.request_id, None)
            if req is None:  # aborted (or failed) while encoding
                continue
            self.mm_cache_hits += msg.num_cached
            buf = ref_frame(msg.embeddings, frames) if msg.embeddings is not None else msg.error or "no features"
            if isinstance(buf, str):
                await self._send_deltas([RequestDelta(req.request_id, finish_reason="error",
                                                      error=f"image encoding failed: {buf}",
                                                      error_code=msg.error_code or 500)])
                continue
            assert req.mm is not None and msg.embeddings is not None
            req.mm = msgspec.structs.replace(req.mm, pixel_values=None, embeddings=msg.embeddings)
            req.mm_frames = {"embeddings": buf}
            await self._queue(req)

    async def first_token(self, req: Request, d: RequestDelta, kv: KVBlocks, bufs: list) -> None:
        """P/D decode: the prefill engine's first token goes out now; the request then decodes
        here on the prompt's imported KV (its images are no longer needed: never recomputed)."""
        now = time.monotonic()
        _, done = req.append_tokens(d.new_token_ids[:1], self.sched.cfg.eos_token_ids)
        req.t_first = req.t_last = now
        req.num_cached_tokens = d.num_cached_tokens  # the prefill engine's prefix-cache hit
        self.sched.ttft.append(now - req.t_arrival)
        self.sched.generation_tokens += 1
        delta = RequestDelta(req.request_id, d.new_token_ids[:1], logprobs=d.logprobs,
                             prompt_logprobs=d.prompt_logprobs, num_prompt_tokens=req.num_prompt_tokens,
                             num_cached_tokens=req.num_cached_tokens)
        if done:
            delta.finish_reason, delta.stop_reason = req.finish_reason, req.stop_reason
        await self._send_deltas([delta])  # before any later token of it can leave
        if not done:
            req.kv, req.kv_frames = kv, {"blocks": bufs}
            req.mm, req.mm_frames = None, {}
            await self._queue(req)

    def _engine_stats(self) -> EngineStats:
        return EngineStats(num_rejected_overload=self.num_rejected_overload, mm_images=self.mm_images,
                           mm_cache_hits=self.mm_cache_hits, **self.sched.stats())

    # ------------------------------------------------------------------ steps

    async def _step_loop(self) -> None:
        """schedule -> plan to the ranks -> (the last step's outputs to clients) -> result -> update.
        A step's outputs leave after the next plan: the ranks compute while we send them. With
        async scheduling two plans are out at once: the next one is made and sent before the
        current one's result is back, so the ranks start it the moment they finish (a batch-32
        SmolLM2 worker here: idle 2.3 -> 0.3 ms per step; served throughput unchanged on 2 cores,
        where that idle time was the frontend's and scheduler's CPU time); new requests then join
        one step later."""
        pending: tuple | None = None  # the last step's deltas and stats, not sent yet
        inflight: deque[tuple[StepPlan, float, float, float]] = deque()
        depth = 2 if self.sched.cfg.async_scheduling else 1
        while self.dead_reason is None:
            if self._profile_q and not inflight:  # (a profiler reply must not cross step results)
                pending = await self._flush(pending)
                await self._run_profile(*self._profile_q.popleft())
                continue
            if len(inflight) < depth and not self._profile_q:
                t0 = time.perf_counter()
                plan = self.sched.schedule() if self.sched.has_work else None
                if plan is not None:
                    self._log_preempted(plan)
                    t1 = time.perf_counter()
                    await self.pub.send_multipart(Codec.encode(plan, self.sched.plan_frames), copy=False)
                    inflight.append((plan, t1 - t0, t1, time.perf_counter() - t1))
                    if len(inflight) < depth:
                        continue  # the next plan before this one's result
            if not inflight:
                pending = await self._flush(pending)
                self._work.clear()
                if self.sched.has_work:  # blocked on KV blocks with nothing running
                    await asyncio.sleep(0.005)
                else:
                    await self._work.wait()
                continue
            pending = await self._flush(pending)
            plan, sched_s, t1, send_s = inflight.popleft()
            result = await self._await_result(plan)
            if result is None:
                return
            t2 = time.perf_counter()
            deltas = self.sched.update(result)
            pending = (deltas, self.pooled_rows, plan, result, sched_s, t2 - t1, time.perf_counter() - t2, send_s)
            if self.sched.spec is not None:  # outputs first: a failing drafter fails the rest after them
                pending = await self._flush(pending)
                if not await self._propose(result):
                    return

    async def _flush(self, pending: tuple | None) -> None:
        """Send a finished step's outputs and publish its stats (its pooled rows still point into
        the current result frames: called before the next result is received)."""
        if pending is not None:
            deltas, pooled, *stats = pending
            if deltas:
                await self._send_deltas(deltas, pooled)
            self._publish_step(*stats)
        return None

    async def _propose(self, result: StepResult) -> bool:
        """Draft tokens for the next step's verification; False: the drafter failed. (EAGLE's
        drafts came with the result, from worker rank 0.)"""
        spec = self.sched.spec
        assert spec is not None
        if spec.cfg.method == "eagle":
            return True
        want = spec.candidates(self.sched.running)
        if spec.cfg.method == "ngram":
            spec.ngram(want)
            return True
        msg = self._draft_model_request(result.step_id, want)
        if not msg.request_ids and not msg.finished_request_ids:
            return True
        msg.reply = bool(msg.request_ids)  # else only finished requests to drop: nothing to wait for
        await self.drafter.send_multipart(Codec.encode(msg), copy=False)
        if not msg.reply:
            return True
        reply = await self._recv(self.drafter, _draft_codec, f"drafts for step {result.step_id}",
                                 self.config.step_timeout_s)
        if reply is None:
            return False
        if reply.step_id != msg.step_id:
            await self._fail(f"drafter reply out of order (step {reply.step_id}, expected {msg.step_id})")
            return False
        if reply.error:  # drafts are optional: this step goes without
            self.log.warning("drafter.error", step_id=msg.step_id, error=reply.error)
            return True
        for rid, drafts in zip(reply.request_ids, reply.draft_token_ids):
            req = self.sched.requests.get(rid)
            if req is not None and req.status == Status.RUNNING:
                self.sched.take_drafts(req, drafts)
        return True

    def _draft_model_request(self, step_id: int, want: list) -> DraftRequest:
        """A draft model needs only tokens: each candidate's whole sequence (it keeps the KV of
        the prefix it already computed)."""
        msg = DraftRequest(step_id)
        for req, k in want:
            msg.request_ids.append(req.request_id)
            msg.offsets.append(len(msg.tokens))
            msg.counts.append(req.num_tokens)
            msg.num_drafts.append(k)
            msg.tokens += req.token_ids
            self._drafted.add(req.request_id)
        msg.finished_request_ids = self._gone()
        return msg

    def _gone(self) -> list[str]:
        """Requests the drafter holds state for that have ended."""
        gone = [rid for rid in self._drafted if rid not in self.sched.requests]
        self._drafted.difference_update(gone)
        return gone

    def _log_preempted(self, plan: StepPlan) -> None:
        """Requests whose worker state this plan drops while they wait again were preempted."""
        for rid in plan.finished_request_ids:
            req = self.sched.requests.get(rid)
            if req is not None and req.status == Status.PREEMPTED:
                self.log.info("request.preempted", request_id=rid, num_tokens=req.num_tokens,
                              num_preemptions=self.sched.num_preemptions)

    async def _run_profile(self, ident: bytes, action: str) -> None:
        """Send a profiler command to every rank and answer the client with rank 0's ack."""
        self._profile_seq += 1
        cmd = ProfileCommand(action, self._profile_seq, stamp=time.time_ns())
        await self.pub.send_multipart(Codec.encode(cmd), copy=False)
        ack = await self._await_reply(f"profiler {action} #{cmd.seq}", PROFILE_TIMEOUT_S, lambda r: (
            None if isinstance(r, ProfileAck) and r.seq == cmd.seq else f"not the ack of profiler command #{cmd.seq}"))
        if ack is None:
            return
        if not isinstance(ack, ProfileAck) or ack.seq != cmd.seq:
            await self._fail(f"profiler reply out of order (expected ack #{cmd.seq})")
            return
        self.log.info("profiler", action=action, error=ack.error, files=ack.files)
        if ack.code == 0:
            self._profiling = action == "start"
        await self._send(ident, ProfileStatus(action, error=ack.error, code=ack.code, files=ack.files))

    def _publish_step(self, plan: StepPlan, result: StepResult, sched_s: float, rt_s: float,
                      update_s: float, send_s: float = 0.0) -> None:
        """Stats for the metrics actor: gauges now, counters as deltas since the last step."""
        s = self.sched
        spec = s.spec.counters() if s.spec else (0, 0, 0, [])
        cur = (s.prompt_tokens, s.generation_tokens, s.num_preemptions, s.prefix_queries,
               s.prefix_hits, *spec[:3])
        d = [a - b for a, b in zip(cur, self._last_counters)]
        per_pos = [a - b for a, b in zip(spec[3], self._last_per_pos)]
        self._last_counters, self._last_per_pos = cur, spec[3]
        self.log.debug("step", step_id=plan.step_id, seqs=len(plan.num_scheduled_tokens),
                       tokens=sum(plan.num_scheduled_tokens), new=len(plan.new), schedule_ms=round(sched_s * 1e3, 2),
                       roundtrip_ms=round(rt_s * 1e3, 2), forward_ms=round(result.forward_s * 1e3, 2),
                       sample_ms=round(result.sample_s * 1e3, 2), update_ms=round(update_s * 1e3, 2))
        self.publish(StepStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            kv_cache_usage=s.blocks.usage(),
            num_seqs=len(plan.num_scheduled_tokens), num_tokens=sum(plan.num_scheduled_tokens),
            prompt_tokens=d[0], generation_tokens=d[1], num_preemptions=d[2],
            prefix_cache_queries=d[3], prefix_cache_hits=d[4],
            schedule_s=sched_s, roundtrip_s=rt_s, forward_s=result.forward_s,
            sample_s=result.sample_s, update_s=update_s,
            ttft_s=s.ttft, itl_s=s.itl, dropped=self.stats_dropped,
            send_s=send_s, return_s=max(0.0, rt_s - send_s - result.forward_s - result.sample_s),
            spec_drafts=d[5], spec_draft_tokens=d[6], spec_accepted_tokens=d[7],
            spec_accepted_per_pos=per_pos if any(per_pos) else [],
            num_forwards=plan.num_forwards,
        ))
        s.ttft, s.itl = [], []
        for ev in s.finished_stats:
            self.publish(ev)
        s.finished_stats = []

    async def _await_reply(self, what: str, timeout: float, want) -> StepResult | ProfileAck | None:
        """Rank 0's reply that `want` (reply -> why it is not the one awaited, or None) accepts,
        with its tensor frames checked; None (engine failed) on timeout or death. Anything else
        on the result socket is junk: logged and dropped (anyone who can reach the socket can
        send it), and the wait goes on."""
        def accept(reply, frames) -> None:
            why = want(reply)
            if why is not None:
                raise DecodeError(why)
            if isinstance(reply, StepResult):
                pooled, kv = _pooled_rows(reply, frames), exported_kv(reply, frames)
                self.pooled_rows, self.kv_rows = pooled, kv

        self.pooled_rows, self.kv_rows = {}, {}
        return await self._recv(self.pull, _result_codec, what, timeout, accept)

    async def _recv(self, sock, codec: Codec, what: str, timeout: float, accept=None):
        """The next message on `sock` that decodes (and that `accept(reply, frames)` does not
        reject with a DecodeError); on the result socket its frames are kept in `result_frames`.
        Junk is logged and dropped; None (engine failed) on timeout or death."""
        deadline = time.monotonic() + timeout
        peer = "the drafter" if sock is not self.pull else "worker rank 0"
        while True:
            recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
            dead = asyncio.ensure_future(self._dead.wait())
            try:
                done, _ = await asyncio.wait({recv, dead}, timeout=max(0.0, deadline - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                dead.cancel()
            if recv not in done:
                recv.cancel()
                if not self._dead.is_set():
                    await self._fail(f"{peer} gave no reply for {what}")
                return None
            frames = recv.result()
            try:
                reply, _ = codec.decode(frames)
                if accept is not None:
                    accept(reply, frames)
            except DecodeError as e:
                self.dropped(f"{peer} reply", e, awaiting=what)
                continue
            if sock is self.pull:
                self.result_frames = frames
            return reply

    async def _await_result(self, plan: StepPlan) -> StepResult | None:
        result = await self._await_reply(f"step {plan.step_id}", self.config.step_timeout_s,
                                         lambda r: _result_problem(plan, r))
        if result is None:
            return None
        if result.error:
            await self._fail(f"worker error: {result.error}")
            return None
        return result

    # ------------------------------------------------------------------ failure

    async def on_peer_failed(self, name: str, reason: str) -> None:
        if name != self.name:
            await self._fail(f"{name} failed: {reason}", report=False)

    async def _fail(self, reason: str, report: bool = True) -> None:
        """Fail every request, tell every client; the engine serves no more."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if not hasattr(self, "_work"):  # still starting (a worker failed to load): nothing to fail
            return
        self._dead.set()
        self._work.set()
        failed = self.sched.abort_all("error") + list(self.encoding.values())
        self.encoding.clear()
        if self.prefill is not None:
            failed += self.prefill.take_all()
        deltas = [self._final(r, error=reason) for r in failed]
        if deltas:
            await self._send_deltas(deltas)
        for ident in self.clients:
            await self._send(ident, EngineDead(reason))
        if report:
            await self.report_failure(reason)

    # ------------------------------------------------------------------ sending

    def _final(self, req: Request, error: str | None = None) -> RequestDelta:
        return RequestDelta(
            req.request_id,
            finish_reason=req.finish_reason or "abort",
            error=error,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error_code=500 if error else 0,
        )

    async def _send(self, ident: bytes, msg, extra_frames: list[memoryview] | None = None) -> None:
        await self.router.send_multipart([ident, *Codec.encode(msg), *(extra_frames or ())], copy=False)

    async def _send_deltas(self, deltas: list[RequestDelta], vectors: dict[str, memoryview] | None = None) -> None:
        """One `Outputs` per client; a pooled request's vector (from `vectors`) rides along as an
        extra frame named by its delta's `embedding`."""
        by_client: dict[bytes, list[RequestDelta]] = defaultdict(list)
        for d in deltas:
            owner = self._owner
            ident = owner.pop(d.request_id, None) if d.finish_reason else owner.get(d.request_id)
            if d.finish_reason:
                self._deadlines.pop(d.request_id, None)
            if ident is not None:
                by_client[ident].append(d)
        now = time.time()
        for d in deltas:  # normal ends at debug (the frontend logs one access line per request)
            if d.finish_reason:
                emit = {"error": self.log.warning, "abort": self.log.info}.get(d.finish_reason, self.log.debug)
                emit("request.finished", request_id=d.request_id, finish_reason=d.finish_reason,
                     stop_reason=d.stop_reason, error=d.error)
        for ident, ds in by_client.items():
            frames: list[memoryview] = []
            for d in ds:
                row = vectors.get(d.request_id) if vectors else None
                if row is not None:
                    frames.append(row)
                    d.embedding = TensorRef(len(frames), "float32", [len(row) // 4])
                if d.request_id in self.kv_rows:  # P/D prefill: the prompt's KV rides along
                    attach_kv(d, self.kv_rows.pop(d.request_id), frames)
            await self._send(ident, Outputs(ds, now), frames)


def _result_problem(plan: StepPlan, r: object) -> str | None:
    """Why `r` is not a well-formed result of `plan` (junk on the result socket), or None."""
    if not isinstance(r, StepResult) or r.step_id != plan.step_id:
        return f"not the result of step {plan.step_id}"
    n = len(r.request_ids)
    counts = r.num_sampled or [1] * n
    if len(counts) != n or min(counts, default=1) < 1 or sum(counts) != len(r.sampled_token_ids):
        return "sampled tokens do not match the request ids"
    if (r.logprobs is not None and len(r.logprobs) != n) or len(r.draft_token_ids) != len(r.draft_request_ids) \
            or (r.draft_parents and len(r.draft_parents) != len(r.draft_request_ids)):
        return "per-request lists of different lengths"
    planned = {x.request_id for x in plan.new} | {x.request_id for x in plan.cached}
    if not planned.issuperset(r.request_ids) or not planned.issuperset(r.pooled_request_ids):
        return "ids of requests the step did not schedule"
    return None


def _pooled_rows(result: StepResult, frames: list) -> dict[str, memoryview]:
    """Zero-copy row views of a result's [N, dim] float32 pooled frame, by request id (the
    scheduler forwards the bytes as they are; it never imports torch)."""
    ref = result.pooled
    if ref is None:
        return {}
    n = len(result.pooled_request_ids)
    if ref.dtype != "float32" or len(ref.shape) != 2 or ref.shape[0] != n or not 0 < ref.index < len(frames):
        raise DecodeError(f"bad pooled tensor {ref} for {n} requests and {len(frames) - 1} extra frames")
    frame = frames[ref.index]
    buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")
    row = ref.shape[1] * 4
    if len(buf) != n * row:
        raise DecodeError(f"pooled frame has {len(buf)} bytes, expected {n * row}")
    return {rid: buf[i * row : (i + 1) * row] for i, rid in enumerate(result.pooled_request_ids)}
