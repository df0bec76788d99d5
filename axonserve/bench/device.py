"""`axonserve bench device`: one model's runner on the CPU backend and on the XLA device, side by side.

Each measurement is a fresh process running `python -m axonserve.bench.device --one ...` with one
runner in it (the CPU backend in this venv; `--device xla` in the XLA venv's interpreter, as torch-xla
pins its own torch). Runs alternate (cpu, cpu bucketed, xla, cpu, ...) `--repeat` times so the
machine's drift hits every side alike; the table gives medians with [min, max] over the repeats.

Measured per run: load seconds, start-up (XLA: compiling every bucket; the first XLA run uses a fresh
compile cache = cold, later ones the same cache = warm), compile seconds per graph, the median
decode step (batch b, all sequences at the same KV bucket) and the median prefill step (one chunk
of q tokens), both through `ModelRunner.execute` as the worker calls it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from tqdm import tqdm


def _one(args: argparse.Namespace) -> dict:
    """In this process: build the runner, warm it up, time decode and prefill steps."""
    from axonserve.config import EngineConfig
    from axonserve.protocol.messages import CachedRequestData, NewRequestData, SamplingParams, StepPlan

    buckets = dict(
        context_batch_buckets=[1],
        context_len_buckets=[args.prefill_len],
        decode_batch_buckets=sorted(set(args.batches)),
        decode_len_buckets=[args.max_model_len],
    )
    cfg = EngineConfig(
        model=args.model,
        device=args.device,
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=args.prefill_len,
        num_kv_blocks=(max(args.batches) + 1) * (args.max_model_len // 16),
        compile_cache_dir=args.cache_dir,
        bucketing=args.bucketing or args.device == "xla",
        **(buckets if args.bucketing or args.device == "xla" else {}),
    )
    t0 = time.perf_counter()
    if args.device == "xla":
        from axonserve.xla.runner import XlaModelRunner as Runner
    else:
        from axonserve.neuron.model_runner import ModelRunner as Runner
    runner = Runner(cfg)
    load_s = time.perf_counter() - t0
    warm_s = runner.warm_up()
    out: dict = {
        "device": args.device,
        "bucketing": cfg.bucketing,
        "load_s": load_s,
        "warm_up_s": warm_s,
        "compile_s": list(getattr(runner, "startup_compile_s", [])),
    }
    greedy = SamplingParams(temperature=0.0)
    per_seq = args.max_model_len // 16
    step = 0

    def run(plan: StepPlan) -> float:
        nonlocal step
        t = time.perf_counter()
        res = runner.execute(plan)
        if res.error:
            raise RuntimeError(res.error)
        step += 1
        return time.perf_counter() - t

    prompt = [(7 * j + 11) % runner.vocab_size for j in range(args.prefill_len)]
    prefill = []
    for i in range(args.steps):  # a fresh request each time: one chunk of prefill_len tokens
        rid = f"p{i}"
        new = NewRequestData(rid, prompt, len(prompt), list(range(per_seq)), 0, greedy)
        prefill.append(run(StepPlan(step, new=[new], num_scheduled_tokens=[len(prompt)])))
        runner.execute(StepPlan(step, finished_request_ids=[rid]))
    out["prefill_ms"] = statistics.median(prefill[1:]) * 1e3
    out["decode_ms"] = {}
    for b in args.batches:
        rids = [f"d{b}-{i}" for i in range(b)]
        new = [
            NewRequestData(r, prompt[:16], 16, list(range(i * per_seq, (i + 1) * per_seq)), 0, greedy)
            for i, r in enumerate(rids)
        ]
        for n in new:  # prefilled one by one: the prefill buckets hold one sequence
            run(StepPlan(step, new=[n], num_scheduled_tokens=[16]))
        times = [
            run(StepPlan(step, cached=[CachedRequestData(r) for r in rids], num_scheduled_tokens=[1] * b))
            for _ in range(args.steps)
        ]
        runner.execute(StepPlan(step, finished_request_ids=rids))
        out["decode_ms"][str(b)] = statistics.median(times[1:]) * 1e3
    return out


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}, {max(values):.1f}]"


def run_device_bench(args: argparse.Namespace) -> int:
    """Alternate the sides `--repeat` times, each in a fresh process; print the table."""
    here = sys.executable
    xla_py = args.xla_python or os.path.join(os.getcwd(), ".venv-xla", "bin", "python")
    cache = args.cache_dir or tempfile.mkdtemp(prefix="axonserve-xla-bench-")
    common = [
        args.model,
        "--max-model-len", str(args.max_model_len),
        "--prefill-len", str(args.prefill_len),
        "--batches", ",".join(map(str, args.batches)),
        "--steps", str(args.steps),
        "--cache-dir", cache,
    ]  # fmt: skip
    sides = {
        "cpu": [here, "-m", "axonserve.bench.device", "--one", "--device", "cpu", *common],
        "cpu-bucketed": [here, "-m", "axonserve.bench.device", "--one", "--device", "cpu", "--bucketing", *common],
        "xla": [xla_py, "-m", "axonserve.bench.device", "--one", "--device", "xla", *common],
    }
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU"), "HF_HUB_OFFLINE": "1"}
    rows: dict[str, list[dict]] = {k: [] for k in sides}
    for _ in tqdm(range(args.repeat), desc="rounds", unit="round"):
        for name, cmd in sides.items():
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, check=False)
            if r.returncode != 0:
                raise SystemExit(f"{name} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
            rows[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"model {args.model}, fp32, {args.repeat} interleaved rounds: median [min, max]")
    print(f"{'side':14} {'load s':>18} {'start-up s':>18} {'prefill ms':>20} " + " ".join(
        f"{'decode b=' + str(b) + ' ms':>20}" for b in args.batches
    ))  # fmt: skip
    for name, rs in rows.items():
        cells = [_spread([r["load_s"] for r in rs]), _spread([r["warm_up_s"] for r in rs])]
        cells.append(_spread([r["prefill_ms"] for r in rs]))
        cells += [_spread([r["decode_ms"][str(b)] for r in rs]) for b in args.batches]
        print(f"{name:14} " + " ".join(f"{c:>18}" if i < 2 else f"{c:>20}" for i, c in enumerate(cells)))
    x = rows["xla"]
    print(f"xla start-up: cold (fresh cache) {x[0]['warm_up_s']:.1f} s; warm (same cache) " + ", ".join(
        f"{r['warm_up_s']:.1f}" for r in x[1:]
    ) + " s")  # fmt: skip
    print("xla compile seconds per graph (cold run): " + ", ".join(f"{s:.2f}" for s in x[0]["compile_s"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory")
    p.add_argument("--xla-python", default="", help="the XLA venv's interpreter (default ./.venv-xla/bin/python)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--prefill-len", type=int, default=64, help="the prefill chunk timed (and its bucket)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--steps", type=int, default=12, help="timed steps per figure (the first is dropped)")
    p.add_argument("--cache-dir", default="", help="XLA compile cache (default: a fresh temp dir: first run cold)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None, help="write every run's figures as JSON here")
    p.set_defaults(func=run_device_bench)


def main() -> None:  # python -m axonserve.bench.device --one ...: one side, JSON on the last line
    p = argparse.ArgumentParser(prog="python -m axonserve.bench.device")
    p.add_argument("--one", action="store_true", required=True)
    p.add_argument("--device", choices=["cpu", "xla"], required=True)
    p.add_argument("--bucketing", action="store_true")
    add_device_args(p)
    args = p.parse_args()
    print(json.dumps(_one(args)))


if __name__ == "__main__":
    main()
