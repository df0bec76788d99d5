"""read_adapter_config treats a PEFT directory as hostile input: every refusal is a LoraError with
a reason a user can act on, reading only the small config and the safetensors header; and the
LoRA settings of EngineConfig are checked at start-up."""

from __future__ import annotations

import json
import os
import struct

import pytest

from axonserve.config import EngineConfig
from axonserve.lora.adapter import LoraError, lora_key, read_adapter_config
from axonserve.lora.request import LoRARequest
from axonserve.neuron.config import ModelConfig
from axonserve.protocol.messages import LoraSpec
from lora.lora_helpers import make_adapter


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir, tmp_path_factory) -> str:
    return make_adapter(tiny_llama_dir, str(tmp_path_factory.mktemp("lora-a")), r=8, seed=1)


def clone(src: str, dst: str, cfg_update: dict | None = None, drop: tuple[str, ...] = ()) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if name in drop:
            continue
        with open(os.path.join(src, name), "rb") as f:
            data = f.read()
        if name == "adapter_config.json" and cfg_update is not None:
            cfg = json.loads(data)
            for k, v in cfg_update.items():
                if v is None:
                    cfg.pop(k, None)
                else:
                    cfg[k] = v
            data = json.dumps(cfg).encode()
        with open(os.path.join(dst, name), "wb") as f:
            f.write(data)
    return dst


def write_safetensors_header(path: str, header: dict, n_bytes: int | None = None) -> None:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if n_bytes is None else n_bytes))
        f.write(raw)
        f.write(b"\0" * 64)


def test_valid_adapter(adapter, tiny_llama_dir):
    cfg = read_adapter_config(adapter, 16, ModelConfig.from_dir(tiny_llama_dir))
    assert cfg.rank == 8 and cfg.alpha == 16 and cfg.scaling == 2.0
    assert cfg.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert read_adapter_config(adapter, 8).rank == 8  # without a model: no shape check


def test_rslora_scaling(adapter, tmp_path):
    d = clone(adapter, str(tmp_path / "rs"), {"use_rslora": True})
    assert read_adapter_config(d, 8).scaling == pytest.approx(16 / 8**0.5)


@pytest.mark.parametrize(
    "update, match",
    [
        ({"r": 64}, "--max-lora-rank 16"),
        ({"r": 0}, "positive integer"),
        ({"r": "8"}, "positive integer"),
        ({"peft_type": "PREFIX_TUNING"}, "only LORA"),
        ({"target_modules": ["q_proj", "lm_head"]}, "not supported"),
        ({"target_modules": ["embed_tokens"]}, "not supported"),
        ({"target_modules": ".*proj"}, "regex"),
        ({"target_modules": []}, "non-empty"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"layers_pattern": "layers"}, "layers_pattern"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"lora_alpha": "x"}, "lora_alpha"),
        ({"target_modules": ["q_proj"]}, "not in target_modules"),  # the file holds more than declared
    ],
)
def test_config_refusals(adapter, tmp_path, update, match):
    d = clone(adapter, str(tmp_path / "bad"), update)
    with pytest.raises(LoraError, match=match):
        read_adapter_config(d, 16)


def test_missing_files_and_pickle(adapter, tmp_path):
    with pytest.raises(LoraError, match="not a directory"):
        read_adapter_config(str(tmp_path / "nowhere"), 16)
    d = clone(adapter, str(tmp_path / "nocfg"), drop=("adapter_config.json",))
    with pytest.raises(LoraError, match="adapter_config.json not found"):
        read_adapter_config(d, 16)
    d = clone(adapter, str(tmp_path / "nost"), drop=("adapter_model.safetensors",))
    with pytest.raises(LoraError, match="adapter_model.safetensors not found"):
        read_adapter_config(d, 16)
    with open(os.path.join(d, "adapter_model.bin"), "wb") as f:
        f.write(b"\x80\x04junk")
    with pytest.raises(LoraError, match="pickle"):
        read_adapter_config(d, 16)
    with pytest.raises(LoraError, match="non-empty string"):
        read_adapter_config("", 16)


