"""Encoder actor: one process of the encoder pool, running only a vision-language model's
vision tower and projector (no decoder weights, no KV cache).

It connects a DEALER to the encoder router, announces itself with `Hello`, then answers each
`EncodeImages` (pixels in an extra frame) with `ImagesEncoded` (features in an extra frame).
A job that fails is answered with an error; the encoder goes on.
"""

from __future__ import annotations

import os
import time

import torch
import zmq

from axonserve.actors.runtime import Actor
from axonserve.neuron.config import ModelConfig
from axonserve.neuron.loader import iter_weights
from axonserve.neuron.model_runner import DTYPES
from axonserve.neuron.registry import model_class
from axonserve.protocol import Codec, DecodeError, tensor_from_frame, tensor_ref
from axonserve.protocol.messages import EncodeImages, Hello, ImagesEncoded

_codec = Codec(EncodeImages)


def load_vision_encoder(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model class built with `vision_only=True`: only vision tower and projector weights."""
    mc = ModelConfig.from_dir(model_dir)
    cls = model_class(mc.architecture)
    if not getattr(cls, "is_multimodal", False):
        raise ValueError(f"--encoder-workers needs a vision-language model; {mc.architecture} takes no images")
    model = cls(mc, dtype, vision_only=True)  # type: ignore[call-arg]
    model.load_weights(iter_weights(model_dir, progress=False))
    return model.eval()


class EncoderActor(Actor):
    kind = "encoder"

    async def setup(self) -> dict:
        cfg = self.config
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(cfg.threads or max(1, cores // (cfg.num_workers + cfg.encoder_workers)))
        self.dtype = DTYPES[cfg.dtype]
        self.model = load_vision_encoder(cfg.model, self.dtype)
        self.sock = self.socket(zmq.DEALER, self.addresses.router, identity=self.name.encode())
        await self.sock.send_multipart(Codec.encode(Hello(self.name, os.getpid())))
        return {"pid": os.getpid(), "threads": torch.get_num_threads()}

    async def on_peer_restarted(self, name: str, seconds: float, info: dict) -> None:
        if name == "router":  # the new router learns of this encoder from its Hello
            await self.sock.send_multipart(Codec.encode(Hello(self.name, os.getpid())))

    async def run(self) -> None:
        async for job, frames in self.messages(self.sock, _codec, "encode job"):
            try:
                pixels = tensor_from_frame(job.pixel_values, frames)
            except DecodeError as e:
                self.dropped("encode job", e)
                continue
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    feats = self.model.encode_images(pixels.to(self.dtype)).contiguous()
            except Exception as e:  # noqa: BLE001 - that job fails, the encoder goes on
                self.log.exception("encode_failed", request_id=job.request_id)
                reply = ImagesEncoded(job.request_id, error=f"{type(e).__name__}: {e}", error_code=500)
                await self.sock.send_multipart(Codec.encode(reply), copy=False)
                continue
            self.log.debug(
                "encoded", request_id=job.request_id, images=len(job.hashes), seconds=round(time.perf_counter() - t0, 4)
            )
            reply = ImagesEncoded(job.request_id, embeddings=tensor_ref(1, feats))
            await self.sock.send_multipart(Codec.encode(reply, [feats]), copy=False)
