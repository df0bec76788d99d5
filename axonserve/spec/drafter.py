"""Drafter actor: holds the EAGLE head and proposes draft tokens for the scheduler.

After every step the scheduler forwards what became valid on the target (hidden states of
prompt chunks and verified tokens, as one tensor frame, zero-copy from worker rank 0) with
the token that followed each position; the drafter extends each request's head KV with
them and answers k greedy drafts for the requests the scheduler wants to speculate. The
head's KV is the drafter's own (dense, per request), cropped back over rejected drafts.

Positions served from the target's prefix cache never reach the drafter; they are filled
with zero keys/values (slightly lower acceptance for such requests, outputs unaffected:
every draft is verified).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import zmq

from axonserve.actors.runtime import Actor
from axonserve.protocol import Codec, DecodeError, tensor_from_frame
from axonserve.protocol.messages import DraftRequest, DraftResult

_codec = Codec(DraftRequest)
HEADS_DIR = os.path.join(os.path.dirname(__file__), "heads")
DEFAULT_HEADS = {"SmolLM2-135M-Instruct": "smollm2-135m-instruct"}  # served model -> shipped head


def head_dir(model: str, served_name: str) -> str:
    """The `model` of --speculative-config, or the head shipped for the served model."""
    if model:
        if not os.path.isfile(os.path.join(model, "eagle_config.json")):
            raise ValueError(f"EAGLE head directory {model!r} holds no eagle_config.json")
        return model
    name = DEFAULT_HEADS.get(served_name.removeprefix("HuggingFaceTB/"))
    path = os.path.join(HEADS_DIR, name) if name else ""
    if not path or not os.path.isfile(os.path.join(path, "eagle_config.json")):
        raise ValueError(f"no EAGLE head ships for {served_name!r}: pass \"model\": HEAD_DIR in --speculative-config "
                         "(make one with `axonserve train-eagle`)")
    return path


class DrafterActor(Actor):
    kind = "drafter"
    beat_in_thread = True  # a long proposal must not read as a hang

    async def setup(self) -> dict[str, Any]:
        from axonserve.spec.eagle import DraftKV, EagleHead

        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(self.config.threads or cores)
        spec = self.config.speculative
        assert spec is not None
        path = head_dir(spec.model, self.config.served_model_name or self.config.model)
        self.head = EagleHead.from_pretrained(path, self.config.model)
        self.new_kv = lambda: DraftKV.for_head(self.head)
        self.kvs: dict[str, Any] = {}
        self.sock = self.socket(zmq.ROUTER, self.addresses.drafter, bind=True)
        return {"head": path, "draft_vocab": self.head.config.draft_vocab_size}

    async def run(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            ident = frames[0].bytes
            try:
                msg, _ = _codec.decode(frames[1:])
                reply = self.propose(msg, frames[1:])
            except (DecodeError, ValueError) as e:
                self.log.error("drafter.bad_request", error=str(e))
                reply = DraftResult(step_id=-1, error=str(e))
            await self.sock.send_multipart([ident, *Codec.encode(reply)], copy=False)

    def propose(self, msg: DraftRequest, frames: list) -> DraftResult:
        from axonserve.spec.eagle import propose

        t0 = time.perf_counter()
        for rid in msg.finished_request_ids:
            self.kvs.pop(rid, None)
        if not msg.request_ids:
            return DraftResult(msg.step_id)
        feats = tensor_from_frame(msg.features, frames).to(self.head.fc.weight.dtype)
        tokens = torch.tensor(msg.tokens, dtype=torch.long)
        kvs, starts, toks, fs = [], [], [], []
        for rid, start, n, at in zip(msg.request_ids, msg.starts, msg.counts, msg.offsets):
            kv = self.kvs.get(rid)
            if kv is None:
                kv = self.kvs[rid] = self.new_kv()
            if start > kv.length:  # prefix-cache hit on the target: no features for the gap
                gap = start - kv.length
                zeros = torch.zeros(kv.k.shape[0], gap, kv.k.shape[2], dtype=kv.k.dtype)
                kv.write(kv.length, zeros, zeros)
            kvs.append(kv)
            starts.append(start)
            toks.append(tokens[at : at + n])
            fs.append(feats[at : at + n])
        k = max(msg.num_drafts)
        drafts = propose(self.head, kvs, starts, toks, fs, max(k, 1))
        want = [(rid, d[:m]) for rid, d, m in zip(msg.request_ids, drafts, msg.num_drafts) if m > 0]
        return DraftResult(msg.step_id, [r for r, _ in want], [d for _, d in want],
                           propose_s=time.perf_counter() - t0)
