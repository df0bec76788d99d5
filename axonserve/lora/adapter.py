"""Validation of a PEFT LoRA directory, the hostile input behind every adapter.

No torch here: the frontend imports this to refuse a bad adapter at load time (HTTP 400) before
any rank reads a byte of weights. Everything read is bounded: the JSON config, and of
`adapter_model.safetensors` only the 8-byte header length and the JSON header itself.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from axonserve.neuron.config import ModelConfig

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTN_MODULES + MLP_MODULES
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20
# base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight
_TENSOR_RE = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_ST_DTYPES = {"F32", "F16", "BF16", "F64"}


class LoraError(ValueError):
    """A user-facing reason an adapter cannot be served (-> HTTP 400)."""


@dataclass(frozen=True)
class AdapterConfig:
    path: str
    rank: int
    alpha: float
    scaling: float  # alpha / r, or alpha / sqrt(r) with use_rslora
    target_modules: tuple[str, ...]  # subset of SUPPORTED_MODULES, in that order


def _read_json_bounded(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise LoraError(f"cannot read {CONFIG_NAME}: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise LoraError(f"{CONFIG_NAME} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):  # (deep nesting: RecursionError)
        raise LoraError(f"{CONFIG_NAME} is not valid JSON") from None


def _targets(cfg: dict[str, Any]) -> tuple[str, ...]:
    raw = cfg.get("target_modules")
    if isinstance(raw, str):
        # PEFT treats a string as a full-match regex; only a plain module name is accepted
        if raw not in SUPPORTED_MODULES:
            raise LoraError(f"regex target_modules ({raw[:80]!r}) are not supported; list module names")
        raw = [raw]
    if not isinstance(raw, list) or not raw or not all(isinstance(m, str) for m in raw):
        raise LoraError("target_modules must be a non-empty list of module names")
    names = set()
    for m in raw:
        short = m.rsplit(".", 1)[-1]
        if short not in SUPPORTED_MODULES or (m != short and not m.startswith("model.")):
            raise LoraError(f"target module {m[:80]!r} is not supported (supported: {', '.join(SUPPORTED_MODULES)})")
        names.add(short)
    return tuple(m for m in SUPPORTED_MODULES if m in names)


def _module_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every supported module of the base model."""
    h, d = model.hidden_size, model.head_dim
    q, kv, inter = model.num_heads * d, model.num_kv_heads * d, model.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def _check_tensors(path: str, rank: int, targets: tuple[str, ...], model: ModelConfig | None) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise LoraError(f"{WEIGHTS_NAME} is truncated")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES:
                raise LoraError(f"{WEIGHTS_NAME} has an invalid header length")
            raw = f.read(n)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise LoraError(f"cannot read {WEIGHTS_NAME}: {e.strerror or e}") from None
    if len(raw) != n:
        raise LoraError(f"{WEIGHTS_NAME} is truncated")
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise LoraError(f"{WEIGHTS_NAME} has a malformed header") from None
    if not isinstance(header, dict):
        raise LoraError(f"{WEIGHTS_NAME} has a malformed header")
    shapes = _module_shapes(model) if model is not None else None
    found: set[str] = set()
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        m = _TENSOR_RE.match(name)
        if m is None:
            raise LoraError(f"unsupported tensor {name[:120]!r} in {WEIGHTS_NAME}")
        layer, _group, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in targets:
            raise LoraError(f"tensor {name[:120]!r} is for a module not in target_modules")
        if not isinstance(info, dict):
            raise LoraError(f"tensor {name[:120]!r} has a malformed entry")
        shape, dtype, offs = info.get("shape"), info.get("dtype"), info.get("data_offsets")
        if dtype not in _ST_DTYPES:
            raise LoraError(f"tensor {name[:120]!r} has unsupported dtype {str(dtype)[:16]!r}")
        if (
            not isinstance(shape, list)
            or len(shape) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
        ):
            raise LoraError(f"tensor {name[:120]!r} is not a matrix")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1] <= data_len
        ):
            raise LoraError(f"tensor {name[:120]!r} has invalid data offsets")
        want_r = shape[0] if ab == "A" else shape[1]
        if want_r != rank:
            raise LoraError(f"tensor {name[:120]!r} has rank {want_r}, adapter_config.json says r={rank}")
        if shapes is not None:
            assert model is not None
            if layer >= model.num_layers:
                raise LoraError(f"tensor {name[:120]!r} names layer {layer}; the model has {model.num_layers}")
            fin, fout = shapes[module]
            want = [rank, fin] if ab == "A" else [fout, rank]
            if shape != want:
                raise LoraError(f"tensor {name[:120]!r} has shape {shape}, the base model needs {want}")
        found.add(name)
    if not found:
        raise LoraError(f"{WEIGHTS_NAME} holds no LoRA tensors")
    # every (layer, module) present has both A and B
    for name in found:
        other = name[: -len("A.weight")] + ("B.weight" if name.endswith("A.weight") else "A.weight")
        if other not in found:
            raise LoraError(f"tensor {name[:120]!r} has no matching lora_{'B' if name.endswith('A.weight') else 'A'}")


def read_adapter_config(path: str, max_lora_rank: int, model: ModelConfig | None = None) -> AdapterConfig:
    """Validate the PEFT LoRA directory at `path` and return what serving it needs.

    Raises LoraError with a user-facing reason for anything the engine does not serve. With
    `model`, the tensors' shapes (from the safetensors header only) must fit the base model.
    """
    if not isinstance(path, str) or not path or "\x00" in path:
        raise LoraError("the adapter path must be a non-empty string")
    if not os.path.isdir(path):
        raise LoraError("the adapter path is not a directory")
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise LoraError(f"{CONFIG_NAME} not found in the adapter directory")
    cfg = _read_json_bounded(cfg_path)
    if not isinstance(cfg, dict):
        raise LoraError(f"{CONFIG_NAME} must hold a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise LoraError(f"peft_type {str(cfg.get('peft_type'))[:32]!r} is not supported; only LORA")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError("r must be a positive integer")
    if r > max_lora_rank:
        raise LoraError(f"the adapter's rank r={r} exceeds --max-lora-rank {max_lora_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraError("lora_alpha must be a finite number")
    if cfg.get("use_dora"):
        raise LoraError("DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError("adapters with trained biases (bias != 'none') are not supported")
    if cfg.get("modules_to_save"):
        raise LoraError("adapters with modules_to_save are not supported")
    if cfg.get("layers_to_transform") is not None or cfg.get("layers_pattern"):
        raise LoraError("layers_to_transform / layers_pattern are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoraError(f"{key} is not supported")
    if cfg.get("target_parameters"):
        raise LoraError("target_parameters is not supported")
    if cfg.get("exclude_modules"):
        raise LoraError("exclude_modules is not supported")
    targets = _targets(cfg)
    weights = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights):
        if os.path.exists(os.path.join(path, "adapter_model.bin")):
            raise LoraError("adapter_model.bin (pickle) is refused; save the adapter as safetensors")
        raise LoraError(f"{WEIGHTS_NAME} not found in the adapter directory")
    _check_tensors(weights, r, targets, model)
    scaling = float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)
    return AdapterConfig(path=path, rank=r, alpha=float(alpha), scaling=scaling, target_modules=targets)


def lora_key(spec: Any) -> tuple[str, int, str, str]:
    """A request's adapter as a prefix-cache extra key and an identity for slot accounting (a
    `LoraSpec`): two adapters never share KV blocks, nor an adapter and the base model."""
    return ("lora", spec.lora_id, spec.name, spec.path)
