"""`axonserve bench step`: what the engine costs per step besides the model.

The real scheduler, worker ranks, bus and client serve a null model (`AxonNullForCausalLM`:
zeros in, zeros out, a 512-token vocabulary), so a step's wall time is scheduling, plan
encode + broadcast to every rank, the worker's bookkeeping and attention metadata, sampling,
the result's return and the client's output handling. B requests decode together for T
tokens; µs per step = elapsed / model forwards, from the scheduler's own counter. Beside the
wall time, each process's CPU time per step (Linux /proc: user + system, every thread) says
where the step's work goes: on a box with fewer cores than busy processes the wall time is
the CPU total over the cores, not the critical path. With
`--num-workers N` it is also the per-step cost of broadcasting the plan to N ranks; with
`--num-scheduler-steps N` (multi-step decoding) one plan runs up to N forwards, and with
`--async-scheduling` the next plan is made while one runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from axonserve.config import EngineConfig
from axonserve.protocol.messages import SamplingParams

NULL_VOCAB = 512
_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_s(pid: int) -> float | None:
    """A process's user + system CPU seconds so far (None: not readable, e.g. not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK
    except (OSError, IndexError, ValueError):
        return None


def _cpu_by_process(sup) -> dict[str, float | None]:
    """CPU seconds so far of every actor process (by actor name) and of this one (the client)."""
    out = {name: _cpu_s(c.proc.pid) for name, c in sup.children.items()}
    out["client"] = _cpu_s(os.getpid())
    return out


def make_null_model(out_dir: str, tokenizer_dir: str) -> str:
    """A model directory for `AxonNullForCausalLM` with a real tokenizer (the client needs one)."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = {
        "architectures": ["AxonNullForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "vocab_size": NULL_VOCAB,
        "max_position_embeddings": 8192,
        "eos_token_id": 0,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({"weight": torch.zeros(1)}, os.path.join(out_dir, "model.safetensors"))
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or name.endswith(".gguf"):
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src):
                shutil.copy(src, out_dir)
    return out_dir


async def _run(config: EngineConfig, batches: list[int], tokens: int, bar: tqdm) -> list[dict]:
    from axonserve.actors.supervisor import Supervisor
    from axonserve.frontends.client import AsyncEngineClient

    sup = Supervisor(config, frontend=False)
    await sup.start()
    client = await AsyncEngineClient.connect(sup.addresses.engine)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    rows = []
    try:
        for b in batches:

            async def one(i: int) -> None:
                async for _ in client.generate([1 + i % (NULL_VOCAB - 1)] * 8, params):
                    pass

            s0 = (await client.get_stats()).num_forwards
            c0 = _cpu_by_process(sup)
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(b)))
            dt = time.perf_counter() - t0
            c1 = _cpu_by_process(sup)
            steps = (await client.get_stats()).num_forwards - s0
            cpu = {k: round((c1[k] - v) / steps * 1e6, 1) for k, v in c0.items() if None not in (v, c1.get(k))}
            rows.append(
                {
                    "batch": b,
                    "steps": steps,
                    "us_per_step": dt / steps * 1e6,
                    "us_per_token": dt / (b * tokens) * 1e6,
                    "cpu_us_per_step": cpu,
                }
            )
            bar.update(1)
    finally:
        client.close()
        sup.request_stop()
        await sup.wait()
    return rows


def run_step_bench(args: argparse.Namespace) -> int:
    import uvloop

    from axonserve.neuron.model_source import resolve_model

    batches = [int(x) for x in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="axonserve-null-") as d:
        model = make_null_model(d, resolve_model("SmolLM2-135M-Instruct"))
        config = EngineConfig(
            model=model,
            served_model_name="null",
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(2048, 8 * max(batches)),
            num_kv_blocks=max(batches) * (args.tokens // 16 + 2),
            num_workers=args.num_workers,
            num_scheduler_steps=args.num_scheduler_steps,
            async_scheduling=args.async_scheduling,
            log_level="warning",
        )
        with tqdm(total=len(batches), desc=f"bench step ({args.num_workers} rank(s))") as bar:
            rows = uvloop.run(_run(config, batches, args.tokens, bar))
    print(
        f"{'batch':>6} {'steps':>6} {'us/step':>9} {'us/token':>9}   ({args.num_workers} worker rank(s), "
        f"{args.num_scheduler_steps} forward(s) per plan at most, "
        f"{'async' if args.async_scheduling else 'sync'} scheduling, null model)"
    )
    for r in rows:
        print(f"{r['batch']:>6} {r['steps']:>6} {r['us_per_step']:>9.0f} {r['us_per_token']:>9.1f}")
    names = sorted({k for r in rows for k in r["cpu_us_per_step"]})
    if names:
        print(f"CPU µs per step by process ({os.cpu_count()} cores; clock tick {1e6 / _CLK:.0f} µs):")
        print(f"{'batch':>6} " + " ".join(f"{n:>10}" for n in names) + f" {'total':>10}")
        for r in rows:
            c = r["cpu_us_per_step"]
            cells = " ".join(f"{c.get(n, float('nan')):>10.0f}" for n in names)
            print(f"{r['batch']:>6} {cells} {sum(c.values()):>10.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "num_workers": args.num_workers,
                    "num_scheduler_steps": args.num_scheduler_steps,
                    "async_scheduling": args.async_scheduling,
                    "tokens": args.tokens,
                    "rows": rows,
                },
                f,
                indent=2,
            )
    return 0


def add_step_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,8,32,128,256", help="concurrent requests per run (comma list)")
    p.add_argument("--tokens", type=int, default=128, help="tokens each request decodes")
    p.add_argument("--num-workers", type=int, default=1, help="worker ranks the plan is broadcast to")
    p.add_argument("--num-scheduler-steps", type=int, default=1, help="multi-step decoding: forwards per plan")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="plan the next step while one runs",
    )
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.set_defaults(func=run_step_bench)