@pytest.mark.parametrize(
    "junk", [b"{not json", b"[1, 2]", b"\xff\xfe", b"x" * (1 << 20 + 1), b"[" * 200_000 + b"]" * 200_000]
)
def test_junk_config(adapter, tmp_path, junk):
    d = clone(adapter, str(tmp_path / "junk"))
    with open(os.path.join(d, "adapter_config.json"), "wb") as f:
        f.write(junk)
    with pytest.raises(LoraError):
        read_adapter_config(d, 16)


def test_wrong_shapes_for_the_model(adapter, tmp_path, tiny_llama_dir):
    import dataclasses

    model = ModelConfig.from_dir(tiny_llama_dir)
    wider = dataclasses.replace(model, hidden_size=model.hidden_size * 2)
    with pytest.raises(LoraError, match="the base model needs"):
        read_adapter_config(adapter, 16, wider)
    fewer = dataclasses.replace(model, num_layers=1)
    with pytest.raises(LoraError, match="names layer 1"):
        read_adapter_config(adapter, 16, fewer)


def test_junk_safetensors(adapter, tmp_path):
    d = clone(adapter, str(tmp_path / "st"))
    st = os.path.join(d, "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = [
        (b"", "truncated"),
        (struct.pack("<Q", 1 << 40), "invalid header length"),
        (struct.pack("<Q", 100) + b"{}", "truncated"),
        (struct.pack("<Q", 5) + b"nope!", "malformed"),
    ]
    for data, match in cases:
        with open(st, "wb") as f:
            f.write(data)
        with pytest.raises(LoraError, match=match):
            read_adapter_config(d, 16)
    bad_headers = [
        ({"evil.weight": {"dtype": "F32", "shape": [8, 64], "data_offsets": [0, 4]}}, "unsupported tensor"),
        ({name: {"dtype": "I64", "shape": [8, 64], "data_offsets": [0, 4]}}, "dtype"),
        ({name: {"dtype": "F32", "shape": [8], "data_offsets": [0, 4]}}, "not a matrix"),
        ({name: {"dtype": "F32", "shape": [8, 64], "data_offsets": [0, 10**9]}}, "offsets"),
        ({name: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 4]}}, "r=8"),
        ({name: {"dtype": "F32", "shape": [8, 64], "data_offsets": [0, 4]}}, "no matching lora_B"),
        ({"__metadata__": {}}, "no LoRA tensors"),
    ]
    for header, match in bad_headers:
        write_safetensors_header(st, header)
        with pytest.raises(LoraError, match=match):
            read_adapter_config(d, 16)


def test_lora_key_separates_adapters():
    a, b = LoraSpec("a", 1, "/x"), LoraSpec("b", 2, "/x")
    assert lora_key(a) != lora_key(b) and lora_key(a) == lora_key(LoraSpec("a", 1, "/x"))


def test_lora_request_spec():
    assert LoRARequest("a", 3, "/p").spec() == LoraSpec("a", 3, "/p")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/p").spec()
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/p").spec()


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"max_loras": 0}, "max_loras"),
        ({"max_lora_rank": 7}, "max_lora_rank"),
        ({"max_cpu_loras": -1}, "max_cpu_loras"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
        ({"bucketing": True}, "bucketing"),
        ({"quantization": "int8"}, "quantization"),
        ({"role": "decode"}, "disaggregation"),
        ({"enable_expert_parallel": True}, "expert parallelism"),
        ({"speculative": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
    ],
)
def test_engine_config_refusals(tiny_llama_dir, kw, match):
    from axonserve.config import SpeculativeConfig

    if "speculative" in kw:
        kw = {**kw, "speculative": SpeculativeConfig(**kw["speculative"])}
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=tiny_llama_dir, enable_lora=True, **kw)


def test_engine_config_lora_off_refuses_lora_settings(tiny_llama_dir):
    with pytest.raises(ValueError, match="--enable-lora"):
        EngineConfig(model=tiny_llama_dir, lora_modules=["a=/x"])
    EngineConfig(model=tiny_llama_dir, enable_lora=True, max_loras=4, max_lora_rank=8, max_cpu_loras=8)
