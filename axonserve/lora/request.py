"""vLLM's offline `LoRARequest` (same field names), turned into the wire's `LoraSpec`."""

from __future__ import annotations

from dataclasses import dataclass

from axonserve.protocol.messages import LoraSpec


@dataclass(frozen=True)
class LoRARequest:
    """Run a prompt with the PEFT LoRA adapter at `lora_path`; `lora_int_id` (>= 1) names it:
    requests with the same id and path share its slot and its prefix cache."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def spec(self) -> LoraSpec:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        return LoraSpec(self.lora_name, self.lora_int_id, self.lora_path)
