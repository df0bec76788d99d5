"""transformers reference for embeddings: AutoModel, then sentence-transformers' pipeline as the
model's modules.json configures it (mean pooling over the attention mask, L2 normalize for
all-MiniLM-L6-v2), computed on a padded batch exactly as sentence-transformers does."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def minilm_dir() -> str:
    from axonserve.neuron.model_source import resolve_model

    return resolve_model("all-MiniLM-L6-v2")


@functools.cache
def hf_encoder(path: str):
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def hf_hidden(path: str, inputs: list[str] | list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Last hidden states [B, L, H] of a padded batch and its attention mask [B, L]."""
    model, tok = hf_encoder(path)
    if isinstance(inputs[0], str):
        batch = tok(inputs, padding=True, return_tensors="pt")
        ids, mask = batch["input_ids"], batch["attention_mask"]
    else:
        width = max(len(x) for x in inputs)
        ids = torch.tensor([list(x) + [0] * (width - len(x)) for x in inputs])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in inputs])
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state, mask


def st_embed(path: str, inputs: list[str] | list[list[int]], normalize: bool = True) -> torch.Tensor:
    """Mean pooling over the attention mask, then (optionally) L2 normalize: [B, H]."""
    h, mask = hf_hidden(path, inputs)
    m = mask[..., None].to(h.dtype)
    out = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return F.normalize(out, p=2, dim=1) if normalize else out
