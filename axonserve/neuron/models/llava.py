"""LLaVA: CLIP vision tower -> MLP projector -> a decoder from the registry (Llama family).

The decoder runs over the paged flat batch as for text; a prompt's image placeholder
positions take the projected image features instead of the placeholder token's embedding
(`forward(..., mm_rows, mm_embeds)`). Images are encoded once per request (`encode_images`),
either in the worker or by an encoder actor that builds this class with `vision_only=True`
(no decoder weights in memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from axonserve.neuron.config import ModelConfig, _arch_from_model_type
from axonserve.neuron.layers.linear import default_weight_loader
from axonserve.neuron.models.clip import CLIPVisionTower, activation


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias, dtype=dtype)
        self.act = activation(act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _strip(name: str, *prefixes: str) -> str | None:
    for p in prefixes:
        if name.startswith(p):
            return name[len(p) :]
    return None


class LlavaForConditionalGeneration(nn.Module):
    is_multimodal = True

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, vision_only: bool = False):
        super().__init__()
        raw = cfg.raw
        self.config = cfg
        vc = dict(raw["vision_config"])
        self.image_token_id = int(raw.get("image_token_index", raw.get("image_token_id", 32000)))
        layer = raw.get("vision_feature_layer", -2)
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        self.strategy = raw.get("vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ValueError(
                f"vision_feature_select_strategy {self.strategy!r} is not supported; supported: default, full"
            )
        # the decoder first: its layers are the model's first `layers` list (snapshot capture)
        self.language_model: nn.Module | None = None
        if not vision_only:
            from axonserve.neuron.registry import model_class

            text_arch = _arch_from_model_type(raw.get("text_config", {}).get("model_type", "llama"))
            lm_cls = model_class(text_arch)
            if getattr(lm_cls, "is_multimodal", False) or not hasattr(lm_cls, "compute_logits"):
                raise ValueError(f"LLaVA decoder {text_arch} is not a supported causal LM")
            self.language_model = lm_cls(dataclasses.replace(cfg, architecture=text_arch), dtype)
        self.vision_tower = CLIPVisionTower(vc, dtype)
        self.multi_modal_projector = LlavaProjector(
            vc["hidden_size"] * len(self.feature_layers),
            cfg.hidden_size,
            raw.get("projector_hidden_act", "gelu"),
            bool(raw.get("multimodal_projector_bias", True)),
            dtype,
        )

    @property
    def tokens_per_image(self) -> int:
        n = (self.vision_tower.image_size // self.vision_tower.patch_size) ** 2
        return n + (self.strategy == "full")

    # ------------------------------------------------------------------ compute

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] preprocessed pixels -> [N, tokens_per_image, text hidden] features."""
        states = self.vision_tower.hidden_states(pixel_values, self.feature_layers)
        if self.strategy == "default":  # drop CLS
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: Any,
        mm_rows: torch.Tensor | None = None,
        mm_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, H]; rows `mm_rows` of the batch take `mm_embeds`."""
        lm = self.language_model
        assert lm is not None, "vision-only LLaVA has no decoder"
        x = lm.model.embed_tokens(input_ids)
        if mm_rows is not None and len(mm_rows):
            x = x.index_copy(0, mm_rows, mm_embeds.to(x.dtype))
        return lm.model(input_ids, positions, kv_caches, meta, inputs_embeds=x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.language_model is not None
        return self.language_model.compute_logits(hidden)

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF LLaVA names, old (`language_model.model.*`) and new (`model.language_model.*`)."""
        own = dict(self.vision_tower.named_parameters(prefix="vision_tower"))
        own.update(self.multi_modal_projector.named_parameters(prefix="multi_modal_projector"))
        loaded: set[str] = set()

        def text_weights():
            for name, w in weights:
                local = _strip(name, "model.vision_tower.", "vision_tower.")
                if local is not None:
                    self._copy(own, "vision_tower." + local.removeprefix("vision_model."), w, loaded)
                    continue
                local = _strip(name, "model.multi_modal_projector.", "multi_modal_projector.")
                if local is not None:
                    self._copy(own, "multi_modal_projector." + local, w, loaded)
                    continue
                if self.language_model is None:
                    continue
                local = _strip(name, "model.language_model.", "language_model.model.")
                if local is not None:
                    yield "model." + local, w
                else:
                    yield _strip(name, "language_model.") or name, w

        if self.language_model is not None:
            loaded |= {"language_model." + n for n in self.language_model.load_weights(text_weights())}
        else:
            for _ in text_weights():
                pass
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        return loaded

    @staticmethod
    def _copy(params: dict[str, nn.Parameter], name: str, w: torch.Tensor, loaded: set[str]) -> None:
        if name.startswith("vision_tower.post_layernorm.") and name not in params:
            return
        if name not in params:
            raise KeyError(f"checkpoint tensor {name} has no parameter in LlavaForConditionalGeneration")
        p = params[name]
        default_weight_loader(p, w.to(p.dtype), None)
        loaded.add(name)
