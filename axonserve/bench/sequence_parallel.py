"""`python -m axonserve.bench.sequence_parallel`: prefill time (TTFT) with tensor parallelism,
sequence parallelism off vs on (docs/benchmarks.md#fig-sequence-parallel).

For each dtype and hidden size it writes a random 8-layer Llama (transformers' init, the
SmolLM2 tokenizer), starts two real engines side by side (supervisor, scheduler, `--num-workers`
gloo ranks; one with `sequence_parallel` and a threshold below every prompt, one without;
prefix caching off, the whole prompt in one step), and times one-token requests of fresh random
prompts, interleaved off, on, off, on ... so slow drift on a shared machine hits both alike.
Each engine first runs one untimed prompt of every length (oneDNN's first use of a shape).
`--forward` times the model forward alone on two gloo ranks instead (no scheduler, bus or
sampling), SP toggled between runs on the same runners.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time

from axonserve.config import EngineConfig
from axonserve.protocol.messages import SamplingParams

VOCAB = 49152  # the SmolLM2 tokenizer's


def make_model(out_dir: str, hidden: int, layers: int) -> str:
    """A random Llama of `layers` layers, head_dim 64, 4 KV heads (GQA), MLP 2.75x hidden."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from axonserve.neuron.model_source import resolve_model

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(out_dir, safe_serialization=True)
    tokenizer_dir = resolve_model("SmolLM2-135M-Instruct")  # the client tokenizes; prompts are ids anyway
    for name in os.listdir(tokenizer_dir):
        src = os.path.join(tokenizer_dir, name)
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) and os.path.isfile(src):
            shutil.copy(src, out_dir)
    return out_dir


async def _ttft(client, ids: list[int]) -> float:
    t0 = time.perf_counter()
    async for out in client.generate(ids, SamplingParams(temperature=0.0, max_tokens=1)):
        assert out.error is None, out.error
    return time.perf_counter() - t0


async def _measure(model: str, dtype: str, args: argparse.Namespace) -> dict:
    from axonserve.actors.supervisor import Supervisor
    from axonserve.frontends.client import AsyncEngineClient

    lengths = [int(x) for x in args.lengths.split(",")]
    longest = max(lengths)
    engines = {}
    try:
        for mode in ("off", "on"):
            config = EngineConfig(
                model=model,
                dtype=dtype,
                num_workers=args.num_workers,
                sequence_parallel=mode == "on",
                sequence_parallel_threshold=min(lengths),
                max_num_batched_tokens=longest,
                max_model_len=longest + 16,
                num_kv_blocks=longest // 16 + 8,
                enable_prefix_caching=False,
                log_level="warning",
            )
            sup = Supervisor(config, frontend=False)
            await sup.start()
            engines[mode] = (sup, await AsyncEngineClient.connect(sup.addresses.engine, timeout=120))
        rng = random.Random(0)

        def prompt(n: int) -> list[int]:
            return [rng.randrange(3, VOCAB) for _ in range(n)]

        times: dict[str, dict[int, list[float]]] = {m: {n: [] for n in lengths} for m in engines}
        for n in lengths:
            for mode in engines:  # untimed: each shape's first run
                await _ttft(engines[mode][1], prompt(n))
            for _ in range(args.runs):
                for mode in ("off", "on"):
                    times[mode][n].append(await _ttft(engines[mode][1], prompt(n)))
        sp_forwards = (await engines["on"][1].get_stats()).sequence_parallel_forwards
        return {"times": times, "sp_forwards": sp_forwards}
    finally:
        for sup, client in engines.values():
            client.close()
            await sup.stop("bench done")


def _forward_rank(rank: int, port: int, q, model: str, dtype: str, args: argparse.Namespace) -> None:
    """--forward: one rank of a 2-process gloo group timing the model forward of one prompt, SP
    toggled between runs on the same runner (same weights, same processes)."""
    import torch
    import torch.distributed as dist

    from axonserve.neuron.model_runner import ModelRunner
    from axonserve.neuron.ops.attention import AttentionMetadata
    from axonserve.neuron.sequence_parallel import SequenceParallel

    lengths = [int(x) for x in args.lengths.split(",")]
    longest = max(lengths)
    config = EngineConfig(
        model=model,
        dtype=dtype,
        num_workers=args.num_workers,
        sequence_parallel=True,
        sequence_parallel_threshold=1,
        max_num_batched_tokens=longest,
        num_kv_blocks=longest // 16 + 8,
        log_level="warning",
    )
    runner = ModelRunner(config, rank=rank, dist_init=f"tcp://127.0.0.1:{port}")
    rng = random.Random(0)
    times: dict[str, dict[int, list[float]]] = {"off": {n: [] for n in lengths}, "on": {n: [] for n in lengths}}

    def once(n: int, mode: str) -> float:
        SequenceParallel.threshold = 1 if mode == "on" else 0
        ids = torch.tensor([rng.randrange(3, VOCAB) for _ in range(n)])
        meta = AttentionMetadata.build([n], [0], [list(range(-(-n // 16)))], 16, native=runner.native)
        dist.barrier()
        t0 = time.perf_counter()
        with torch.inference_mode():
            runner.model(ids, meta.positions, runner.kv_caches, meta)
        dist.barrier()
        return time.perf_counter() - t0

    for n in lengths:
        once(n, "off"), once(n, "on")  # untimed: each shape's first run
        for _ in range(args.runs):
            for mode in ("off", "on"):
                times[mode][n].append(once(n, mode))
    q.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def _measure_forward(model: str, dtype: str, args: argparse.Namespace) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_forward_rank, args=(r, port, q, model, dtype, args)) for r in range(args.num_workers)]
    for p in procs:
        p.start()
    try:
        results = dict(q.get(timeout=3600) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return {"times": results[0], "sp_forwards": "-"}


def main(argv: list[str] | None = None) -> int:
    import uvloop

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", default="512,1024", help="hidden sizes (comma list)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--lengths", default="512,1024,2048", help="prompt lengths (comma list)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per length and mode (interleaved)")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--out", default="", help="write every time as JSON here")
    p.add_argument(
        "--forward",
        action="store_true",
        help="time the model forward on the ranks directly (SP toggled on the same runners), not TTFT",
    )
    args = p.parse_args(argv)
    rows = []
    print(f"{'dtype':>9} {'hidden':>6} {'tokens':>6}  {'SP off: median [range] s':>26}  {'SP on':>26}  on/off")
    for dtype in args.dtypes.split(","):
        for hidden in (int(x) for x in args.hidden.split(",")):
            with tempfile.TemporaryDirectory(prefix="axonserve-sp-") as d:
                model = make_model(d, hidden, args.layers)
                r = _measure_forward(model, dtype, args) if args.forward else uvloop.run(_measure(model, dtype, args))
            for n in r["times"]["off"]:
                off, on = r["times"]["off"][n], r["times"]["on"][n]
                mo, mn = statistics.median(off), statistics.median(on)
                print(
                    f"{dtype:>9} {hidden:>6} {n:>6}  {mo:8.3f} [{min(off):.3f}-{max(off):.3f}]"
                    f"  {mn:8.3f} [{min(on):.3f}-{max(on):.3f}]  {mn / mo:6.3f}"
                )
                rows.append({"dtype": dtype, "hidden": hidden, "tokens": n, "off": off, "on": on})
            print(f"  (sequence-parallel forwards in the SP engine: {r['sp_forwards']})")
    if args.out:
        with open(args.out, "w") as f:
            meta = {"layers": args.layers, "num_workers": args.num_workers, "forward": args.forward}
            json.dump({**meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
