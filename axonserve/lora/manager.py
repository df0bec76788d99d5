"""A worker rank's adapters: slots on the model's layers, an LRU of slots, a host-memory LRU.

Each rank holds `max_loras` slots per LoRA-carrying layer (layers.py). An adapter is loaded the
first time a step needs it (a request's `LoraSpec`): from the host-memory LRU of up to
`max_cpu_loras` adapters (0: `max_loras`) if it is there, else read from its PEFT directory,
validated again here (the rank never trusts the path), mapped onto our fused layers (q/k/v onto
qkv_proj, gate/up onto gate_up_proj, each sub-projection with its own A and B), sharded like the
base layer and scaled once. The scheduler guarantees at most `max_loras` adapters per step; the
slot LRU evicts the least recently used adapter that the step does not need.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import structlog
import torch

from axonserve.lora.adapter import _TENSOR_RE, WEIGHTS_NAME, read_adapter_config
from axonserve.lora.layers import LoraBatch, LoraSlots
from axonserve.neuron.config import ModelConfig
from axonserve.neuron.parallel import TPInfo, tp_min

log = structlog.get_logger()

# checkpoint module -> our fused layer (the attribute path under a decoder layer)
FUSED = {
    "q_proj": "self_attn.qkv_proj",
    "k_proj": "self_attn.qkv_proj",
    "v_proj": "self_attn.qkv_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_up_proj",
    "up_proj": "mlp.gate_up_proj",
    "down_proj": "mlp.down_proj",
}
Key = tuple[int, str]  # (lora_id, path)


def _key(spec: Any) -> Key:
    return (spec.lora_id, spec.path)


# per decoder layer: fused layer path -> module -> (A shard, scaled B shard)
Weights = list[dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]]


def _slots_for(layer: torch.nn.Module, path: str, batch: LoraBatch, max_loras: int, max_rank: int, dtype) -> LoraSlots:
    from axonserve.neuron.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    lin = layer.get_submodule(path)
    rank = TPInfo.rank
    if isinstance(lin, QKVParallelLinear):
        q, kv = lin.num_heads * lin.head_dim, lin.num_kv_heads * lin.head_dim
        kv0 = (rank // lin.kv_replicas) * kv
        subs = [("q_proj", 0, q, rank * q), ("k_proj", q, kv, kv0), ("v_proj", q + kv, kv, kv0)]
        return LoraSlots(batch, lin.in_features, lin.out_features, subs, max_loras, max_rank, dtype)
    if isinstance(lin, MergedColumnParallelLinear):
        size = lin.out_sizes[0] // TPInfo.size
        subs = [("gate_proj", 0, size, rank * size), ("up_proj", size, size, rank * size)]
        return LoraSlots(batch, lin.in_features, lin.out_features, subs, max_loras, max_rank, dtype)
    if isinstance(lin, RowParallelLinear):
        name = path.rsplit(".", 1)[-1]
        subs = [(name, 0, lin.out_features, 0)]
        return LoraSlots(batch, lin.in_features, lin.out_features, subs, max_loras, max_rank, dtype, True)
    raise ValueError(f"LoRA cannot attach to {type(lin).__name__} at {path}")


class LoraManager:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        dtype: torch.dtype,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
    ):
        from axonserve.neuron.models.llama import LlamaForCausalLM, LlamaMLP

        if not isinstance(model, LlamaForCausalLM) or getattr(model, "is_multimodal", False):
            raise ValueError(f"LoRA adapters are supported on Llama-family text models, not {type(model).__name__}")
        layers = model.model.layers
        if not all(isinstance(layer.mlp, LlamaMLP) for layer in layers):
            raise ValueError("LoRA adapters are not supported on mixture-of-experts models")
        self.model_config, self.dtype = model_config, dtype
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu = max_cpu_loras or max_loras
        self.batch = LoraBatch()
        paths = sorted(set(FUSED.values()))
        self.layers: list[dict[str, LoraSlots]] = []
        for layer in layers:
            slots = {p: _slots_for(layer, p, self.batch, max_loras, max_rank, dtype) for p in paths}
            for p, s in slots.items():
                layer.get_submodule(p).lora = s
            self.layers.append(slots)
        model.model.has_lora = True  # the fused native stack cannot carry LoRA (models/fused.py)
        self.slots: OrderedDict[Key, int] = OrderedDict()  # loaded adapter -> slot, least recent first
        self.cpu: OrderedDict[Key, Weights] = OrderedDict()  # host-memory LRU, least recent first
        self.num_disk_loads = 0

    # ------------------------------------------------------------------ per step

    def load(self, states: list[Any]) -> dict[str, str]:
        """Put every adapter the step's requests (states with `.lora`) need into a slot. Returns
        request id -> error for requests whose adapter cannot be loaded (they are left out of the
        step and end with that error); every rank agrees on it, so all run the same batch."""
        keys = {_key(st.lora) for st in states if st.lora is not None and st.lora_error is None}
        if len(keys) > self.max_loras:
            raise RuntimeError(f"a step needs {len(keys)} adapters but max_loras is {self.max_loras}")
        bad: dict[Key, str] = {}
        for st in states:
            if st.lora is None or st.lora_error is not None:
                continue
            k = _key(st.lora)
            if k in self.slots:
                self.slots.move_to_end(k)
            elif k not in bad:
                err = self._fill_slot(k, keys)
                if err is not None:
                    bad[k] = err
            st.lora_error = bad.get(k)
        return {st.request_id: st.lora_error for st in states if st.lora_error is not None}

    def map_rows(self, work: list[tuple[Any, int]]) -> None:
        """Map the step's token rows (requests in row order, tokens each) onto their slots."""
        self.batch.set_rows(
            [self.slots[_key(st.lora)] if st.lora is not None else -1 for st, _ in work], [n for _, n in work]
        )

    def row_order(self, item: tuple[Any, int]) -> int:
        """Sort key that puts one adapter's rows side by side (the runner's decodes): its slot."""
        st = item[0]
        return -1 if st.lora is None else self.slots[_key(st.lora)]

    def _fill_slot(self, key: Key, needed: set[Key]) -> str | None:
        """Load `key` into a free slot or the least recently used one this step does not need;
        the reason it cannot be loaded (on this rank or another), or None."""
        err = None
        try:
            weights = self._weights(key)
        except Exception as e:  # noqa: BLE001 - a hostile or changed adapter must not take the rank down
            err = str(e) if isinstance(e, ValueError) else f"the adapter could not be loaded: {type(e).__name__}"
            log.warning("lora.load_failed", lora_id=key[0], path=key[1], error=repr(e))
        if tp_min(0 if err else 1) == 0:  # (ranks load in the same order: this pairs up)
            return err or "the adapter could not be loaded on another tensor-parallel rank"
        used = set(self.slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(k for k in self.slots if k not in needed)  # (len(needed) <= max_loras)
            slot = self.slots.pop(victim)
        for layer, slots in zip(weights, self.layers):
            for path, s in slots.items():
                s.load(slot, layer.get(path, {}))
        self.slots[key] = slot
        log.info("lora.slot_loaded", lora_id=key[0], slot=slot)
        return None

    def _weights(self, key: Key) -> Weights:
        if key in self.cpu:
            self.cpu.move_to_end(key)
            return self.cpu[key]
        w = self._read(key[1])
        self.num_disk_loads += 1
        self.cpu[key] = w
        while len(self.cpu) > self.max_cpu:
            self.cpu.popitem(last=False)
        return w

    def _read(self, path: str) -> Weights:
        """An adapter's tensors, mapped, sharded and scaled for this rank's slots."""
        from safetensors import safe_open

        cfg = read_adapter_config(path, self.max_rank, self.model_config)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        with safe_open(os.path.join(path, WEIGHTS_NAME), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                m = _TENSOR_RE.match(name)
                assert m is not None  # (read_adapter_config checked every name)
                pairs.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = f.get_tensor(name)
        out: Weights = [{} for _ in self.layers]
        for (i, module), ab in pairs.items():
            path_ = FUSED[module]
            a = ab["A"].to(self.dtype)
            b = (ab["B"].float() * cfg.scaling).to(self.dtype)
            out[i].setdefault(path_, {})[module] = self.layers[i][path_].shard(module, a, b)
        log.info("lora.adapter_read", path=path, rank=cfg.rank, modules=list(cfg.target_modules))
        return out
