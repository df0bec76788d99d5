"""Pooling task: which task a model serves, how its hidden states become one vector.

A model directory serves `generate` (a causal LM) or `embed` (an encoder such as BERT: the
whole prompt runs in one step and its hidden states are pooled into one vector). The
pooling method comes from the sentence-transformers files when present (modules.json ->
the Pooling module's config.json, a Normalize module), else the architecture's default.

The task and config helpers import no torch (the scheduler process uses them); `pool` does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TASKS = ("generate", "embed")
# encoder architectures with a pooling implementation (registry.py maps them to classes)
EMBEDDING_ARCHITECTURES = frozenset({"BertModel"})
POOLING_TYPES = ("mean", "cls", "last", "max", "mean_sqrt_len")
# sentence-transformers Pooling config.json flag -> our pooling type
_ST_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
_ST_NAMES = {"cls": "cls", "mean": "mean", "max": "max", "lasttoken": "last", "mean_sqrt_len_tokens": "mean_sqrt_len"}


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def model_architecture(model_dir: str) -> str:
    cfg = _read_json(os.path.join(model_dir, "config.json"))
    archs = cfg.get("architectures") or []
    return archs[0] if archs else str(cfg.get("model_type", "unknown"))


def resolve_task(model_dir: str, requested: str = "auto") -> str:
    """`generate` or `embed` for this model; `auto` picks from the architecture (an encoder
    such as BertModel, or sentence-transformers files on a non-causal model -> embed).
    ValueError when the model cannot serve the requested task."""
    if requested == "embedding":  # vLLM's older spelling
        requested = "embed"
    if requested not in ("auto", *TASKS):
        raise ValueError(f"unknown task {requested!r}; expected auto, generate or embed")
    arch = model_architecture(model_dir)
    encoder = arch in EMBEDDING_ARCHITECTURES
    if requested == "auto":
        st = os.path.isfile(os.path.join(model_dir, "modules.json")) and not arch.endswith("ForCausalLM")
        return "embed" if encoder or st else "generate"
    if requested == "embed" and not encoder:
        raise ValueError(
            f"model {model_dir} ({arch}) cannot serve the embed task; embedding architectures: "
            f"{', '.join(sorted(EMBEDDING_ARCHITECTURES))}"
        )
    if requested == "generate" and encoder:
        raise ValueError(
            f"model {model_dir} ({arch}) is an encoder without a language-model head: it serves only "
            "the embed task (--task embed / --runner pooling)"
        )
    return requested


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # L2-normalize the pooled vector (per-request override in PoolingParams)

    @classmethod
    def from_dir(cls, model_dir: str, default_type: str = "cls", default_normalize: bool = True) -> PoolingConfig:
        """From sentence-transformers' modules.json (Transformer -> Pooling [-> Normalize]);
        the defaults when the directory has none. Other modules (Dense, ...) are refused."""
        path = os.path.join(model_dir, "modules.json")
        if not os.path.isfile(path):
            return cls(default_type, default_normalize)
        pooling_type, normalize = default_type, False
        for m in _read_json(path):
            kind = str(m.get("type", "")).rsplit(".", 1)[-1]
            if kind == "Transformer":
                continue
            if kind == "Pooling":
                pooling_type = _st_pooling_type(os.path.join(model_dir, m.get("path", ""), "config.json"))
            elif kind == "Normalize":
                normalize = True
            else:
                raise ValueError(f"sentence-transformers module {m.get('type')!r} in {path} is not supported")
        return cls(pooling_type, normalize)


def _st_pooling_type(path: str) -> str:
    cfg = _read_json(path) if os.path.isfile(path) else {}
    if not cfg.get("include_prompt", True):
        raise ValueError(f"{path}: pooling without the prompt (include_prompt=false) is not supported")
    if "pooling_mode" in cfg and isinstance(cfg["pooling_mode"], str):
        modes = [_ST_NAMES.get(cfg["pooling_mode"], cfg["pooling_mode"])]
    else:
        modes = [t for k, t in _ST_MODES.items() if cfg.get(k)]
    if len(modes) != 1 or modes[0] not in POOLING_TYPES:
        raise ValueError(f"{path}: pooling mode(s) {modes} not supported; expected exactly one of {POOLING_TYPES}")
    return modes[0]


def pool(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str, normalize: list[bool]) -> torch.Tensor:
    """[B, H] float32 vectors from the flat hidden states [T, H] of B whole sequences
    (sequence i is the next seq_lens[i] rows); row i L2-normalized when normalize[i]."""
    import torch
    import torch.nn.functional as F

    h = hidden.float()
    lens = torch.tensor(seq_lens)
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    if pooling_type == "cls":
        out = h[starts]
    elif pooling_type == "last":
        out = h[ends - 1]
    elif pooling_type == "max":
        out = torch.stack([h[s:e].amax(0) for s, e in zip(starts.tolist(), ends.tolist())])
    elif pooling_type in ("mean", "mean_sqrt_len"):
        seg = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
        sums = torch.zeros(len(seq_lens), h.shape[1], dtype=h.dtype).index_add_(0, seg, h)
        div = lens.to(h.dtype) if pooling_type == "mean" else lens.to(h.dtype).sqrt()
        out = sums / div[:, None]
    else:
        raise ValueError(f"unknown pooling type {pooling_type!r}")
    if any(normalize):
        rows = torch.tensor(normalize)
        out = torch.where(rows[:, None], F.normalize(out, p=2, dim=-1), out)
    return out
