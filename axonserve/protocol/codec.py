"""Wire codec: msgpack body in frame 0, tensors as extra zero-copy frames.

A body that references tensors does so with `TensorRef(index)`; `encode` returns the frame
list to pass to `send_multipart(copy=False)`, `decode` rebuilds tensors with `torch.frombuffer`
(no copy: the tensor keeps the ZMQ frame alive). Decoding errors raise `DecodeError`; callers
log and drop, never crash.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence, TypeVar

import msgspec

# Received frames are read-only; tensors built on them are treated as read-only by contract.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

T = TypeVar("T")


class DecodeError(ValueError):
    pass


class TensorRef(msgspec.Struct, array_like=True, gc=False):
    """Names frame `index` (1-based among extra frames) holding a raw tensor buffer."""

    index: int
    dtype: str
    shape: list[int]


_encoder = msgspec.msgpack.Encoder()
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}  # what ref_frame accepts


class Codec:
    """Typed encoder/decoder for one socket's message union."""

    def __init__(self, union: Any):
        self._decoder = msgspec.msgpack.Decoder(union)

    @staticmethod
    def encode(msg: msgspec.Struct, tensors: Sequence[Any] = ()) -> list[Any]:
        frames: list[Any] = [_encoder.encode(msg)]
        for t in tensors:
            frames.append(memoryview(_tensor_bytes(t)))
        return frames

    def decode(self, frames: Sequence[Any]) -> tuple[Any, list[Any]]:
        """Return (message, raw extra frames). Raises DecodeError on anything malformed."""
        if not frames:
            raise DecodeError("empty message")
        body = frames[0]
        try:
            msg = self._decoder.decode(body.buffer if hasattr(body, "buffer") else body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise DecodeError(str(e)) from e
        return msg, list(frames[1:])


def tensor_ref(index: int, t: Any) -> TensorRef:
    return TensorRef(index=index, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))


def tensor_from_frame(ref: TensorRef, frames: Sequence[Any]) -> Any:
    """Rebuild the tensor named by `ref` from the extra frames (zero-copy view)."""
    import torch

    try:
        frame = frames[ref.index]
    except IndexError as e:
        raise DecodeError(f"tensor frame {ref.index} missing") from e
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    dtype = getattr(torch, ref.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise DecodeError(f"unknown dtype {ref.dtype}")
    if len(buf) == 0:
        return torch.empty(ref.shape, dtype=dtype)
    t = torch.frombuffer(buf, dtype=dtype)
    try:
        return t.view(ref.shape)
    except RuntimeError as e:
        raise DecodeError(f"tensor frame {ref.index} has wrong size for {ref.shape}") from e


def _tensor_bytes(t: Any) -> Any:
    import torch

    if isinstance(t, torch.Tensor):
        t = t.detach().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy()
        return t.numpy()
    return t


def frame_bytes(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")


def ref_frame(ref: TensorRef, frames: list[Any]) -> memoryview | str:
    """The frame `ref` names if its size matches its dtype and shape, else why not."""
    if ref.dtype not in _ITEMSIZE:
        return f"tensor dtype {ref.dtype!r} is not supported"
    if not 0 < ref.index < len(frames):
        return f"tensor frame {ref.index} is missing"
    buf = frame_bytes(frames[ref.index])
    if len(buf) != math.prod(ref.shape) * _ITEMSIZE[ref.dtype]:
        return f"tensor frame {ref.index} has {len(buf)} bytes, not {ref.shape} {ref.dtype}"
    return buf
