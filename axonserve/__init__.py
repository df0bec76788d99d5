"""axonserve: an actor-model LLM serving engine for AWS Neuron and plain CPUs."""

__version__ = "0.1.0"

from axonserve.lora.request import LoRARequest  # noqa: E402
from axonserve.protocol.messages import SamplingParams  # noqa: E402

__all__ = ["SamplingParams", "LLM", "LoRARequest", "__version__"]


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing the package must not start torch
        from axonserve.frontends.offline import LLM

        return LLM
    raise AttributeError(name)
