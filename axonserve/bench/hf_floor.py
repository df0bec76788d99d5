"""The floor: transformers `generate`, in process, one static batch, greedy, fp32.

Run as `python -m axonserve.bench.hf_floor` in its own process group by `bench compare`, so its
CPU time is accounted like a server's. A streamer timestamps each decode step: TTFT is the
whole batch's prefill, ITL the step time (every stream gets one token per step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from axonserve.bench.stats import RequestResult, summarize


class StepTimer:
    """transformers streamer protocol (put/end): the first put is the prompt, then one per step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_batch(model, prompts: list[list[int]], output_len: int) -> tuple[list[RequestResult], float]:
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)  # equal lengths: no padding needed
    timer = StepTimer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            streamer=timer,
            pad_token_id=model.config.eos_token_id,
        )
    dur = time.perf_counter() - t0
    n_out = out.shape[1] - ids.shape[1]
    steps = timer.times[1:]  # times[0]: the prompt echo, before any compute
    ttft = steps[0] - t0
    itl = [b - a for a, b in zip(steps, steps[1:])]
    res = [
        RequestResult(
            ok=True,
            prompt_len=len(p),
            output_tokens=n_out,
            ttft=ttft,
            itl=list(itl),
            finish_reason="length",
            e2e=dur,
            start=0.0,
        )
        for p in prompts
    ]
    return res, dur


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--prompts", required=True, help="JSON file: {batch size: [[ids]...]}")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).eval()
    with open(a.prompts) as f:
        batches = json.load(f)
    run_batch(model, [batches[next(iter(batches))][0]], 4)  # warm-up
    runs = []
    for _key, prompts in batches.items():
        results, dur = run_batch(model, prompts, a.output_len)
        s = summarize(results, dur)
        runs.append({"batch": len(prompts), "summary": s, "requests": [r.to_json() for r in results]})
        print(f"transformers batch {len(prompts)}: {s['output_throughput']:.1f} tok/s", file=sys.stderr)
    with open(a.out, "w") as f:
        json.dump(runs, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
