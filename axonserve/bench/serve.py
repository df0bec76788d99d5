"""`bench serve`: run the load at each concurrency level against one server, report, save.

Each level gets fresh prompts (seed + level index) so a prefix cache cannot carry the previous
level's prompts into the next one; the same seed gives the same prompts on every engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from axonserve.bench.dataset import PromptFactory, PromptKind, RequestSpec, load_tokenizer
from axonserve.bench.loadgen import LoadConfig, is_loopback, run_load
from axonserve.bench.stats import summarize
from axonserve.bench.sysload import LoadMonitor, loadavg


@dataclass
class Workload:
    input_len: int = 64
    output_len: int = 128
    num_prompts: int | None = None  # per level; None: max(4, concurrency)
    prompt_kind: PromptKind = "tokens"
    prefix_len: int = 0
    prefix_groups: int = 1
    seed: int = 0
    vocab_size: int = 32000

    def count(self, concurrency: int | None) -> int:
        return self.num_prompts or max(4, concurrency or 4)

    def specs(self, factory_args: tuple[Any, int], level: int, concurrency: int | None) -> list[RequestSpec]:
        tok, vocab = factory_args
        f = PromptFactory(self.prompt_kind, tok, vocab, seed=self.seed * 1000 + level)
        return f.make(self.count(concurrency), self.input_len, self.output_len, self.prefix_len, self.prefix_groups)


@dataclass
class LevelOptions:
    concurrencies: list[int | None] = field(default_factory=lambda: [None])
    request_rate: float | None = None
    max_duration_s: float | None = None
    warmup: int = 2
    extra_body: dict[str, Any] = field(default_factory=dict)
    ignore_eos: bool = True
    progress: bool = True


def discover_model(base_url: str) -> str:
    """The first served model id (what `vllm bench serve` does when --model is omitted)."""
    r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0, trust_env=False)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run_levels(
    base_url: str,
    model: str,
    work: Workload,
    opts: LevelOptions,
    tokenizer: Any,
    engine: str = "server",
    pgids: set[int] | None = None,
    probe: Callable[[], dict[str, float]] | None = None,
) -> list[dict]:
    """Warm up, then one measured run per concurrency level; returns JSON-ready runs. probe:
    server counters read around each level; a run's `probe_delta` is what its level added."""
    args = (tokenizer, work.vocab_size)
    if opts.warmup:
        warm = Workload(
            **{
                **work.__dict__,
                "num_prompts": opts.warmup,
                "output_len": min(8, work.output_len),
                "seed": work.seed + 7919,
            }
        )
        cfg = LoadConfig(
            base_url,
            model,
            concurrency=opts.warmup,
            ignore_eos=opts.ignore_eos,
            extra_body=opts.extra_body,
            progress=False,
        )
        res, _ = asyncio.run(run_load(cfg, warm.specs(args, 0, None)))
        bad = [r.error for r in res if not r.ok]
        if bad:
            raise RuntimeError(f"{engine}: warm-up failed: {bad[0]}")
    runs = []
    for level, conc in enumerate(opts.concurrencies):
        specs = work.specs(args, level, conc)
        label = f"{engine} c={conc or 'inf'}" + (f" rate={opts.request_rate}" if opts.request_rate else "")
        cfg = LoadConfig(
            base_url,
            model,
            concurrency=conc,
            request_rate=opts.request_rate,
            max_duration_s=opts.max_duration_s,
            seed=work.seed + level,
            ignore_eos=opts.ignore_eos,
            extra_body=opts.extra_body,
            progress=opts.progress,
            desc=label,
        )
        mon = LoadMonitor(pgids or set())
        before = probe() if probe else {}
        mon.start()
        results, duration = asyncio.run(run_load(cfg, specs))
        load = mon.stop()
        summary = summarize(results, duration)
        runs.append(
            {
                "engine": engine,
                "label": label,
                "concurrency": conc,
                "request_rate": opts.request_rate,
                "summary": summary,
                "load": load,
                "requests": [r.to_json() for r in results],
            }
        )
        if probe:
            after = probe()
            runs[-1]["probe_delta"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
        print_summary(label, summary, load)
    return runs


def _fmt(v: float | None, nd: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def print_summary(label: str, s: dict, load: dict | None = None, file=sys.stdout) -> None:
    w = 44
    lines = [
        f"{'=' * 16} {label} {'=' * 16}",
        f"{'Successful requests:':<{w}}{s['completed']}",
        f"{'Failed requests:':<{w}}{s['failed']}",
        f"{'Benchmark duration (s):':<{w}}{s['duration_s']:.2f}",
        f"{'Total input tokens:':<{w}}{s['total_input_tokens']}",
        f"{'Total generated tokens:':<{w}}{s['total_output_tokens']}",
        f"{'Request throughput (req/s):':<{w}}{s['request_throughput']:.3f}",
        f"{'Output token throughput (tok/s):':<{w}}{s['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<{w}}{s['total_token_throughput']:.2f}",
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        d = s[key]
        lines.append(
            f"{name + ' (ms) mean/p50/p90/p99:':<{w}}" + " / ".join(_fmt(d[k]) for k in ("mean", "p50", "p90", "p99"))
        )
    if load:
        lines.append(
            f"{'Load avg start->end; other procs (cores):':<{w}}"
            f"{load['loadavg_start'][0]:.2f}->{load['loadavg_end'][0]:.2f}; {load['other_cores']:.2f}"
        )
    lines.append(f"{'Finish reasons:':<{w}}{s.get('finish_reasons', {})}")
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    print("\n".join(lines), file=file, flush=True)


def parse_concurrency(text: str | None) -> list[int | None]:
    if not text:
        return [None]
    return [None if x.strip() in ("inf", "0") else int(x) for x in text.split(",")]


def tokenizer_for(spec: str | None, kind: PromptKind) -> Any:
    """`default` = the default model's tokenizer (exact text lengths, no special ids)."""
    if spec in (None, "none"):
        return None
    if spec == "default":
        from axonserve.neuron.model_source import resolve_model

        spec = resolve_model(None)
    return load_tokenizer(spec)


def metadata(args: argparse.Namespace) -> dict:
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "python": platform.python_version(),
        "loadavg": loadavg(),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }


def write_outputs(doc: dict, out: str | None, plot: str | None, title: str) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {out}")
    if plot is None and out:
        plot = (out[:-5] if out.endswith(".json") else out) + ".png"
    if plot:
        from axonserve.bench.plot import plot_runs

        if plot_runs(doc["runs"], plot, title):
            print(f"wrote {plot}")
        else:
            print("plot skipped: matplotlib is not installed (pip install 'axonserve[bench]')")


def cmd_serve(args: argparse.Namespace) -> int:
    base = args.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if not args.allow_remote and not is_loopback(base):
        print(f"refusing non-loopback target {base} (pass --allow-remote)", file=sys.stderr)
        return 2
    model = args.model or discover_model(base)
    work = Workload(
        args.input_len,
        args.output_len,
        args.num_prompts,
        args.prompt_kind,
        args.prefix_len,
        args.prefix_groups,
        args.seed,
        args.vocab_size,
    )
    opts = LevelOptions(
        parse_concurrency(args.concurrency),
        args.request_rate,
        args.max_duration,
        args.warmup,
        request_extras(args),
        not args.no_ignore_eos,
        not args.no_progress,
    )
    tok = tokenizer_for(args.tokenizer, args.prompt_kind)
    pgids = {os.getpgid(pid) for pid in args.server_pid}
    runs = run_levels(base, model, work, opts, tok, engine=args.label or model, pgids=pgids)
    doc = {"kind": "serve", "meta": metadata(args), "base_url": base, "model": model, "runs": runs}
    write_outputs(doc, args.out, args.plot, f"{model} @ {base}")
    return 0 if all(r["summary"]["failed"] == 0 for r in runs) else 1


def request_extras(args: argparse.Namespace) -> dict:
    """--extra-body JSON with the sampling flags (vLLM bench's) over it; greedy unless asked."""
    body = json.loads(args.extra_body) if args.extra_body else {}
    for key in ("temperature", "top_p", "top_k"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    return body


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (after the prefix)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (= min_tokens, EOS ignored)")
    p.add_argument(
        "--num-prompts", type=int, default=None, help="requests per concurrency level (default max(4, concurrency))"
    )
    p.add_argument(
        "--prompt-kind",
        choices=["tokens", "text", "chat"],
        default="tokens",
        help="token-id prompts (exact length), random-word text, or real chat instructions",
    )
    p.add_argument("--prefix-len", type=int, default=0, help="shared-prefix mode: common prefix tokens")
    p.add_argument("--prefix-groups", type=int, default=1, help="distinct shared prefixes")
    p.add_argument("--concurrency", default=None, help="max concurrency, comma list: 1,8,32 (inf: unbounded)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals (req/s)")
    p.add_argument("--max-duration", type=float, default=None, help="seconds per level")
    p.add_argument("--warmup", type=int, default=2, help="short warm-up requests before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=32000, help="id range without a tokenizer")
    p.add_argument("--no-ignore-eos", action="store_true", help="let EOS end streams early")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--plot", default=None, help="PNG with latency CDFs and throughput (default: --out with .png)")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to request (default: first of /v1/models)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer dir for prompts ('default': the default model's); none: raw id range",
    )
    p.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    p.add_argument("--label", default=None)
    p.add_argument(
        "--server-pid",
        type=int,
        action="append",
        default=[],
        help="a pid of the server under test: its process group's CPU is not counted as other load (repeatable)",
    )
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target")
    add_workload_args(p)
    p.set_defaults(func=cmd_serve)
