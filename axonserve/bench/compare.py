"""`bench compare`: axonserve and each available peer on the same model, same load; one run, or
`--repeat N` interleaved rounds reported as medians with their range (bench/repeat.py).

Servers run one at a time (own port, own process group), each warmed up before the measured
levels, and are stopped before the next starts, so they never compete for the cores. The
machine's other load is recorded per level: on a shared machine only ratios from one run are
worth quoting.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

from axonserve.bench.peers import default_dir, has_module
from axonserve.bench.serve import (
    LevelOptions,
    Workload,
    add_workload_args,
    discover_model,
    metadata,
    parse_concurrency,
    print_summary,
    request_extras,
    run_levels,
    write_outputs,
)
from axonserve.bench.servers import (
    REPO,
    ServerSpec,
    axonserve_spec,
    launch,
    llama_server_spec,
    llamacpp_spec,
    stop_group,
    vllm_axonserve_spec,
    vllm_spec,
)
from axonserve.bench.sysload import LoadMonitor

ENGINES = ("axonserve", "vllm", "vllm+axonserve", "llamacpp", "llama-server", "transformers")
SERVED_NAME = "bench-model"


def _peer_venv(given: str | None, name: str) -> str | None:
    if given:
        return given
    path = os.path.join(default_dir(), name)
    return path if os.path.isdir(path) else None


def build_specs(
    a: argparse.Namespace, model_dir: str, gguf: str | None, max_conc: int
) -> tuple[list[ServerSpec], list[str]]:
    """Server specs for the engines asked for and present; skip messages for the rest."""
    cores = os.cpu_count() or 1
    specs, skipped = [], []
    want = set(a.engines.split(","))
    if "axonserve" in want:
        specs.append(axonserve_spec(a.model, shlex.split(a.axonserve_args)))
        for v in a.variant:  # axonserve with extra flags, e.g. speculative decoding
            name, _, flags = v.partition("=")
            specs.append(axonserve_spec(a.model, shlex.split(a.axonserve_args) + shlex.split(flags)))
            specs[-1].name = f"axonserve[{name}]"
    if "vllm" in want:
        venv = _peer_venv(a.vllm_venv, "vllm")
        if has_module(venv, "vllm"):
            specs.append(vllm_spec(venv, model_dir, SERVED_NAME, cores, shlex.split(a.vllm_args)))
        else:
            skipped.append(f"vllm: no vllm in venv {venv!r} (axonserve bench setup-peers --vllm)")
    if "vllm+axonserve" in want:  # vLLM's server on our ranks: the rank dependencies must be there too
        venv = _peer_venv(a.vllm_venv, "vllm")
        if has_module(venv, "vllm") and has_module(venv, "structlog"):
            specs.append(vllm_axonserve_spec(venv, model_dir, SERVED_NAME, cores, shlex.split(a.vllm_args)))
        else:
            skipped.append(
                f"vllm+axonserve: venv {venv!r} lacks vllm or axonserve's rank dependencies (scripts/setup-vllm)"
            )
    for name in ("llamacpp", "llama-server"):
        if name not in want:
            continue
        if gguf is None:
            skipped.append(f"{name}: no GGUF file for this model (--gguf)")
        elif name == "llamacpp":
            venv = _peer_venv(a.llamacpp_venv, "llamacpp")
            if has_module(venv, "llama_cpp"):
                specs.append(llamacpp_spec(venv, gguf, SERVED_NAME, cores, shlex.split(a.llamacpp_args)))
            else:
                skipped.append(f"llamacpp: no llama_cpp in venv {venv!r} (axonserve bench setup-peers --llamacpp)")
        elif a.llama_server and os.access(a.llama_server, os.X_OK):
            specs.append(llama_server_spec(a.llama_server, gguf, SERVED_NAME, cores, max_conc, []))
        else:
            skipped.append("llama-server: no binary given (--llama-server PATH to the C++ server)")
    for s in specs:
        s.start_timeout_s = a.start_timeout or s.start_timeout_s
    return specs, skipped


def run_server(spec: ServerSpec, work: Workload, opts: LevelOptions, tok: Any, keep_logs: bool) -> dict:
    print(f"\n### {spec.name}: starting ({' '.join(spec.cmd[:6])} ...)", flush=True)
    opts = LevelOptions(**{**opts.__dict__, "extra_body": {**spec.extra_body, **opts.extra_body}})
    try:
        with launch(spec, keep_log=keep_logs) as srv:
            print(f"### {spec.name}: healthy after {srv.startup_s:.1f} s", flush=True)
            model = spec.model or discover_model(srv.base_url)
            runs = run_levels(
                srv.base_url,
                model,
                work,
                opts,
                tok,
                engine=spec.name,
                pgids={srv.proc.pid},
                probe=lambda: spec_counters(srv.base_url),
            )
            spec_stats = spec_summary(spec_counters(srv.base_url))
        for r in runs:  # each level's own speculation: acceptance differs with the batch
            level = spec_summary(r.pop("probe_delta", {}))
            if level:
                r["spec_decode"] = level
        out = {"engine": spec.name, "startup_s": srv.startup_s, "note": spec.note, "runs": runs}
        if spec_stats:
            out["spec_decode"] = spec_stats
            print(f"### {spec.name}: speculative decoding {spec_stats}", flush=True)
        return out
    except Exception as e:  # one broken peer must not lose the others' numbers
        print(f"### {spec.name}: FAILED: {e}", file=sys.stderr, flush=True)
        return {"engine": spec.name, "error": str(e)[-2000:], "runs": []}


def spec_counters(base_url: str) -> dict[str, float]:
    """vLLM's spec_decode counters on /metrics (per position as `pos<i>`); {} when unreadable."""
    import httpx

    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_") or "_created" in line:
            continue
        name, value = line.rsplit(" ", 1)
        if "position=" in name:
            out["pos" + name.split('position="')[1].split('"')[0]] = float(value)
        else:
            out[name.split("{")[0].removeprefix("vllm:spec_decode_").removesuffix("_total")] = float(value)
    return out


