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
        import torch

        from axonserve.neuron.model_runner import ModelRunner

        def load() -> tuple[ModelRunner, int]:
            runner = ModelRunner(self.config, self.rank)
            return runner, torch.get_num_threads()

        self.runner, threads = await asyncio.to_thread(load)
        # The intra-op thread count is per calling thread: the forward runs on this one, and
        # without this it ran 2-3x slower than the runner measured in its own thread.
        torch.set_num_threads(threads)
        r = self.runner
        return {
            "num_kv_blocks": r.num_kv_blocks,
            "max_model_len": r.max_model_len,
            "eos_token_ids": list(r.eos_token_ids),
            "vocab_size": r.vocab_size,
            "pid": os.getpid(),
        }

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
                await self.push.send_multipart(Codec.encode(result), copy=False)
