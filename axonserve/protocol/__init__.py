"""The only wire format between axonserve processes: msgspec Structs plus tensor frames."""

from axonserve.protocol.codec import Codec, DecodeError, TensorRef, tensor_from_frame, tensor_ref
from axonserve.protocol.messages import *  # noqa: F401,F403
from axonserve.protocol.messages import (
    ClientToEngine,
    Control,
    EngineToClient,
    ParamError,
    SamplingParams,
    WorkerMsg,
)

__all__ = [
    "Codec",
    "DecodeError",
    "TensorRef",
    "tensor_from_frame",
    "tensor_ref",
    "ClientToEngine",
    "Control",
    "EngineToClient",
    "WorkerMsg",
    "ParamError",
    "SamplingParams",
]
