"""Worker actor: one rank. Receives every step plan (SUB), runs the model, rank 0 answers.

The forward pass runs inline on the event loop: a step is short, and staying on one thread
avoids a hand-off per step. Model loading runs in a thread so the control channel stays
responsive (a shutdown during a long load is honoured).

Between steps the plan socket may also carry a `ProfileCommand` (profiler start/stop on
every rank; rank 0 acknowledges once all ranks are done). With snapshot rules, rank 0 sends
the step's captured tensors to the snapshot sink after its result, without ever waiting:
records the sink has no room for are dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextvars
import os

import zmq

from axonserve.actors.channel import ChannelClient, channel_path, is_channel
from axonserve.actors.runtime import Actor, attach, bus_socket, data_message_bytes
from axonserve.neuron.heap import collapse_huge_pages, keep_heap
from axonserve.protocol import Codec
from axonserve.protocol.messages import ProfileAck, ProfileCommand, StepPlan

_plan_codec = Codec(StepPlan | ProfileCommand)


class WorkerActor(Actor):
    kind = "worker"

    async def setup(self) -> dict:
        self.rank = self.spec.rank
        keep_heap()  # before the model load: its buffers come from the heap as well
        self.channel: ChannelClient | None = None
        if is_channel(self.addresses.plan):  # the scheduler on this host: plans and results on one channel
            self.channel = ChannelClient(
                channel_path(self.addresses.plan), self.rank, data_message_bytes(self.config)
            ).start()
            self.sub, self.push = self.channel, self.channel if self.rank == 0 else None
        else:
            self.sub = self.socket(zmq.SUB, self.addresses.plan)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.push = self.socket(zmq.PUSH, self.addresses.result) if self.rank == 0 else None
        world = self.config.num_workers
        if world > 1:
            from axonserve.neuron.parallel import init_process_group

            # its TCPStore and gloo listen on dist_init's host only (the loopback by default)
            await asyncio.to_thread(init_process_group, self.rank, world, self.addresses.dist_init)
        self.runner = await self._load_in_own_thread()
        r = self.runner
        r.warm_up()  # on this thread: the one whose heap arena and thread pool serve the steps
        # the streamed weights into huge pages (seconds of kernel time) before saying ready: done after
        # ready it overlapped the first seconds of serving (docs/benchmarks.md#fig-neuron-worker)
        await asyncio.to_thread(collapse_huge_pages)
        self.profiler = None
        if self.config.profile_dir:
            from axonserve.neuron.profiler import RankProfiler, model_device_type

            self.profiler = RankProfiler(
                self.config.profile_dir,
                self.rank,
                model_device_type(r.model),
                self.config.profile_max_steps,
                self.config.profile_max_traces,
            )
        self.snap_sock: zmq.Socket | None = None
        self.snapshots_dropped = 0
        if r.snapshots is not None and self.addresses.snapshot:
            from axonserve.actors.snapshot import QUEUE

            # sync socket: NOBLOCK sends return at once (the stats socket's pattern)
            self.snap_sock = bus_socket(
                zmq.Context.shadow(self.ctx.underlying), zmq.PUSH, data_message_bytes(self.config)
            )
            self.snap_sock.setsockopt(zmq.SNDHWM, QUEUE)
            self.snap_sock.setsockopt(zmq.LINGER, 2000)  # records of the last steps still leave
            attach(self.snap_sock, self.addresses.snapshot)
        return {
            "num_kv_blocks": r.num_kv_blocks,
            "max_model_len": r.max_model_len,
            "eos_token_ids": list(r.eos_token_ids),
            "vocab_size": r.vocab_size,
            "kv_window": getattr(r, "kv_window", None) or 0,  # 0: no window (engine/sliding_window.py)
            "pid": os.getpid(),
            **r.image_info(),
            "compile_s": list(getattr(r, "startup_compile_s", [])),
            "compile_cache_hits": int(getattr(r, "startup_compile_cache_hits", 0)),
        }

    async def _load_in_own_thread(self):
        """Build the runner on a thread that then exits, keeping the control loop responsive.

        Not `asyncio.to_thread`: a pool thread that ran torch stays alive with its OpenMP team,
        and the forward on this thread then ran much slower (docs/benchmarks.md#fig-neuron-worker).
        torch's intra-op thread count is per thread, so it is copied over here as well."""
        import gc
        import threading

        import torch

        if self.config.device == "xla":  # torch-xla is imported only by workers that run on it
            from axonserve.xla.runner import XlaModelRunner as ModelRunner
        else:
            from axonserve.neuron.model_runner import ModelRunner

        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def load() -> None:
            try:
                runner = ModelRunner(self.config, self.rank)
                runner.structured.wait_warm()
                result = (runner, torch.get_num_threads())
                loop.call_soon_threadsafe(done.set_result, result)
            except BaseException as e:  # noqa: BLE001 - re-raised on the loop
                loop.call_soon_threadsafe(done.set_exception, e)

        ctx = contextvars.copy_context()  # log lines from the load keep actor/rank
        thread = threading.Thread(target=ctx.run, args=(load,), name="load-model", daemon=True)
        thread.start()
        runner, threads = await done
        thread.join()
        torch.set_num_threads(threads)
        # the model, tokenizer and import-time objects live for the whole process: keep them out of
        # the cyclic GC's scans (a full scan of them cost a share of a decode step:
        # docs/benchmarks.md#fig-neuron-worker)
        gc.collect()
        gc.freeze()
        return runner

    async def run(self) -> None:
        async for plan, frames in self.messages(self.sub, _plan_codec, "plan"):
            if isinstance(plan, ProfileCommand):
                ack = self._profile(plan)
                if self.push is not None:
                    await self.push.send_multipart(Codec.encode(ack), copy=False)
                continue
            if self.profiler is not None:
                with self.profiler.step_scope(plan.step_id):
                    result = self.runner.execute(plan, frames)
            else:
                result = self.runner.execute(plan, frames)
            if self.push is not None:
                await self.push.send_multipart(Codec.encode(result, self.runner.result_tensors), copy=False)
            if self.snap_sock is not None:
                self._send_snapshots()

    async def on_peer_restarting(self, name: str, reason: str) -> None:
        """A replacement scheduler knows none of the requests this rank holds: drop them all."""
        if name == "scheduler" and getattr(self, "runner", None) is not None:
            self.runner.drop_all()

    async def teardown(self) -> None:
        """Write a running profile's trace; tell the sink how many records were dropped (a
        record without tensors), then close the snapshot socket (it lives on a shadow context
        the runtime does not track)."""
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        profiler = getattr(self, "profiler", None)
        if profiler is not None:
            if profiler.active:
                profiler.stop()
            profiler.wait_exports(30.0)
        if getattr(self, "snap_sock", None) is None:
            return
        from axonserve.protocol.messages import SnapshotRecord

        self.snap_sock.setsockopt(zmq.SNDTIMEO, 2000)  # off the hot path: wait for room, bounded
        try:
            self.snap_sock.send_multipart(
                Codec.encode(SnapshotRecord("", -1, 0, self.rank, dropped=self.snapshots_dropped))
            )
        except zmq.Again:
            self.log.warning("snapshot.final_count_lost", dropped=self.snapshots_dropped)
        self.snap_sock.close(linger=2000)
        self.snap_sock = None

    def _send_snapshots(self) -> None:
        assert self.snap_sock is not None and self.runner.snapshots is not None
        for rec, tensors in self.runner.snapshots.take():
            rec.dropped = self.snapshots_dropped
            try:
                self.snap_sock.send_multipart(Codec.encode(rec, tensors), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.snapshots_dropped += 1
                if self.snapshots_dropped == 1 or self.snapshots_dropped % 100 == 0:
                    self.log.warning(
                        "snapshot.dropped", request_id=rec.request_id, step=rec.step, dropped=self.snapshots_dropped
                    )

    def _profile(self, cmd: ProfileCommand) -> ProfileAck:
        """Apply a profiler command on this rank; with several ranks, the ack reports a
        failure on any of them (an all-reduce that also makes rank 0 wait for every trace)."""
        from axonserve.neuron.profiler import ProfilerStateError

        error, code, files = None, 0, []
        try:
            if self.profiler is None:
                raise ProfilerStateError("profiling is not configured (--profile-dir)")
            if cmd.action == "start":
                self.profiler.start()
            elif cmd.action == "stop":
                files = self.profiler.stop(cmd.stamp)
            else:
                raise ValueError(f"unknown profiler action {cmd.action!r}")
        except ProfilerStateError as e:
            error, code = str(e), 409
        except Exception as e:  # reported to the caller, the worker goes on
            self.log.exception("profiler.failed", action=cmd.action)
            error, code = f"{type(e).__name__}: {e}", 500
        if self.config.num_workers > 1:
            import torch
            import torch.distributed as dist

            flag = torch.tensor([code])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and not code:
                code, error = int(flag.item()), "the profiler failed on another rank (see its log)"
            if not code and files and self.profiler is not None:  # every rank's trace, same stamp
                files += [self.profiler.trace_path(r, cmd.stamp) for r in range(1, self.config.num_workers)]
        return ProfileAck(cmd.action, cmd.seq, error=error, code=code, files=files)
