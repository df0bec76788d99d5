"""Build a model from a directory: class from the registry, tensors from safetensors files."""

from __future__ import annotations

import glob
import os
import time
from typing import Iterator

import structlog
import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from axonserve.neuron.config import ModelConfig, checkpoint_quantization, fp8_checkpoint_config
from axonserve.neuron.registry import model_class

log = structlog.get_logger()


def safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    return files


def iter_weights(path: str, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every safetensors file, with a tqdm bar over tensors."""
    files = safetensors_files(path)
    handles = [safe_open(f, framework="pt") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False) as bar:
        for h in handles:
            for name in h.keys():
                yield name, h.get_tensor(name)
                bar.update(1)


def code_twins(model: nn.Module, path: str) -> list[nn.Parameter]:
    """Give the linear weights a float32 twin (`p.exact`) that load_weights fills beside them, when
    the checkpoint stores float32 (a converted GGUF) and the bf16 model would round it: GGUF block
    codes found in a twin become its weight's code copy (layers/quant.py PackedWeight).
    AXONSERVE_CODE_COPIES=0 leaves them out; so do models whose load_weights does not fill twins
    (`fills_code_twins`: Llama's family) and CPUs without the codes kernel. Returns the parameters given one."""
    from axonserve.neuron.layers.quant import CODE_TWIN_MAX_BYTES
    from axonserve.neuron.ops import native

    if os.environ.get("AXONSERVE_CODE_COPIES", "1") in ("0", "false", "no"):
        return []
    k = native.kernels()
    if k is None or not hasattr(k, "code_rows") or not k.code_rows() or not getattr(model, "fills_code_twins", False):
        return []
    with safe_open(safetensors_files(path)[0], framework="pt") as f:
        if any(f.get_slice(n).get_dtype() != "F32" for n in list(f.keys())[:8]):
            return []
    params = {
        id(m.weight): m.weight
        for m in model.modules()
        if getattr(m, "quantizable", False) and isinstance(getattr(m, "weight", None), nn.Parameter)
    }
    ps = [p for p in params.values() if p.dtype == torch.bfloat16 and p.dim() == 2]
    need = sum(p.numel() * 4 for p in ps)
    if need > CODE_TWIN_MAX_BYTES:
        log.info("model.code_twins_skipped", gib=round(need / 2**30, 1), limit_gib=CODE_TWIN_MAX_BYTES >> 30)
        return []
    for p in ps:
        p.exact = nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=False)
    return ps


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    progress: bool = True,
    quantization: str = "",
    pack: bool = True,
    activation_quantization: str = "",
) -> nn.Module:
    """quantization: "" (weights as loaded), or a weight-only method of layers/quant.py;
    pack: bf16 linear weights go into oneDNN's layout once (layers/quant.py PackedWeight), float32
    ones into native panels on AVX2 CPUs (PanelWeight; on AVX-512 ones only with int8
    activations: quant.panels_serve); activation_quantization "int8": block-code
    panels multiply int8 activations (an error where no weight is block codes)."""
    t0 = time.perf_counter()
    model = model_class(cfg.architecture)(cfg, dtype)
    weights = iter_weights(cfg.path, progress)
    fp8_cfg = fp8_checkpoint_config(cfg.path)
    if fp8_cfg is not None:  # FP8 codes dequantized as they stream in, quantized per row again below
        from axonserve.neuron.layers.fp8 import checkpoint_weights

        weights, quantization = checkpoint_weights(weights, fp8_cfg), checkpoint_quantization(cfg.path, quantization)
    from axonserve.neuron.layers.quant import can_pack, panels_serve, quantize_model

    twins = code_twins(model, cfg.path) if not quantization and pack and can_pack(dtype) else []
    model.load_weights(weights)
    model.eval()

    if quantization:
        quantize_model(model, quantization, dtype)
    elif pack and can_pack(dtype):
        quantize_model(model, "packed", dtype)
    elif pack and panels_serve(dtype, activation_quantization == "int8"):
        quantize_model(model, "panel", dtype, int8_activations=activation_quantization == "int8")
    for p in twins:  # (quantize_model takes each twin it uses)
        p.__dict__.pop("exact", None)
    if activation_quantization and not any(
        getattr(getattr(m, "qweight", None), "int8_activations", False) for m in model.modules()
    ):
        raise ValueError(
            "--activation-quantization int8 needs GGUF Q4_1 / Q8_0 weights served in float32 (--dtype float32) on "
            "an AVX2 + FMA CPU (native panel kernels); this model and machine have none"
        )
    n = sum(p.numel() for p in model.parameters() if p is not None)
    log.info(
        "model.loaded", arch=cfg.architecture, params=n, dtype=str(dtype), seconds=round(time.perf_counter() - t0, 2)
    )
    return model