def spec_summary(c: dict[str, float]) -> dict:
    """Mean accepted length and acceptance by position from spec_decode counters (or the part
    of them one level added); {} when nothing was verified."""
    drafts = c.get("num_drafts", 0.0)
    if not drafts:
        return {}
    accepted = c.get("num_accepted_tokens", 0.0)
    pos = sorted(int(k[3:]) for k in c if k.startswith("pos"))
    return {
        "verifications": int(drafts),
        "draft_tokens": int(c.get("num_draft_tokens", 0)),
        "accepted_tokens": int(accepted),
        "mean_accepted_length": round(1 + accepted / drafts, 3),
        "acceptance_by_position": [round(c[f"pos{i}"] / drafts, 3) for i in pos],
    }


def run_transformers(model_dir: str, work: Workload, concs: list[int | None], tok: Any, timeout_s: float) -> dict:
    """Static batches of 1 and of each concurrency, on the first prompts of each level."""
    batches: dict[str, list[list[int]]] = {}
    for level, c in enumerate(concs):
        specs = work.specs((tok, work.vocab_size), level, c)
        ids = [
            s.prompt if isinstance(s.prompt, list) else tok.encode(s.prompt, add_special_tokens=False) for s in specs
        ]
        n = min(c or len(ids), len(ids))
        if len({len(x) for x in ids[:n]}) != 1:
            ids = [x[: min(map(len, ids[:n]))] for x in ids]  # static batch: equal lengths
        batches[str(n)] = ids[:n]
    print(f"\n### transformers: static batches {list(batches)} (fp32, greedy)", flush=True)
    with tempfile.TemporaryDirectory() as d:
        pfile, ofile = os.path.join(d, "prompts.json"), os.path.join(d, "out.json")
        with open(pfile, "w") as f:
            json.dump(batches, f)
        cmd = [
            sys.executable,
            "-m",
            "axonserve.bench.hf_floor",
            "--model-dir",
            model_dir,
            "--prompts",
            pfile,
            "--output-len",
            str(work.output_len),
            "--out",
            ofile,
        ]
        proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
        mon = LoadMonitor({proc.pid})
        mon.start()
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            stop_group(proc, 5.0)
        load = mon.stop()
        if rc != 0:
            return {"engine": "transformers", "error": f"exit {rc}", "runs": []}
        with open(ofile) as f:
            raw = json.load(f)
    runs = []
    for r in raw:
        label = f"transformers batch={r['batch']}"
        # load covers the whole subprocess (model load + all batches), not one batch
        runs.append(
            {
                "engine": "transformers",
                "label": label,
                "concurrency": r["batch"],
                "summary": r["summary"],
                "load": load,
                "requests": r["requests"],
            }
        )
        print_summary(label, r["summary"], load)
    return {"engine": "transformers", "note": "fp32 static batch", "runs": runs}


