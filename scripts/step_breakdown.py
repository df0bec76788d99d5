#!/usr/bin/env python
"""Where one model step goes, op by op, with the weights and KV coming from DRAM.

Decode (default): B sequences of `--context` tokens each decode one token; prefill
(`--prefill N`): one N-token prompt, in chunks of `--chunk`, or `--prompts B` of them in one plan
(a wave of requests, as `bench serve`'s first step at B streams; the LM head over their last rows).
Before each step a buffer of 4x the L3 is written, so the step starts with a cold cache, as a busy
neighbour leaves it. Each op kind is timed with module hooks on the per-layer path (the fused C++
decoder stack runs the same
kernels in one call; its step time is printed beside for comparison), plus the LM head over the
rows sampling needs and the greedy argmax. Medians over `--steps` steps, each a fresh cold step.

    PYTHONPATH=. python scripts/step_breakdown.py --batch 32 --context 128 --dtype float32
    PYTHONPATH=. python scripts/step_breakdown.py --prefill 1024 --dtype float32
    PYTHONPATH=. python scripts/step_breakdown.py --prefill 64 --prompts 32 --dtype bfloat16

The engine's own parts (scheduler, bus, detokenization) are `axonserve bench step`'s per-process
CPU columns; docs/benchmarks.md#fig-step-breakdown puts both side by side.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import statistics
import time

import torch

from axonserve.bench.repeat import l3_bytes
from axonserve.neuron.config import ModelConfig
from axonserve.neuron.loader import load_model
from axonserve.neuron.model_source import resolve_model
from axonserve.neuron.ops import native
from axonserve.neuron.ops.attention import AttentionMetadata, takes_chunks
from axonserve.neuron.sampler import greedy_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LEAVES = {  # module name suffix -> op kind (timed on their own)
    "qkv_proj": "qkv_proj matmul",
    "o_proj": "o_proj matmul",
    "gate_up_proj": "gate_up_proj matmul",
    "down_proj": "down_proj matmul",
    "input_layernorm": "RMSNorm (2 per layer + final)",
    "post_attention_layernorm": "RMSNorm (2 per layer + final)",
    "model.norm": "RMSNorm (2 per layer + final)",
    "embed_tokens": "embedding",
}
SCOPES = {"self_attn": "rotary + KV write + attention", "mlp": "SiLU x up"}  # minus their matmuls


class OpTimer:
    """Forward hooks that add each module's wall time to its op kind for the current step."""

    def __init__(self, model: torch.nn.Module):
        self.step: collections.Counter[str] = collections.Counter()
        self.starts: dict[int, float] = {}
        for name, mod in model.named_modules():
            kind = next((k for s, k in LEAVES.items() if name.endswith(s)), None)
            scope = next((k for s, k in SCOPES.items() if name.endswith(s)), None)
            if kind or scope:
                mod.register_forward_pre_hook(self._pre)
                mod.register_forward_hook(self._post(kind or f"scope:{scope}"))

    def _pre(self, mod, args):
        self.starts[id(mod)] = time.perf_counter()

    def _post(self, kind: str):
        def hook(mod, args, out):
            self.step[kind] += time.perf_counter() - self.starts.pop(id(mod))

        return hook

    def take(self) -> dict[str, float]:
        s, self.step = self.step, collections.Counter()
        out = {k: v for k, v in s.items() if not k.startswith("scope:")}
        attn = s["scope:rotary + KV write + attention"] - s["qkv_proj matmul"] - s["o_proj matmul"]
        mlp = s["scope:SiLU x up"] - s["gate_up_proj matmul"] - s["down_proj matmul"]
        out["rotary + KV write + attention"], out["SiLU x up"] = attn, mlp
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model spec (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=128, help="decode: tokens already in each sequence's cache")
    p.add_argument("--prefill", type=int, default=0, help="prefill one prompt of this many tokens instead")
    p.add_argument("--chunk", type=int, default=0, help="prefill chunk (default: the whole prompt)")
    p.add_argument("--prompts", type=int, default=1, help="prefill: this many prompts in one plan (no --chunk)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--activation-quantization", default="", choices=["", "int8"], help="as `serve`'s flag")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dt = DTYPES[a.dtype]
    mc = ModelConfig.from_dir(resolve_model(a.model))
    model = load_model(mc, dt, progress=False, activation_quantization=a.activation_quantization)
    kernels = native.for_dtype(dt)
    bs = 16
    if a.prefill:
        chunk = a.chunk or a.prefill
        seqs, per_seq = a.prompts, a.prefill // bs + 2
        if a.prompts > 1:
            if a.chunk:
                p.error("--prompts runs each prompt whole: leave --chunk out")
            calls = [([a.prefill] * a.prompts, [0] * a.prompts)]
            label = f"prefill of {a.prompts} prompts of {a.prefill} tokens (one plan)"
        else:
            calls = [([n], [s]) for s in range(0, a.prefill, chunk) for n in [min(chunk, a.prefill - s)]]
            label = f"prefill of {a.prefill} tokens (chunks of {chunk})"
    else:
        seqs, per_seq = a.batch, (a.context + 1) // bs + 1
        calls = [([1] * a.batch, [a.context] * a.batch)]
        label = f"decode step, batch {a.batch}, context {a.context}"
    shape = (seqs * per_seq, bs, mc.num_kv_heads, mc.head_dim)
    caches = [(torch.randn(shape).to(dt), torch.randn(shape).to(dt)) for _ in range(mc.num_layers)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    chunks = takes_chunks(kernels, dt, dt, mc.head_dim, mc.sliding_window is not None)  # as the runner decides
    metas = [AttentionMetadata.build(q, c, tables, bs, native=kernels, native_chunks=chunks) for q, c in calls]
    ids = torch.randint(0, mc.vocab_size, (sum(metas[0].positions.shape),))
    flush = torch.zeros(4 * l3_bytes(), dtype=torch.uint8)
    last = torch.tensor(list(itertools.accumulate(calls[-1][0]))) - 1  # each sequence's last row

    def step(times: OpTimer | None) -> tuple[float, dict[str, float]]:
        flush.add_(1)  # the L3 now holds this buffer, not the weights
        t0 = time.perf_counter()
        for (q, _), meta in zip(calls, metas):
            n = sum(q)
            h = model(ids[:n], meta.positions, caches, meta)
        t1 = time.perf_counter()
        logits = model.compute_logits(h[last])
        t2 = time.perf_counter()
        greedy_ids(logits)
        t3 = time.perf_counter()
        ops = times.take() if times else {}
        ops.update({"LM head (rows sampled)": t2 - t1, "greedy argmax": t3 - t2})
        return t3 - t0, ops | {"forward": t1 - t0}

    with torch.inference_mode():
        for _ in range(3):  # the first steps after a load page the weights in
            step(None)
        fused = [step(None)[0] for _ in range(a.steps)]  # the serving path (fused stack where it applies)
        os.environ["AXONSERVE_FUSED"] = "0"
        timer = OpTimer(model)
        step(timer)
        runs = [step(timer) for _ in range(a.steps)]
    total = statistics.median(t for t, _ in runs)
    kinds = sorted({k for _, ops in runs for k in ops if k != "forward"}, key=lambda k: -runs[0][1][k])
    med = {k: statistics.median(ops.get(k, 0.0) for _, ops in runs) for k in kinds}
    other = statistics.median(ops["forward"] for _, ops in runs) - sum(
        v for k, v in med.items() if k not in ("LM head (rows sampled)", "greedy argmax")
    )
    print(f"## {label}, {mc.architecture} {a.dtype}, {a.threads} threads, cold L3 ({l3_bytes() >> 20} MiB) each step")
    print(
        f"serving path (fused stack where it applies): {statistics.median(fused) * 1e3:.2f} ms "
        f"[{min(fused) * 1e3:.2f}, {max(fused) * 1e3:.2f}]; per-layer path below: {total * 1e3:.2f} ms"
    )
    print("| op | ms per step | share |")
    print("|---|---|---|")
    for k in kinds:
        print(f"| {k} | {med[k] * 1e3:.2f} | {med[k] / total:.1%} |")
    print(f"| residual adds, views, the rest | {other * 1e3:.2f} | {other / total:.1%} |")


if __name__ == "__main__":
    main()
