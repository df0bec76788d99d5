"""Random PEFT LoRA adapters on a base model directory, and transformers' merged reference."""

from __future__ import annotations

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: str, out_dir: str, r: int = 8, targets=ALL, seed: int = 0, alpha: int = 16, std: float = 0.05
) -> str:
    """A PEFT LoRA with random A and B (init_lora_weights=False: B is not zero, so outputs move),
    saved as safetensors. A and B are redrawn N(0, std) so the adapter shifts the logits clearly
    without swamping the base model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    model.save_pretrained(out_dir)
    return out_dir


def merged_model(base_dir: str, adapter_dir: str | None):
    """transformers' model with the adapter merged into its weights (None: the base model)."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return base
    from peft import PeftModel

    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()
