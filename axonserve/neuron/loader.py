"""Build a model from a directory: class from the registry, tensors from safetensors files."""

from __future__ import annotations

import glob
import os
import re
import time
from typing import Any, Callable, Iterator

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


def code_twins(model: nn.Module, path: str) -> dict[str, nn.Parameter]:
    """The linear weights that get a float32 twin (`p.exact`, filled by load_weights beside them)
    when the checkpoint stores float32 (a converted GGUF) and the bf16 model would round it: GGUF
    block codes found in a twin become its weight's code copy (`fit_twins`, layers/quant.py
    code_copy). AXONSERVE_CODE_COPIES=0 leaves them out; so do models whose load_weights does not
    fill twins (`fills_code_twins`: Llama's family) and CPUs without the codes kernel. By name."""
    from axonserve.neuron.ops import native

    if os.environ.get("AXONSERVE_CODE_COPIES", "1") in ("0", "false", "no"):
        return {}
    k = native.kernels()
    if k is None or not hasattr(k, "code_rows") or not k.code_rows() or not getattr(model, "fills_code_twins", False):
        return {}
    with safe_open(safetensors_files(path)[0], framework="pt") as f:
        if any(f.get_slice(n).get_dtype() != "F32" for n in list(f.keys())[:8]):
            return {}
    linear = {id(m.weight) for m in model.modules() if getattr(m, "quantizable", False)}
    return {
        name: p
        for name, p in model.named_parameters()
        if id(p) in linear and p.dtype == torch.bfloat16 and p.dim() == 2
    }


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _unit(name: str) -> int | str:
    """What a parameter belongs to for fitting: its decoder layer, else itself."""
    m = _LAYER.search(name)
    return int(m[1]) if m else name


def fit_twins(
    weights: Iterator[tuple[str, torch.Tensor]], twins: dict[str, nn.Parameter], param_name: Callable[[str], Any]
):
    """The checkpoint's tensors, as they stream to load_weights, with the twins of the unit each
    fills (its decoder layer, or its own parameter: `param_name(tensor name)[0]`) given to that
    unit's parameters when the stream enters it and fitted (`p.code_copy`, layers/quant.py
    code_copy) and given back when it leaves; so a load holds one unit's twins at a time. The GGUF
    converter writes a layer's tensors together; in a checkpoint that does not, a tensor for a unit
    already fitted drops that unit's copies (the weights load all the same, without copies there)."""
    from axonserve.neuron.layers.quant import code_copy

    by_unit: dict[int | str, list[nn.Parameter]] = {}
    for name, p in twins.items():
        by_unit.setdefault(_unit(name), []).append(p)
    fitted: set[int | str] = set()

    def fit(unit: int | str) -> None:
        for p in by_unit.get(unit, ()):
            exact = p.__dict__.pop("exact", None)
            if exact is not None:
                p.code_copy = code_copy(exact.data, p.data)
        fitted.add(unit)

    current: int | str | None = None
    try:
        for name, w in weights:
            unit = _unit(param_name(name)[0])
            if unit != current:
                if current is not None:
                    fit(current)
                if unit in fitted:  # back to a unit fitted already: its copies may predate this tensor
                    for p in by_unit.get(unit, ()):
                        p.__dict__.pop("code_copy", None)
                else:
                    for p in by_unit.get(unit, ()):
                        p.exact = nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=False)
                current = unit
            yield name, w
        for unit in by_unit:
            if unit not in fitted:
                fit(unit)
    finally:  # (a load that stopped early keeps no twin)
        for p in twins.values():
            p.__dict__.pop("exact", None)


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

    twins = code_twins(model, cfg.path) if not quantization and pack and can_pack(dtype) else {}
    model.load_weights(fit_twins(weights, twins, model.param_name) if twins else weights)
    model.eval()

    if quantization:
        quantize_model(model, quantization, dtype)
    elif pack and can_pack(dtype):
        quantize_model(model, "packed", dtype)
    elif pack and panels_serve(dtype, activation_quantization == "int8"):
        quantize_model(model, "panel", dtype, int8_activations=activation_quantization == "int8")
    for p in twins.values():  # (quantize_model takes each copy it uses)
        p.__dict__.pop("code_copy", None)
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
