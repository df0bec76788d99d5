"""Scheduler actor: the engine core. Owns request state and drives the worker ranks one step
at a time.

Sockets: ROUTER (clients' DEALERs: requests in, per-client output batches out by identity),
XPUB (one step plan reaches every rank), PULL (rank 0's step results). Client messages are
handled by their own task between steps, so requests join the running batch at the next step
and aborts apply before the next plan. Side channels are stages with their own sockets and
tasks, reaching the core through `engine/stage.py`'s interface (enqueue, emit, fail, ...):
the encoder pool (multimodal/stage.py), the prefill engine (engine/disagg.py), the drafter
(speculative/stage.py) and the profiler (engine/profiling.py). Any worker failure fails every
in-flight request with an error delta and tells every client the engine is dead — never a hang.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from typing import Any, Callable

import zmq

from axonserve import __version__
from axonserve.actors.channel import ChannelServer, channel_path, is_channel
from axonserve.actors.runtime import Actor, attach, bus_socket, data_message_bytes
from axonserve.config import engine_suffix
from axonserve.engine.buckets import BucketConfig
from axonserve.engine.disagg import PrefillStage, attach_kv, exported_kv
from axonserve.engine.profiling import ProfilerStage
from axonserve.engine.request import Request, Status
from axonserve.engine.scheduler import Scheduler, SchedulerConfig
from axonserve.engine.sliding_window import blocks_held
from axonserve.engine.stage import recv_before
from axonserve.engine.step import Step, StepStatsPublisher, pooled_rows, result_problem
from axonserve.multimodal.scheduler import ImageSpec, check_images
from axonserve.multimodal.stage import EncoderStage
from axonserve.protocol import ClientToEngine, Codec, DecodeError, TensorRef
from axonserve.protocol.messages import (
    AbortRequest,
    ActorFailed,
    AddRequest,
    BucketInfo,
    CompileStats,
    EngineDead,
    EngineInfo,
    EngineStats,
    GetEngineInfo,
    GetStats,
    Outputs,
    ParamError,
    RequestDelta,
    RestartStats,
    StartProfile,
    StepResult,
    StopProfile,
    WorkerReply,
)
from axonserve.speculative.stage import ProposalStage

_client_codec = Codec(ClientToEngine)


class WorkersLost(Exception):
    """The rank group was lost while a step (or a stage's request) waited on it."""


async def _wait_either(a: asyncio.Event, b: asyncio.Event) -> None:
    tasks = [asyncio.create_task(a.wait()), asyncio.create_task(b.wait())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


_result_codec = Codec(WorkerReply)


class SchedulerActor(Actor):
    kind = "scheduler"
    dead_reason: str | None = None  # set once the engine can serve no more (also before setup ends)

    async def setup(self) -> dict:
        a, cfg = self.addresses, self.config
        self.engine_channel: ChannelServer | None = None
        if is_channel(a.engine):  # clients on this host: the frontend, an LLM, bench step
            self.engine_channel = ChannelServer(channel_path(a.engine), data_message_bytes(cfg), routed=True)
            self.router = await self.engine_channel.start()
        else:
            self.router = self.socket(zmq.ROUTER, a.engine, bind=True)
            self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.channel: ChannelServer | None = None
        if is_channel(a.plan):  # the ranks on this host: plans out and results back on one channel
            self.channel = await ChannelServer(channel_path(a.plan), data_message_bytes(cfg)).start()
            self.pub = self.pull = self.channel
        else:  # across hosts (or a foreign driver's ranks): ZeroMQ
            self.pub = bus_socket(self.ctx, zmq.XPUB, data_message_bytes(cfg))
            self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every rank's subscription, not just the first
            self.pub.setsockopt(zmq.SNDHWM, 0)
            self.pub.setsockopt(zmq.LINGER, 2000)
            attach(self.pub, a.plan, bind=True)
            self.pull = self.socket(zmq.PULL, a.result, bind=True)
        self.result_frames: list = []  # the last step result's frames (tensor frames forwarded as they are)
        info = await asyncio.wait_for(self.configured, cfg.ready_timeout_s)
        await self._wait_subscribers(cfg.num_workers)
        self.sched, max_len = self._make_scheduler(info)
        self.sched.step_base(int(info.get("step_base", 0)))
        self.engine_info = EngineInfo(
            model=cfg.model,
            served_model_name=cfg.served_model_name or cfg.model,
            max_model_len=max_len,
            block_size=cfg.block_size,
            num_kv_blocks=self.sched.cfg.num_kv_blocks,
            max_num_seqs=cfg.max_num_seqs,
            eos_token_ids=sorted(self.sched.cfg.eos_token_ids),
            vocab_size=self.sched.cfg.vocab_size,
            version=__version__,
            task=self.sched.cfg.task,
            limits=cfg.limits,
        )
        self.dead = asyncio.Event()
        # the worker ranks died or hung: the supervisor replaces them (`on_peer_restarting`);
        # `interrupt` ends any wait on them (set on death too)
        self.lost, self.restored, self.interrupt = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._work = asyncio.Event()
        self.clients: set[bytes] = set()
        self._owner: dict[str, bytes] = {}  # request id -> client identity
        self._deadlines: dict[str, float] = {}  # request id -> monotonic deadline (--request-timeout)
        self.num_rejected_overload = self.mm_images = 0
        self.image_spec = ImageSpec.from_info(info)
        self.kv_rows: dict = {}  # P/D prefill engine: the last result's exported KV, by request id
        self._pooled: dict[str, memoryview] = {}  # embed task: the last result's vectors, by request id
        self.publish_step = StepStatsPublisher(self.sched, self.publish, self.log)
        # the stages
        self.profiler = ProfilerStage(self)
        self.encoders = EncoderStage(self, self, a.router) if cfg.encoder_workers and a.router else None
        self.prefill = PrefillStage(self, self, a.prefill) if cfg.role == "decode" else None
        self.proposals = ProposalStage(self, self, a.drafter) if cfg.speculative is not None else None
        self._publish_startup(info)
        return {"num_kv_blocks": self.sched.cfg.num_kv_blocks, "max_model_len": max_len}

    def _publish_startup(self, info: dict) -> None:
        """For the metrics actor: the workers' start-up XLA compiles, and the limits and buckets in
        force (what `axonserve buckets plan` compares a plan against)."""
        secs, hits = list(info.get("compile_s") or []), int(info.get("compile_cache_hits") or 0)
        if secs or hits:
            self.publish(CompileStats(seconds=[float(x) for x in secs], cache_hits=hits))
        b, cfg = self.sched.cfg.buckets, self.config
        self.publish(
            BucketInfo(  # the inputs BucketConfig.from_engine_config resolved the buckets from
                max_model_len=int(info["max_model_len"]),
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=max(cfg.max_num_batched_tokens, 1),
                block_size=cfg.block_size,
                **(b.as_dict() if b is not None else {}),
            )
        )

    def _make_scheduler(self, info: dict) -> tuple[Scheduler, int]:
        """The scheduling policy, sized by what the workers measured (KV blocks, vocabulary)."""
        cfg = self.config
        max_len = int(info["max_model_len"])
        embed = cfg.task == "embed"  # (resolved by EngineConfig) an encoder: no KV pool
        buckets = BucketConfig.from_engine_config(cfg, max_len) if cfg.bucketing else None
        pool_tokens = int(info["num_kv_blocks"]) * cfg.block_size
        window = int(info["kv_window"]) if info.get("kv_window") else None  # (engine/sliding_window.py)
        held = blocks_held(max_len, max(cfg.max_num_batched_tokens, 1), window, cfg.block_size)
        # one sequence must always fit, or preemption cannot help (a sliding one holds only its window)
        if pool_tokens < max_len and not embed and held * cfg.block_size > pool_tokens:
            self.log.warning("max_model_len_clamped", max_model_len=max_len, kv_pool_tokens=pool_tokens)
            max_len = pool_tokens
        sched_cfg = SchedulerConfig.from_engine(
            cfg,
            max_model_len=max_len,
            num_kv_blocks=int(info["num_kv_blocks"]),
            vocab_size=int(info["vocab_size"]),
            eos_token_ids=frozenset(info["eos_token_ids"]),  # type: ignore[arg-type]
            kv_window=window,
            buckets=buckets,
        )
        return Scheduler(sched_cfg), max_len

    async def _wait_subscribers(self, n: int) -> None:
        """XPUB reports each SUB's subscription (the channel each rank's arrival): plans sent
        before that would be lost."""
        if self.channel is not None:
            for _ in range(n):
                await asyncio.wait_for(self.channel.wait_join(), self.config.ready_timeout_s)
            return
        seen = 0
        while seen < n:
            frame = await asyncio.wait_for(self.pub.recv(), self.config.ready_timeout_s)
            if frame[:1] == b"\x01":
                seen += 1

    async def run(self) -> None:
        loops = [self._client_loop(), self._step_loop()]
        loops += [stage.run() for stage in (self.encoders, self.prefill) if stage is not None]
        if self.config.request_timeout_s:
            loops.append(self._expire_loop())
        tasks = [asyncio.create_task(c) for c in loops]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()
        finally:
            for t in tasks:
                t.cancel()

    # ------------------------------------------------------------------ the step loop

    async def _step_loop(self) -> None:
        """schedule -> plan to the ranks -> (the last step's outputs to clients) -> result ->
        update -> (drafts). A step's outputs leave after the next plan: the ranks compute while
        we send them. With async scheduling two plans are out at once, so the ranks start the
        next one the moment they finish; new requests then join one step later. Profiler
        commands run when no step is in flight (they share the plan and result sockets)."""
        done: Step | None = None  # a finished step whose outputs have not left yet
        inflight: deque[Step] = deque()
        depth = 2 if self.sched.cfg.async_scheduling else 1
        while self.dead_reason is None:
            if self.lost.is_set():  # the ranks are being replaced: their steps never answer
                inflight.clear()
                done = await self._emit_step(done)
                await self._recover_workers()
            elif self.profiler.pending and not inflight:
                done = await self._emit_step(done)
                await self._guarded(self.profiler.run_next())
            elif len(inflight) < depth and not self.profiler.pending and (step := await self._send_plan()):
                inflight.append(step)
            elif not inflight:
                done = await self._emit_step(done)
                await self._idle()
            else:
                done = await self._emit_step(done)
                step = await self._guarded(self._finish(inflight.popleft()))
                if step is WorkersLost:
                    continue
                if step is None:
                    return
                done = step
                if self.proposals is not None:  # outputs first: a failing drafter fails the rest after them
                    done = await self._emit_step(done)
                    if not await self.proposals.propose(step.result):
                        return

    async def _guarded(self, coro: Any) -> Any:
        """`coro`'s result, or WorkersLost when the ranks were lost while it waited on them."""
        try:
            return await coro
        except WorkersLost:
            return WorkersLost

    async def _recover_workers(self) -> None:
        """The supervisor is replacing the rank group: requeue every running request (its KV is
        gone: recomputed, its outputs kept), wait for the new ranks, then go on. Clients see a pause."""
        t0 = time.monotonic()
        self.publish_step.flush(self.stats_dropped)  # the steps done before the loss, not held through it
        resumed = self.sched.workers_lost()
        self.log.warning("workers.lost", running=len(resumed), waiting=len(self.sched.waiting))
        await _wait_either(self.restored, self.dead)
        if self.dead.is_set():
            return
        await self._wait_subscribers(self.config.num_workers)
        while await self.pull.poll(0):  # a dying rank 0's last results: stale
            await self.pull.recv_multipart()
        self.lost.clear()
        self.restored.clear()
        if not self.dead.is_set():
            self.interrupt.clear()
        self.publish(RestartStats(actor="", seconds=0.0, requests_resumed=len(resumed)))
        self.log.info("workers.resumed", requests=len(resumed), seconds=round(time.monotonic() - t0, 2))
        self._work.set()

    async def _send_plan(self) -> Step | None:
        """Schedule the next step and send its plan to every rank (None: nothing to run)."""
        t0 = time.perf_counter()
        plan = self.sched.schedule() if self.sched.has_work else None
        if plan is None:
            return None
        self._log_preempted(plan.finished_request_ids)
        t1 = time.perf_counter()
        await self.pub.send_multipart(Codec.encode(plan, self.sched.plan_frames), copy=False)
        return Step(plan, t1 - t0, t1, time.perf_counter() - t1, shapes=self.sched.plan_shapes)

    async def _finish(self, step: Step) -> Step | None:
        """Await the step's result and fold it into the scheduler's state; None: the engine failed."""
        result = await self.await_reply(
            f"step {step.plan.step_id}", self.config.step_timeout_s, lambda r: result_problem(step.plan, r)
        )
        if result is not None and result.error:
            await self.fail(f"worker error: {result.error}")
            return None
        if result is None:
            return None
        t2 = time.perf_counter()
        step.result, step.roundtrip_s, step.pooled = result, t2 - step.sent_at, self._pooled
        step.deltas = self.sched.update(result)
        step.update_s = time.perf_counter() - t2
        return step

    async def _emit_step(self, step: Step | None) -> None:  # (always None: `done = await ...` clears it)
        """Send a finished step's outputs and publish its stats (its pooled rows still point into
        its result's frames: called before the next result is received)."""
        if step is not None:
            if step.deltas:
                await self.emit(step.deltas, step.pooled)
            self.publish_step(step, self.stats_dropped)

    async def _idle(self) -> None:
        """Nothing in flight: wait for work (or, blocked on KV blocks with nothing running, retry soon).
        The stats of the last steps go out first: a scrape right after a request ends sees it."""
        self.publish_step.flush(self.stats_dropped)
        self._work.clear()
        if self.sched.has_work:
            await asyncio.sleep(0.005)
        else:
            await self._work.wait()

    def _log_preempted(self, dropped: list[str]) -> None:
        """Requests whose worker state a plan drops while they wait again were preempted."""
        for rid in dropped:
            req = self.sched.requests.get(rid)
            if req is not None and req.status == Status.PREEMPTED:
                self.log.info(
                    "request.preempted",
                    request_id=rid,
                    num_tokens=req.num_tokens,
                    num_preemptions=self.sched.num_preemptions,
                )

    # ------------------------------------------------------------------ clients

    async def _client_loop(self) -> None:
        async for msg, frames, ident in self.messages(self.router, _client_codec, "client message", routed=True):
            self.clients.add(ident)
            if isinstance(msg, AddRequest):
                await self._add(ident, msg, frames)
            elif isinstance(msg, AbortRequest):
                aborted = await self._abort(msg.request_ids)
                if aborted:
                    await self.emit([_final(r) for r in aborted])
            elif isinstance(msg, GetStats):
                await self.reply(
                    ident,
                    EngineStats(
                        num_rejected_overload=self.num_rejected_overload,
                        mm_images=self.mm_images,
                        mm_cache_hits=self.encoders.cache_hits if self.encoders else 0,
                        **self.sched.stats(),
                    ),
                )
            elif isinstance(msg, (StartProfile, StopProfile)):
                await self.profiler.command(ident, "start" if isinstance(msg, StartProfile) else "stop")
                self._work.set()
            elif isinstance(msg, GetEngineInfo):
                await self.reply(ident, self.engine_info)
                if self.dead_reason is not None:
                    await self.reply(ident, EngineDead(self.dead_reason))

    async def _abort(self, request_ids: list[str]) -> list[Request]:
        """End these requests wherever they are (queued, running, encoding, prefilling elsewhere)."""
        gone = self.sched.abort(request_ids)
        if self.encoders is not None:
            gone += self.encoders.abort(request_ids)
        if self.prefill is not None:
            gone += await self.prefill.abort(request_ids)
        return gone

    async def _add(self, ident: bytes, msg: AddRequest, frames: list) -> None:
        """Admit a request (or answer why not: 503 overloaded or dead, 400 invalid)."""

        def reject(why: str, code: int = 400) -> Outputs:
            self.log.warning("request.rejected", request_id=msg.request_id, reason=why, code=code)
            return Outputs([RequestDelta(msg.request_id, finish_reason="error", error=why, error_code=code)])

        if self.dead_reason is not None:
            await self.reply(ident, reject(f"engine is dead: {self.dead_reason}", 503))
            return
        if msg.output_token_ids and msg.request_id in self.sched.requests:
            return  # a resume of a request this scheduler already runs (its first submission got through)
        overload = self._overloaded(len(msg.prompt_token_ids))
        if overload is not None:
            self.num_rejected_overload += 1
            await self.reply(ident, reject(f"server overloaded: {overload}; retry later", 503))
            return
        try:
            msg.params.check_limits(self.config.limits)
            if msg.params.structured_outputs is not None:  # compiles a grammar: not on the step loop's thread
                await asyncio.to_thread(msg.params.validate)
            else:
                msg.params.validate()
        except ParamError as e:
            await self.reply(ident, reject(str(e)))
            return
        req = Request(
            msg.request_id,
            msg.prompt_token_ids,
            msg.params,
            self.sched.cfg.max_model_len,
            priority=msg.priority,
            arrival_time=msg.arrival_time or None,
            pooling=msg.pooling,
        )
        req.kv_export = msg.kv_export and self.config.role == "prefill"
        req.lora = msg.lora
        if msg.output_token_ids and msg.pooling is None:  # resumed after a scheduler restart
            req.token_ids += msg.output_token_ids
        why = self.sched.check(req)
        if why is None and self.prefill is not None:
            why = self.prefill.dead or self.prefill.check(req)
        if why is None and msg.mm is not None:
            why, req.mm_frames = check_images(msg.mm, msg.prompt_token_ids, frames, self.image_spec)
            req.mm, req.extra_keys = msg.mm, tuple(msg.mm.hashes)  # different images: different KV blocks
        if why is not None:
            await self.reply(ident, reject(why))
            return
        self._owner[req.request_id] = ident
        if self.config.request_timeout_s:
            self._deadlines[req.request_id] = time.monotonic() + self.config.request_timeout_s
        if req.mm is not None:
            self.mm_images += len(req.mm.hashes)
        if self.encoders is not None and self.encoders.takes(req):
            await self.encoders.encode(req)
        else:
            await self.enqueue(req)

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
        its KV blocks, whether it waits, runs or is being encoded or prefilled."""
        timeout = self.config.request_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            late = [rid for rid, t in self._deadlines.items() if t < now]
            if not late:
                continue
            gone = await self._abort(late)
            for rid in late:
                self._deadlines.pop(rid, None)
            if gone:
                self.log.warning("request.timeout", request_ids=[r.request_id for r in gone], timeout_s=timeout)
                why = f"request exceeded the server's request timeout ({timeout:g} s)"
                await self.emit(
                    [
                        RequestDelta(
                            r.request_id,
                            finish_reason="error",
                            error_code=408,
                            error=why,
                            num_prompt_tokens=r.num_prompt_tokens,
                        )
                        for r in gone
                    ]
                )

    async def teardown(self) -> None:
        """The stats of the last steps, if any are still gathering (best effort: stopping)."""
        if hasattr(self, "publish_step"):
            self.publish_step.flush(self.stats_dropped)
        for ch in (getattr(self, "channel", None), getattr(self, "engine_channel", None)):
            if ch is not None:
                ch.close()
        await super().teardown()

    # ------------------------------------------------------------------ the core interface (engine/stage.py)

    def publish(self, event: Any) -> None:
        """Stats events say which data-parallel engine they are from (the metrics' `engine` label)."""
        if hasattr(event, "engine"):
            event.engine = self.config.data_parallel_rank
        super().publish(event)

    async def enqueue(self, req: Request) -> None:
        """Into the scheduler's waiting queue: it runs from the next step on (P/D decode: once
        the prefill engine has sent its first token and KV)."""
        if self.prefill is not None and self.prefill.takes(req):
            await self.prefill.send(req)
            return
        self.sched.add(req)
        self.log.debug(
            "request.added",
            request_id=req.request_id,
            prompt_tokens=req.num_prompt_tokens,
            max_tokens=req.params.max_tokens,
            priority=req.priority,
        )
        self._work.set()

    async def emit(self, deltas: list[RequestDelta], vectors: dict[str, memoryview] | None = None) -> None:
        """One `Outputs` per client; a pooled request's vector (from `vectors`) rides along as an
        extra frame named by its delta's `embedding`."""
        by_client: dict[bytes, list[RequestDelta]] = defaultdict(list)
        for d in deltas:
            ident = self._owner.pop(d.request_id, None) if d.finish_reason else self._owner.get(d.request_id)
            if d.finish_reason:
                self._deadlines.pop(d.request_id, None)
                emit = {"error": self.log.warning, "abort": self.log.info}.get(d.finish_reason, self.log.debug)
                emit(
                    "request.finished",
                    request_id=d.request_id,
                    finish_reason=d.finish_reason,
                    stop_reason=d.stop_reason,
                    error=d.error,
                )  # (normal ends at debug: the frontend logs them)
            if ident is not None:
                by_client[ident].append(d)
        now = time.time()
        for ident, ds in by_client.items():
            frames: list[memoryview] = []
            for d in ds:
                row = vectors.get(d.request_id) if vectors else None
                if row is not None:
                    frames.append(row)
                    d.embedding = TensorRef(len(frames), "float32", [len(row) // 4])
                if d.request_id in self.kv_rows:  # P/D prefill: the prompt's KV rides along
                    attach_kv(d, self.kv_rows.pop(d.request_id), frames)
            await self.reply(ident, Outputs(ds, now), frames)

    async def reply(self, ident: bytes, msg: Any, extra_frames: list[memoryview] | None = None) -> None:
        await self.router.send_multipart([ident, *Codec.encode(msg), *(extra_frames or ())], copy=False)

    async def broadcast(self, msg: Any) -> None:
        await self.pub.send_multipart(Codec.encode(msg), copy=False)

    async def await_reply(self, what: str, timeout: float, want: Callable[[Any], str | None]) -> Any:
        """Rank 0's next reply that `want` accepts, its tensor frames checked (kept in
        `result_frames`); None (the engine failed) on timeout or death. Anything else on the result
        socket is junk: logged and dropped (anyone who can reach the socket can send it)."""
        self._pooled, self.kv_rows = {}, {}
        deadline = time.monotonic() + timeout
        while True:
            frames = await recv_before(self.pull, deadline, self.interrupt)
            if frames is None:
                if self.lost.is_set() and not self.dead.is_set():
                    raise WorkersLost(what)
                if not self.dead.is_set():  # hung ranks: the supervisor replaces them (or fails the engine)
                    await self.workers_hung(f"worker rank 0 gave no reply for {what} in {timeout:g} s")
                    raise WorkersLost(what)
                return None
            try:
                reply, _ = _result_codec.decode(frames)
                if (why := want(reply)) is not None:
                    raise DecodeError(why)
                if isinstance(reply, StepResult):
                    self._pooled, self.kv_rows = pooled_rows(reply, frames), exported_kv(reply, frames)
            except DecodeError as e:
                self.dropped("worker rank 0 reply", e, awaiting=what)
                continue
            self.result_frames = frames
            return reply

    async def workers_hung(self, reason: str) -> None:
        """A step outlived --step-timeout: report the ranks (not this actor) failed; the supervisor
        restarts the group (`on_peer_restarting` follows) or fails the engine."""
        self.lost.set()
        self.interrupt.set()
        await self.send_control(ActorFailed("worker-0", reason))

    async def on_peer_restarting(self, name: str, reason: str) -> None:
        if name == "workers" + engine_suffix(self.config.data_parallel_rank):  # this engine's ranks
            self.lost.set()
            self.interrupt.set()
            self._work.set()
        elif name == "drafter" and self.proposals is not None:
            self.proposals.drafter_restarting()

    async def on_peer_restarted(self, name: str, seconds: float, info: dict) -> None:
        if name == "workers" + engine_suffix(self.config.data_parallel_rank):
            self.restored.set()
        elif name == "drafter" and self.proposals is not None:
            self.proposals.drafter_restarted()
        elif name == "router" and self.encoders is not None:
            await self.encoders.resubmit()

    async def on_peer_failed(self, name: str, reason: str) -> None:
        if name != self.name:
            await self.fail(f"{name} failed: {reason}", report=False)

    async def fail(self, reason: str, report: bool = True) -> None:
        """Fail every request, tell every client; the engine serves no more."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if not hasattr(self, "_work"):  # still starting (a worker failed to load): nothing to fail
            return
        self.dead.set()
        self.interrupt.set()
        self._work.set()
        failed = self.sched.abort_all("error")
        for stage in (self.encoders, self.prefill):
            if stage is not None:
                failed += stage.take_all()
        if failed:
            await self.emit([_final(r, error=reason) for r in failed])
        for ident in self.clients:
            await self.reply(ident, EngineDead(reason))
        if report:
            await self.report_failure(reason)


def _final(req: Request, error: str | None = None) -> RequestDelta:
    """The last delta of a request ended here (aborted, or failed with `error`)."""
    return RequestDelta(
        req.request_id,
        finish_reason=req.finish_reason or "abort",
        error=error,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
        error_code=500 if error else 0,
    )
