"""Session fixtures: the default model converted from its GGUF, and a tiny random Llama.

The tiny model shares SmolLM2's tokenizer (vocab 49152) so text-level tests run end to end
through the real loaders in seconds.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
from collections import Counter

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def build_lane_venv(script: str, venv_var: str, venv: str, what: str) -> None:
    """Run an optional lane's set-up script (scripts/setup-vllm, scripts/setup-xla: quick when its venv
    is current). When it fails (no network, say) the lane's tests skip with the reason, except under
    CI, where they fail: a lane never skips silently there."""
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def unavailable(reason: str) -> None:
        msg = f"{what} need the venv at {venv}, which could not be built: {reason}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)

    try:
        r = subprocess.run(
            [os.path.join(repo, "scripts", script)],
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
            env={**os.environ, venv_var: venv},
        )
    except subprocess.TimeoutExpired:
        unavailable(f"scripts/{script} ran for more than 30 min")
    if r.returncode != 0:
        unavailable(f"scripts/{script} exited {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as an HF directory (converted once from the shipped GGUF)."""
    from axonserve.neuron.model_source import resolve_model

    return resolve_model(None)


# 2 layers, hidden 64, 4 query / 2 KV heads: every tiny test decoder's shape
TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def copy_tokenizer(tokenizer_dir: str, out_dir: str) -> None:
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.exists(src) and name != "generation_config.json":
            shutil.copy(src, os.path.join(out_dir, name))


def make_tiny_llama(out_dir: str, tokenizer_dir: str, seed: int = 0, **overrides) -> str:
    """Random-weight Llama with GQA (transformers' own init), saved as safetensors next to a
    copy of the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {**TINY_DECODER, "vocab_size": 49152, "max_position_embeddings": 2048, **overrides}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), smollm2_dir)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the same GGUF: the independent reference (slow: ~40 s, once)."""
    from transformers import AutoTokenizer

    from axonserve.neuron.model_source import builtin_smollm2_gguf

    path = builtin_smollm2_gguf()
    d, f = os.path.dirname(path), os.path.basename(path)
    return transformers_gguf_model(path), AutoTokenizer.from_pretrained(d, gguf_file=f)


def transformers_gguf_model(path: str):
    """transformers' own GGUF reading (config, dequantization, Q/K un-permute) into its Llama.

    Same code path as `from_pretrained(..., gguf_file=...)`, minus that entry point's
    dependency on `accelerate`, which this project does not need otherwise.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """transformers `generate`, greedy, exactly n new tokens (EOS masked like min_tokens=n)."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


# architecture -> (transformers config class, config fields that make it interesting when tiny)
TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "MistralForCausalLM": ("MistralConfig", {"sliding_window": None}),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "Qwen3ForCausalLM": ("Qwen3Config", {}),
    # layer 0 sparse (8 experts, top-2), layer 1 dense: both block kinds in 2 layers
    "Qwen3MoeForCausalLM": (
        "Qwen3MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
}


def make_tiny_model(out_dir: str, arch: str, tokenizer_dir: str | None = None, seed: int = 0, **overrides) -> str:
    """Random-weight decoder of architecture `arch` (2 layers, hidden 64, 4 query / 2 KV heads).

    Matrices are N(0, 0.1) so logits are well apart (few greedy near-ties); norm weights
    U(0.5, 1.5) and biases N(0, 0.1), because transformers' ones and zeros would hide a norm or
    bias that is not loaded. With `tokenizer_dir` the model gets its vocab (49152) and tokenizer."""
    import torch
    import transformers

    config_cls, extra = TINY_ARCHS[arch]
    cfg = {**TINY_DECODER, "vocab_size": 49152 if tokenizer_dir else 1024, "max_position_embeddings": 512, **extra}
    cfg.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**cfg)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Chi-square quantile by Wilson–Hilferty (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(observed: Counter, probs: dict[int, float], n: int) -> tuple[float, int]:
    """Statistic and degrees of freedom, with cells of expectation < 5 pooled."""
    cells, rest_o, rest_e = [], 0, 0.0
    for tok, p in probs.items():
        if n * p >= 5:
            cells.append((observed.get(tok, 0), n * p))
        else:
            rest_o, rest_e = rest_o + observed.get(tok, 0), rest_e + n * p
    rest_o += sum(c for t, c in observed.items() if t not in probs)
    if rest_e > 0:
        cells.append((rest_o, rest_e))
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


# --------------------------------------------------------------------------- vision-language

IMAGE_SIZE, PATCH = 32, 8  # 16 patches per image: 16 image tokens ("default" drops CLS)


def make_tiny_llava(out_dir: str, tokenizer_dir: str, seed: int = 0) -> str:
    """Random-weight LLaVA (CLIP 2 layers, hidden 32 -> projector -> the tiny Llama decoder) with
    a LlavaProcessor: the tokenizer plus an `<image>` token and a 32-pixel CLIPImageProcessor."""
    from axonserve.bench.mm_ttft import make_random_llava

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
    )
    return make_random_llava(out_dir, tokenizer_dir, vision, {**TINY_DECODER, "max_position_embeddings": 512}, seed)


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory, smollm2_dir) -> str:
    return make_tiny_llava(str(tmp_path_factory.mktemp("tiny-llava")), smollm2_dir)


def png_bytes(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    """A random RGB PNG (resized and cropped to 32x32 by the processor)."""
    from axonserve.bench.mm_ttft import png_bytes as png

    return png(seed, size)


def data_url(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def hf_llava_greedy(model_dir: str, text: str, images: list[bytes], n: int) -> tuple[list[int], list[int]]:
    """(prompt ids, n greedy tokens) from transformers' LlavaProcessor + LlavaForConditionalGeneration
    for a rendered prompt `text` holding one `<image>` per image."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model_dir)
    pil = [Image.open(io.BytesIO(b)) for b in images]
    enc = proc(text=text, images=pil or None, return_tensors="pt", add_special_tokens=False)
    model = _hf_llava(model_dir)
    with torch.inference_mode():
        out = model.generate(**enc, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    ids = enc["input_ids"][0].tolist()
    return ids, out[0, len(ids) :].tolist()


@functools.lru_cache(maxsize=2)
def _hf_llava(model_dir: str):
    import torch
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
