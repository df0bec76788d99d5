"""`bench bandwidth`: memory read bandwidth, and the batch-1 decode ceiling it implies.

Batch-1 decode reads every weight once per token, so tokens/s <= bandwidth / weight bytes;
the single-stream figure is best quoted as a fraction of this ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import time

BYTES_PER_PARAM = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0}


def read_bandwidth(size_mib: int = 1024, repeats: int = 5, threads: int | None = None) -> dict:
    """Best-of-N GB/s reading a buffer far larger than the caches, two ways: `sum` (the figure
    peers.md quotes) and `gemv` (fp32 matrix-vector, what batch-1 decode does). The ceiling uses
    the higher: a bound must not be beaten by a real engine."""
    import torch

    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    x = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32)
    m, v = x.view(4096, -1), torch.ones(x.numel() // 4096)
    kernels = {"sum": x.sum, "gemv": lambda: torch.mv(m, v)}
    nbytes = x.numel() * 4
    out: dict = {"bytes": nbytes, "threads": threads, "repeats": repeats}
    for name, fn in kernels.items():
        fn()  # touch pages, warm up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[f"{name}_gbps"] = nbytes / min(times) / 1e9
        out[f"{name}_median_gbps"] = nbytes / sorted(times)[len(times) // 2] / 1e9
    out["best_gbps"] = max(out["sum_gbps"], out["gemv_gbps"])
    return out


def count_params(model_dir: str) -> int:
    """Parameters in the model's safetensors files (headers only; tied weights stored once)."""
    total = 0
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for key, meta in header.items():
            if key != "__metadata__":
                numel = 1
                for d in meta["shape"]:
                    numel *= d
                total += numel
    if total == 0:
        raise ValueError(f"no safetensors weights in {model_dir}")
    return total


def decode_ceiling(params: int, dtype: str, gbps: float) -> dict:
    weight_bytes = params * BYTES_PER_PARAM[dtype]
    return {"params": params, "dtype": dtype, "weight_bytes": weight_bytes, "tok_s_ceiling": gbps * 1e9 / weight_bytes}


def cmd_bandwidth(args: argparse.Namespace) -> int:
    bw = read_bandwidth(args.size_mib, args.repeats, args.threads)
    print(
        f"read bandwidth: sum {bw['sum_gbps']:.1f} GB/s (median {bw['sum_median_gbps']:.1f}), "
        f"gemv {bw['gemv_gbps']:.1f} GB/s (median {bw['gemv_median_gbps']:.1f}); "
        f"{bw['threads']} threads, {bw['bytes'] / 2**20:.0f} MiB, best of {args.repeats}"
    )
    out = {"bandwidth": bw}
    if args.model is not None:
        from axonserve.neuron.model_source import resolve_model

        params = count_params(resolve_model(args.model or None))
        out["ceilings"] = []
        for dtype in args.dtype.split(","):
            c = decode_ceiling(params, dtype, bw["best_gbps"])
            out["ceilings"].append(c)
            print(
                f"batch-1 decode ceiling {dtype}: {c['weight_bytes'] / 1e6:.0f} MB/step -> "
                f"{c['tok_s_ceiling']:.0f} tok/s ({params / 1e6:.1f} M params)"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def add_bandwidth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="default: all cores")
    p.add_argument(
        "--model",
        nargs="?",
        const="",
        default=None,
        help="model (dir/.gguf; bare flag: the default model) for the decode ceiling",
    )
    p.add_argument("--dtype", default="float32,bfloat16", help="weight formats, comma list")
    p.add_argument("--out", default=None)
    p.set_defaults(func=cmd_bandwidth)
