"""FP8 end to end (layers/fp8.py): `--quantization fp8`, `--kv-cache-dtype fp8_e4m3|fp8_e5m2` and a
checkpoint already in FP8 (made here the way vLLM's FP8 format / llm-compressor write one), served by
the real scheduler and worker processes (the offline LLM) and over HTTP (`axonserve serve`), in the
top-1 sense the int8 tests use; and the settings it refuses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from frontends.server import REPO, serve
from safetensors import safe_open
from safetensors.torch import save_file

from axonserve.config import EngineConfig
from axonserve.frontends.offline import LLM
from axonserve.protocol.messages import SamplingParams

PROMPTS = [[5, 6, 7], [8, 9], list(range(10, 50))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tokens(model_dir: str, **kw) -> list[list[int]]:
    config = EngineConfig(model=model_dir, num_kv_blocks=64, log_level="warning", **kw)
    with LLM(config=config) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


PER_TENSOR = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def make_fp8_checkpoint(src: str, dst: str, static: bool = True, per_tensor: tuple[str, ...] = PER_TENSOR) -> str:
    """`src` with its linear weights in float8_e4m3fn: by default q/k/v and gate/up with per-tensor
    scales of their own (vLLM's FP8 format; each fused projection then holds rows of several
    scales), the others per output channel ([N, 1], llm-compressor's channel scheme), static
    `input_scale`s; embeddings, norms and the LM head stay as they were (the formats' `ignore`)."""
    shutil.copytree(src, dst)
    out = {}
    for f in [f for f in os.listdir(src) if f.endswith(".safetensors")]:
        with safe_open(os.path.join(src, f), framework="pt") as h:
            for name in h.keys():
                t = h.get_tensor(name)
                if not name.endswith("_proj.weight"):
                    out[name] = t
                    continue
                w = t.float()
                base = name[: -len(".weight")]
                if base.rpartition(".")[2] in per_tensor:
                    s = (w.abs().amax() / 448).clamp_min(1e-12)
                else:
                    s = (w.abs().amax(1, keepdim=True) / 448).clamp_min(1e-12)
                out[name] = (w / s).clamp(-448, 448).to(torch.float8_e4m3fn)
                out[base + ".weight_scale"] = s.float()
                if static:
                    out[base + ".input_scale"] = torch.tensor(0.05)
        os.unlink(os.path.join(dst, f))
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "static" if static else "dynamic",
        "weight_block_size": None,
    }
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return dst


@pytest.fixture(scope="module")
def fp8_dir(tiny_llama_dir, tmp_path_factory) -> str:
    return make_fp8_checkpoint(tiny_llama_dir, str(tmp_path_factory.mktemp("fp8") / "tiny-llama-fp8"))


@pytest.fixture(scope="module")
def bf16_tokens(tiny_llama_dir) -> list[list[int]]:
    return _tokens(tiny_llama_dir, dtype="bfloat16")


def test_fp8_weights_served_through_the_engine(tiny_llama_dir, bf16_tokens):
    """-q fp8: requests run to their full length and greedy output starts as bf16's does."""
    got = _tokens(tiny_llama_dir, dtype="bfloat16", quantization="fp8")
    assert [len(t) for t in got] == [12, 12, 12]
    assert [t[0] for t in got] == [t[0] for t in bf16_tokens]


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_served_through_the_engine(tiny_llama_dir, bf16_tokens, kv):
    """--kv-cache-dtype fp8_*: full length, and greedy output starts as the bf16 cache's does (the
    first token reads the unquantized prompt K/V; later ones read FP8 codes)."""
    got = _tokens(tiny_llama_dir, dtype="bfloat16", kv_cache_dtype=kv)
    assert [len(t) for t in got] == [12, 12, 12]
    assert [t[0] for t in got] == [t[0] for t in bf16_tokens]


def test_fp8_checkpoint_served_over_http(fp8_dir, bf16_tokens):
    """A pre-quantized FP8 checkpoint implies -q fp8 (here with an FP8 KV cache on top): greedy
    output starts as the original bf16 model's, and HTTP serves the engine's very text (for the same
    batches: a batch's size picks the matmul path, whose roundings differ)."""
    config = EngineConfig(model=fp8_dir, num_kv_blocks=64, log_level="warning", dtype="bfloat16", kv_cache_dtype="fp8")
    assert config.quantization == "fp8"
    with LLM(config=config) as llm:  # one request at a time, as the HTTP client below sends them
        outs = [llm.generate([p], GREEDY)[0].outputs[0] for p in PROMPTS]
    assert [len(o.token_ids) for o in outs] == [12, 12, 12]
    assert [o.token_ids[0] for o in outs] == [t[0] for t in bf16_tokens]
    with serve(fp8_dir, "--dtype", "bfloat16", "--num-kv-blocks", "64", "--kv-cache-dtype", "fp8") as srv:
        for prompt, want in zip(PROMPTS, outs):
            body = {"model": fp8_dir, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 12
            assert r.json()["choices"][0]["text"] == want.text


def test_fp8_checkpoint_codes_come_back(tiny_llama_dir, fp8_dir, tmp_path):
    """Loading dequantizes the checkpoint's codes and quantizes each fused row again: with per-channel
    scales of max|w| / 448 (llm-compressor's) the codes are -q fp8's on the original weights, bit for
    bit, and the scales within a float32 rounding; with per-tensor scales (q/k/v, gate/up in
    `fp8_dir`) each weight is within two roundings (the checkpoint's and ours) of the original."""
    from axonserve.neuron.config import ModelConfig
    from axonserve.neuron.loader import load_model

    channel_dir = make_fp8_checkpoint(tiny_llama_dir, str(tmp_path / "channel"), per_tensor=())

    def qweights(path: str, quantization: str = "") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        model = load_model(ModelConfig.from_dir(path), torch.float32, progress=False, quantization=quantization)
        return {
            n: (m.qweight.data, m.qweight.scales)
            for n, m in model.named_modules()
            if getattr(m, "qweight", None) is not None
        }

    want = qweights(tiny_llama_dir, "fp8")
    for name, (codes, scales) in qweights(channel_dir).items():
        assert torch.equal(codes.view(torch.uint8), want[name][0].view(torch.uint8)), name
        torch.testing.assert_close(scales, want[name][1], rtol=2e-7, atol=0)
    dense = load_model(ModelConfig.from_dir(tiny_llama_dir), torch.float32, progress=False, pack=False)
    for name, (codes, scales) in qweights(fp8_dir).items():
        w = dense.get_submodule(name).weight.detach()
        s_tensor = w.abs().amax() / 448  # at least each part's own per-tensor scale
        bound = w.abs() * 2.0**-3 * 1.01 + (s_tensor + scales[:, None]) * 2.0**-10  # two half-steps
        assert ((codes.float() * scales[:, None] - w).abs() <= bound).all(), name


def test_fp8_settings_are_checked(tiny_llama_dir, fp8_dir, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp9' is not supported"):
        EngineConfig(model="m", dtype="bfloat16", kv_cache_dtype="fp9")
    for kv in ("fp8", "fp8_e5m2"):
        with pytest.raises(ValueError, match=f"an {kv} KV cache is not supported with bucketing"):
            EngineConfig(model="m", dtype="bfloat16", kv_cache_dtype=kv, role="prefill")
    with pytest.raises(ValueError, match="quantization int8 does not apply to an FP8 checkpoint"):
        EngineConfig(model=fp8_dir, dtype="bfloat16", quantization="int8")
    assert EngineConfig(model=fp8_dir, dtype="bfloat16").quantization == "fp8"
    other = tmp_path / "gptq"
    shutil.copytree(tiny_llama_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    for qcfg, match in (
        ({"quant_method": "gptq", "bits": 4}, "quantized with 'gptq', which is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be null or"),
    ):
        (other / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
        with pytest.raises(ValueError, match=match):
            EngineConfig(model=str(other), dtype="bfloat16")
    # the CLI: a junk dtype is a usage error, an FP8 checkpoint with another method a clear one
    for args, msg in (
        (["--kv-cache-dtype", "fp9"], "invalid choice: 'fp9'"),
        (["-q", "int4"], "does not apply to an FP8 checkpoint"),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "axonserve.cli", "serve", fp8_dir, *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode != 0 and msg in p.stderr + p.stdout, p.stderr[-2000:]
