"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from axonserve.neuron.models.bert import BertModel
from axonserve.neuron.models.llama import LlamaForCausalLM, MistralForCausalLM
from axonserve.neuron.models.llava import LlavaForConditionalGeneration
from axonserve.neuron.models.null import NullForCausalLM
from axonserve.neuron.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "AxonNullForCausalLM": NullForCausalLM,  # computes nothing: `axonserve bench step`
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,  # CLIP + projector + Llama-family decoder
    "BertModel": BertModel,  # encoder: embed task only (pooling.EMBEDDING_ARCHITECTURES)
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture} is not supported; supported: {', '.join(supported_architectures())}"
        ) from None