def _f(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def table(engines: list[dict]) -> str:
    """Markdown table; `axon÷` columns are axonserve's figure over this engine's at the same
    concurrency (tok/s: >1 means axonserve is faster; TTFT/ITL: <1 means axonserve is faster)."""
    base = {r["concurrency"]: r["summary"] for e in engines if e["engine"] == "axonserve" for r in e["runs"]}
    head = (
        "| engine | conc | out tok/s | axon÷ tok/s | req/s | TTFT p50 ms | axon÷ TTFT | ITL p50 ms "
        "| axon÷ ITL | TPOT p50 ms | accepted len | ok/failed | startup s | load1 start→end "
        "| other procs (cores) |"
    )
    ncol = head.count("|") - 1
    rows = [head, "|" + "---|" * ncol]
    for e in engines:
        if e.get("error"):
            rows.append(f"| {e['engine']} | - | FAILED: {e['error'].splitlines()[0][:80]} |" + " |" * (ncol - 3))
            continue
        for r in e["runs"]:
            s, b, ld = r["summary"], base.get(r["concurrency"]), r.get("load") or {}

            def ratio(key: str, sub: str | None = None, b: dict | None = b, s: dict = s) -> str:
                if b is None:
                    return "-"
                x, y = (b[key][sub], s[key][sub]) if sub else (b[key], s[key])
                return "-" if not x or not y else f"{x / y:.2f}"

            rows.append(
                f"| {e['engine']} | {r['concurrency']} | {s['output_throughput']:.1f} | {ratio('output_throughput')} "
                f"| {s['request_throughput']:.2f} | {_f(s['ttft_ms']['p50'], 0)} | {ratio('ttft_ms', 'p50')} "
                f"| {_f(s['itl_ms']['p50'])} | {ratio('itl_ms', 'p50')} | {_f(s['tpot_ms']['p50'])} "
                f"| {_f(r.get('spec_decode', {}).get('mean_accepted_length'), 2)} "
                f"| {s['completed']}/{s['failed']} | {_f(e.get('startup_s'))} "
                f"| {_f(ld.get('loadavg_start', [None])[0], 2)}→{_f(ld.get('loadavg_end', [None])[0], 2)} "
                f"| {_f(ld.get('other_cores'), 2)} |"
            )
    return "\n".join(rows)


def cmd_compare(a: argparse.Namespace) -> int:
    from axonserve.bench.serve import tokenizer_for
    from axonserve.neuron.model_source import builtin_smollm2_gguf, resolve_model

    model_dir = resolve_model(a.model)
    gguf = a.gguf or (a.model if a.model and a.model.endswith(".gguf") else None)
    if gguf is None and a.model in (None, "SmolLM2-135M-Instruct"):
        gguf = builtin_smollm2_gguf()
    concs = parse_concurrency(a.concurrency or "1,32")
    work = Workload(
        a.input_len, a.output_len, a.num_prompts, a.prompt_kind, a.prefix_len, a.prefix_groups, a.seed, a.vocab_size
    )
    opts = LevelOptions(
        concs, a.request_rate, a.max_duration, a.warmup, request_extras(a), not a.no_ignore_eos, not a.no_progress
    )
    tok = tokenizer_for(model_dir, a.prompt_kind)
    specs, skipped = build_specs(a, model_dir, gguf, max(c or 1 for c in concs))
    for msg in skipped:
        print(f"skipping {msg}", flush=True)
    if a.repeat < 1:
        print("--repeat must be >= 1", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    if a.repeat > 1:
        return _compare_rounds(a, specs, skipped, work, opts, tok, model_dir, gguf, t0)
    engines = [run_server(s, work, opts, tok, a.keep_logs) for s in specs]
    if "transformers" in a.engines.split(","):
        engines.append(run_transformers(model_dir, work, concs, tok, a.start_timeout or 1800))
    print(
        f"\n## bench compare: {os.path.basename(model_dir)}, input {a.input_len} / output "
        f"{a.output_len} tokens, {a.prompt_kind} prompts, {time.monotonic() - t0:.0f} s total\n"
    )
    print(table(engines))
    for e in engines:
        if e.get("spec_decode"):
            print(f"- {e['engine']}: speculative decoding {e['spec_decode']}")
    for msg in skipped:
        print(f"- skipped {msg}")
    runs = [r for e in engines for r in e["runs"]]
    doc = {
        "kind": "compare",
        "meta": metadata(a),
        "model_dir": model_dir,
        "gguf": gguf,
        "skipped": skipped,
        "engines": [{k: v for k, v in e.items() if k != "runs"} for e in engines],
        "runs": runs,
        "table": table(engines),
    }
    write_outputs(doc, a.out, a.plot, f"bench compare: {os.path.basename(model_dir)}")
    return 0 if all(not e.get("error") for e in engines) else 1


def _compare_rounds(a, specs, skipped, work, opts, tok, model_dir, gguf, t0) -> int:
    """`--repeat N`: N interleaved rounds (bench/repeat.py); medians with their range."""
    from axonserve.bench.repeat import aggregate, machine_probe, repeat_table, round_order

    by_name = {s.name: s for s in specs}
    rounds, probes = [], []
    for r in range(a.repeat):
        probes.append(machine_probe())
        print(f"\n## round {r + 1}/{a.repeat}: machine {probes[-1]}", flush=True)
        rounds.append([run_server(by_name[n], work, opts, tok, a.keep_logs) for n in round_order(list(by_name), r)])
    rows = aggregate(rounds)
    text = repeat_table(rows, probes)
    print(
        f"\n## bench compare x{a.repeat} (interleaved): {os.path.basename(model_dir)}, input {a.input_len} / output "
        f"{a.output_len} tokens, {a.prompt_kind} prompts, {time.monotonic() - t0:.0f} s total; "
        "median [min, max] over rounds\n"
    )
    print(text)
    for msg in skipped:
        print(f"- skipped {msg}")
    doc = {
        "kind": "compare-repeat",
        "meta": metadata(a),
        "model_dir": model_dir,
        "gguf": gguf,
        "skipped": skipped,
        "probes": probes,
        "rows": rows,
        "engines": [
            {k: v for k, v in e.items() if k != "runs"} | {"round": i} for i, es in enumerate(rounds) for e in es
        ],
        "runs": [dict(run, round=i) for i, es in enumerate(rounds) for e in es for run in e["runs"]],
        "table": text,
    }
    write_outputs(doc, a.out, a.plot, f"bench compare x{a.repeat}: {os.path.basename(model_dir)}")
    return 0 if all(not e.get("error") for es in rounds for e in es) else 1


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="axonserve model spec (default: SmolLM2-135M-Instruct)")
    p.add_argument("--gguf", default=None, help="GGUF of the same model for llama.cpp")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {','.join(ENGINES)}")
    p.add_argument("--vllm-venv", default=None, help=f"default: {default_dir()}/vllm if present")
    p.add_argument("--llamacpp-venv", default=None, help=f"default: {default_dir()}/llamacpp if present")
    p.add_argument("--llama-server", default=None, help="path of a built C++ llama-server binary")
    p.add_argument(
        "--axonserve-args",
        default="",
        help="extra `axonserve serve` flags (default none: `--dtype auto`, bf16 only where the CPU has native "
        "bf16; a fixed `--dtype bfloat16` ran 32 streams ~4x slower on an AVX2-only CPU)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="also run axonserve with these extra flags, as engine axonserve[NAME] (repeatable)",
    )
    p.add_argument(
        "--vllm-args",
        default="",
        help="extra vLLM api_server flags (its --dtype is bfloat16 where the CPU has native bf16, else float32)",
    )
    p.add_argument("--llamacpp-args", default="", help="extra llama_cpp.server flags")
    p.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    p.add_argument("--start-timeout", type=float, default=None, help="seconds to wait for health")
    p.add_argument("--keep-logs", action="store_true", help="keep server logs even on success")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds, engines interleaved (A B, B A, ...), each after a machine probe; figures as median [min, max]",
    )
    add_workload_args(p)
    p.set_defaults(func=cmd_compare, prompt_kind="text", concurrency="1,32")
