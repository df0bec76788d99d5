"""The scheduler's proposal stage: draft tokens for the next step's verification.

Runs after each step's update. EAGLE's drafts come with the step result (worker rank 0 runs
the head on the step's own hidden states), so nothing is left to do; n-gram prompt lookup runs
here in the scheduler; a draft model runs in the drafter actor, asked over its socket and
awaited (it needs only tokens: each candidate's whole sequence, and keeps the KV of the prefix
it already computed).
"""

from __future__ import annotations

import asyncio
import time

import zmq

from axonserve.engine.request import Status
from axonserve.engine.stage import Core, recv_before
from axonserve.protocol import Codec, DecodeError
from axonserve.protocol.messages import DraftRequest, DraftResult, StepResult

_codec = Codec(DraftResult)


class ProposalStage:
    def __init__(self, core: Core, actor, address: str):  # noqa: ANN001 - the scheduler actor makes the socket
        self.core = core
        spec = core.config.speculative
        assert spec is not None
        self.method = spec.method
        self.sock = actor.socket(zmq.DEALER, address) if spec.uses_drafter else None
        self.dropped = actor.dropped
        self.drafted: set[str] = set()  # requests the drafter holds state for
        self.restarting = asyncio.Event()  # the drafter is being replaced (supervisor)

    async def propose(self, result: StepResult) -> bool:
        """Drafts for the running requests; False: the drafter failed (the engine is failing)."""
        spec = self.core.sched.spec
        assert spec is not None
        if self.method == "eagle":
            return True
        want = spec.candidates(self.core.sched.running)
        if self.method == "ngram":
            spec.ngram(want)
            return True
        if self.restarting.is_set():  # the drafter is being replaced: this step goes without drafts
            return True
        msg = self._request(result.step_id, want)
        if not msg.request_ids and not msg.finished_request_ids:
            return True
        msg.reply = bool(msg.request_ids)  # else only finished requests to drop: nothing to wait for
        assert self.sock is not None
        await self.sock.send_multipart(Codec.encode(msg), copy=False)
        if not msg.reply:
            return True
        reply = await self._reply(msg.step_id)
        if reply is None:
            return False
        if reply.error:  # drafts are optional: this step goes without
            self.core.log.warning("drafter.error", step_id=msg.step_id, error=reply.error)
            return True
        for rid, drafts in zip(reply.request_ids, reply.draft_token_ids):
            req = self.core.sched.requests.get(rid)
            if req is not None and req.status == Status.RUNNING:
                self.core.sched.take_drafts(req, drafts)
        return True

    def drafter_restarting(self) -> None:
        """The drafter died or hung: steps go without drafts until its replacement is ready."""
        self.restarting.set()
        self.drafted.clear()  # the new drafter holds no request state

    def drafter_restarted(self) -> None:
        self.restarting.clear()

    def _request(self, step_id: int, want: list) -> DraftRequest:
        msg = DraftRequest(step_id)
        for req, k in want:
            msg.request_ids.append(req.request_id)
            msg.offsets.append(len(msg.tokens))
            msg.counts.append(req.num_tokens)
            msg.num_drafts.append(k)
            msg.tokens += req.token_ids
            self.drafted.add(req.request_id)
        gone = [rid for rid in self.drafted if rid not in self.core.sched.requests]
        self.drafted.difference_update(gone)
        msg.finished_request_ids = gone
        return msg

    async def _reply(self, step_id: int) -> DraftResult | None:
        """The drafter's answer for `step_id` within the step timeout; junk is dropped. None
        when it does not come (the engine is failed) or the engine failed meanwhile."""
        assert self.sock is not None
        core = self.core
        deadline = time.monotonic() + core.config.step_timeout_s
        while True:
            frames = await recv_before(self.sock, deadline, core.dead, self.restarting)
            if frames is None:
                if self.restarting.is_set() and not core.dead.is_set():
                    return DraftResult(step_id, error="the drafter is being restarted")
                if not core.dead.is_set():
                    await core.fail(f"the drafter gave no reply for drafts for step {step_id}")
                return None
            try:
                reply, _ = _codec.decode(frames)
            except DecodeError as e:
                self.dropped("the drafter reply", e, awaiting=f"drafts for step {step_id}")
                continue
            if reply.step_id < step_id:  # an answer we stopped waiting for
                continue
            if reply.step_id != step_id:
                await core.fail(f"drafter reply out of order (step {reply.step_id}, expected {step_id})")
                return None
            return reply
