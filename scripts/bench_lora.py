"""Output tokens/s of a mixed-adapter batch vs the base model alone (offline engine, SmolLM2,
bf16 by default): `python scripts/bench_lora.py [--streams 8 32] [--runs 3] [--tokens 64]`.

Three engines stay up side by side (base without --enable-lora: the default, fused path; the
same engine with LoRA on, all requests on the base model; and mixed: requests spread over two
rank-8 adapters and the base model) and are run interleaved, run i of each before run i+1 of
any, so machine noise falls on all of them alike. Prints per case the median and range."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    from lora.lora_helpers import make_adapter

    from axonserve import LLM, LoRARequest, SamplingParams
    from axonserve.neuron.model_source import resolve_model

    model = resolve_model(None)
    root = tempfile.mkdtemp()
    ads = [make_adapter(model, os.path.join(root, f"a{i}"), r=8, seed=10 + i) for i in range(2)]
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(ads)]
    common = dict(dtype=args.dtype, num_kv_blocks=1024, max_num_seqs=max(args.streams), log_level="warning")
    engines = {
        "base": LLM(model, **common),
        "lora-on/base-only": LLM(model, enable_lora=True, max_loras=2, max_lora_rank=8, **common),
    }
    engines["mixed"] = engines["lora-on/base-only"]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, min_tokens=args.tokens)
    tok = engines["base"].tokenizer
    try:
        for n in args.streams:
            prompts = [tok.encode(f"Story {i}: once upon a time in a land far away,") for i in range(n)]
            per_req = {
                "base": None,
                "lora-on/base-only": None,
                "mixed": [(loras + [None])[i % 3] for i in range(n)],
            }
            for name, llm in engines.items():  # warm each case at this batch size (adapters loaded)
                llm.generate(prompts, params, lora_request=per_req[name])
            rates: dict[str, list[float]] = {k: [] for k in engines}
            for _ in range(args.runs):
                for name, llm in engines.items():
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params, lora_request=per_req[name])
                    dt = time.perf_counter() - t0
                    rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
            for name, r in rates.items():
                print(
                    f"streams={n:3d} {name:18s} out tok/s median {statistics.median(r):7.1f} "
                    f"range {min(r):7.1f}-{max(r):7.1f}  runs {[round(x, 1) for x in r]}",
                    flush=True,
                )
    finally:
        for llm in set(engines.values()):
            llm.shutdown()


if __name__ == "__main__":
    main()
