"""Worker actor: one rank. Receives every step plan (SUB), runs the model, rank 0 answers.

The forward pass runs inline on the event loop: a step is short, and staying on one thread
avoids a hand-off per step. Model loading runs in a thread so the control channel stays
responsive (a shutdown during a long load is honoured).
"""

from __future__ import annotations

import asyncio
import os

import zmq

from axonserve.actors.runtime import Actor
from axonserve.protocol import Codec, DecodeError
from axonserve.protocol.messages import StepPlan

_plan_codec = Codec(StepPlan)


class WorkerActor(Actor):
    kind = "worker"

    async def setup(self) -> dict:
        self.rank = self.spec.rank
        self.sub = self.socket(zmq.SUB, self.addresses.plan)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.push = self.socket(zmq.PUSH, self.addresses.result) if self.rank == 0 else None
        world = self.config.num_workers
        if world > 1:
            import torch.distributed as dist

            await asyncio.to_thread(
                dist.init_process_group,
                "gloo",
                init_method=self.addresses.dist_init,
                rank=self.rank,
                world_size=world,
            )
        self.runner = await self._load_in_own_thread()
        r = self.runner
        return {
            "num_kv_blocks": r.num_kv_blocks,
            "max_model_len": r.max_model_len,
            "eos_token_ids": list(r.eos_token_ids),
            "vocab_size": r.vocab_size,
            "pid": os.getpid(),
        }

    async def _load_in_own_thread(self):
        """Build the runner on a thread that then exits, keeping the control loop responsive.

        Not `asyncio.to_thread`: a pool thread that ran torch stays alive with its OpenMP team,
        and the forward on this thread then ran ~1.8x slower (26 -> 47 ms per SmolLM2 step).
        torch's intra-op thread count is per thread, so it is copied over here as well."""
        import threading

        import torch

        from axonserve.neuron.model_runner import ModelRunner

        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def load() -> None:
            try:
                result = (ModelRunner(self.config, self.rank), torch.get_num_threads())
                loop.call_soon_threadsafe(done.set_result, result)
            except BaseException as e:  # noqa: BLE001 - re-raised on the loop
                loop.call_soon_threadsafe(done.set_exception, e)

        thread = threading.Thread(target=load, name="load-model", daemon=True)
        thread.start()
        runner, threads = await done
        thread.join()
        torch.set_num_threads(threads)
        return runner

    async def run(self) -> None:
        while True:
            frames = await self.sub.recv_multipart(copy=False)
            try:
                plan, _ = _plan_codec.decode(frames)
            except DecodeError as e:
                self.log.warning("bad_plan", error=str(e))
                continue
            result = self.runner.execute(plan)
            if self.push is not None:
                await self.push.send_multipart(Codec.encode(result, self.runner.result_tensors), copy=False)
