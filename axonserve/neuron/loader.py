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
    model.load_weights(weights)
    model.eval()
    from axonserve.neuron.layers.quant import can_pack, panels_serve, quantize_model

    if quantization:
        quantize_model(model, quantization, dtype)
    elif pack and can_pack(dtype):
        quantize_model(model, "packed", dtype)
    elif pack and panels_serve(dtype, activation_quantization == "int8"):
        quantize_model(model, "panel", dtype, int8_activations=activation_quantization == "int8")
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
