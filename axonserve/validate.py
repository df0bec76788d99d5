"""Accuracy debugger: `axonserve validate MODEL` compares axonserve against transformers.

The prompts run through the real engine (the offline `LLM`: supervisor, scheduler, worker and
snapshot sink processes), greedy, with snapshot rules that capture every request's inputs,
per-layer hidden states and raw logits. transformers then runs the same token sequences
(teacher forcing on axonserve's output, the same `LayerCapture` hooks on its decoder layers)
and its own greedy `generate`. Per generated token: max |Δlogit|, KL(ref ‖ ours), top-1 and
top-k agreement; per request: greedy sequence agreement (a flip between near-tied logits is
reported, not failed); per layer: max |Δhidden| relative to the reference's magnitude, and the
first layer past `hidden_rtol` — where the drift starts when the logits disagree.

`--reference DIR` compares against another checkpoint (e.g. the original when MODEL is a
converted or quantized copy); by default the reference loads MODEL itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]
# float32 engine vs float32 transformers differ by summation order only; low-precision
# engines need looser bounds (pass --atol / --hidden-rtol)
DEFAULT_TOL = {"float32": (1e-2, 1e-3), "bfloat16": (1.0, 0.25), "float16": (0.5, 0.1)}
# weight-quantized serving (`-q`), any dtype: the format's own bound. Measured on SmolLM2-135M,
# 4 prompts x 32 tokens (bf16 for comparison: max |Δlogit| 0.56-1.28, KL mean 0.001-0.002):
# int8 1.26-1.93 (KL 0.003-0.005), int4 3.8-5.4 (KL 0.03-0.06), fp8 (e4m3, a scale per row) 3.1-7.3
# (KL 0.023-0.036, hidden drift <= 0.26 at the last layer: 3 mantissa bits per weight)
QUANT_TOL = {"int8": (3.0, 0.25), "int4": (8.0, 0.5), "fp8": (10.0, 0.4)}
# a quantized KV cache (`--kv-cache-dtype`), on top of the dtype's (and any -q format's) bound.
# Measured the same way (bf16): fp8 (e4m3) 1.13-3.55 (KL 0.003-0.007, hidden drift <= 0.18),
# fp8_e5m2 2.85-4.93 (KL 0.009-0.032, hidden drift <= 0.25: two mantissa bits)
KV_TOL = {"fp8": (5.0, 0.25), "fp8_e4m3": (5.0, 0.25), "fp8_e5m2": (7.0, 0.4)}
# int8 activations (`--activation-quantization int8`, GGUF block codes in float32), measured the same
# way on SmolLM2's Q4_1 GGUF against transformers on the same dequantized weights: 1.03-1.74
# (KL mean 0.002-0.004, hidden drift <= 0.061; one near-tie flipped after 26 tokens)
ACT_TOL = {"int8": (3.0, 0.25)}


def default_tolerances(
    dtype: str, quantization: str = "", kv_cache_dtype: str = "auto", activation_quantization: str = ""
) -> tuple[float, float]:
    """(atol, hidden_rtol): the loosest of the dtype's, the weight format's, the KV format's and the
    activation format's bounds."""
    bounds = [
        DEFAULT_TOL.get(dtype, DEFAULT_TOL["float32"]),
        QUANT_TOL.get(quantization),
        KV_TOL.get(kv_cache_dtype),
        ACT_TOL.get(activation_quantization),
    ]
    present = [b for b in bounds if b is not None]
    return max(b[0] for b in present), max(b[1] for b in present)


@dataclass
class Tolerances:
    atol: float  # max |Δlogit| per generated token
    hidden_rtol: float  # max |Δhidden| / max |hidden_ref| per layer
    topk: int = 5


@dataclass
class RequestReport:
    index: int
    prompt: str | None
    num_prompt_tokens: int
    tokens: list[int]  # axonserve's greedy output
    ref_tokens: list[int]  # transformers' greedy output
    first_mismatch: int | None  # index into the output, None when equal
    mismatch_is_tie: bool  # the flip was between logits closer than atol
    logits_max_abs: float
    kl_max: float
    kl_mean: float
    top1_agreement: float
    topk_overlap: float
    layer_rel_diff: list[float]  # per decoder layer
    first_divergent_layer: int | None
    passed: bool
    why: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- inputs


def load_prompts(path: str | None) -> list[str | list[int]]:
    """A .json list, .jsonl lines (strings, token-id lists or {"prompt": ...}) or plain text
    (one prompt per line)."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    with open(path) as f:
        text = f.read()
    if path.endswith(".json"):
        items = json.loads(text)
    elif path.endswith(".jsonl"):
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        items = [line for line in text.splitlines() if line.strip()]
    prompts = [it["prompt"] if isinstance(it, dict) else it for it in items]
    if not prompts or not all(isinstance(p, str) or (isinstance(p, list) and p) for p in prompts):
        raise ValueError(f"{path}: expected a non-empty list of prompts (strings or token-id lists)")
    return prompts


# --------------------------------------------------------------------------- the two sides


def run_engine(
    model_dir: str, prompts: list[str | list[int]], max_tokens: int, dtype: str, snapshot_dir: str, **config: Any
) -> tuple[str, list[tuple[str, list[int], list[int]]]]:
    """Greedy generation on axonserve with full snapshots: the sink's run id and, per prompt,
    (request id, prompt ids, output)."""
    from axonserve.actors.snapshot import read_index
    from axonserve.config import EngineConfig
    from axonserve.frontends.offline import LLM
    from axonserve.neuron.snapshot import SnapshotRules
    from axonserve.protocol.messages import SamplingParams

    cfg = EngineConfig(
        model=model_dir,
        served_model_name="validate",
        dtype=dtype,
        enable_prefix_caching=False,  # every position of every prompt is computed (and captured)
        snapshot=SnapshotRules().to_json(),
        snapshot_dir=snapshot_dir,
        log_level=config.pop("log_level", "warning"),
        **config,
    )
    llm = LLM(config=cfg)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params)
    finally:
        llm.shutdown()  # the sink drains and writes its final index
    records = read_index(snapshot_dir)["records"]
    run = max((r["run"] for r in records), default="")  # this engine's (the dir may hold older runs)
    ids = sorted({r["request_id"] for r in records if r["run"] == run})
    result = []
    for i, out in enumerate(outs):
        match = [r for r in ids if r.rsplit("-", 1)[-1] == str(i)]
        if len(match) != 1:
            raise RuntimeError(f"prompt {i}: expected one snapshot request, found {match}")
        result.append((match[0], list(out.prompt_token_ids), list(out.outputs[0].token_ids)))
    return run, result


def load_reference(ref_dir: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()


def reference_pass(model: Any, ids: list[int]) -> tuple[Any, dict[int, Any]]:
    """transformers' logits [T, V] and decoder-layer outputs {layer: [T, H]} for `ids`."""
    import torch

    from axonserve.neuron.snapshot import LayerCapture

    cap = LayerCapture(model)
    try:
        cap.arm()
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0].float()
        return logits, cap.disarm()
    finally:
        cap.close()


def reference_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


# --------------------------------------------------------------------------- comparison


def compare(
    index: int,
    prompt: str | None,
    prompt_ids: list[int],
    tokens: list[int],
    snap: dict[str, Any],
    model: Any,
    tol: Tolerances,
) -> RequestReport:
    """One request: axonserve's snapshot (`load_request`) against transformers."""
    import torch

    p, g = len(prompt_ids), len(tokens)
    seq = prompt_ids + tokens[:-1]  # every position the engine computed
    ref_logits, ref_hidden = reference_pass(model, seq)
    why = []
    got_ids = snap.get("input_ids")
    if got_ids is None or got_ids.tolist() != seq:
        raise RuntimeError(
            f"prompt {index}: the snapshot's input tokens are not prompt + output "
            f"(incomplete capture? {0 if got_ids is None else len(got_ids)} of {len(seq)} positions)"
        )
    if "logits" not in snap or snap["logit_steps"].tolist() != list(range(g)):
        raise RuntimeError(f"prompt {index}: the snapshot lacks logits for some of the {g} steps")
    ours = snap["logits"].float()
    ref = ref_logits[p - 1 : p - 1 + g]
    diff = (ours - ref).abs().amax(dim=-1)
    lp_ref, lp_ours = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
    kl = (lp_ref.exp() * (lp_ref - lp_ours)).sum(-1).clamp_min(0)
    k = min(tol.topk, ref.shape[-1])
    top_r, top_o = ref.topk(k).indices, ours.topk(k).indices
    overlap = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(top_r, top_o)])
    top1 = (top_r[:, 0] == top_o[:, 0]).float()

    layers = []
    for i in sorted(ref_hidden):
        name = f"hidden.{i}"
        if name not in snap:
            raise RuntimeError(f"prompt {index}: the snapshot lacks {name}")
        h_ref = ref_hidden[i].float()
        layers.append(((snap[name].float() - h_ref).abs().max() / h_ref.abs().max().clamp_min(1e-12)).item())
    first_layer = next((i for i, d in enumerate(layers) if d > tol.hidden_rtol), None)

    ref_tokens = reference_greedy(model, prompt_ids, g)
    mismatch = next((j for j, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    tie = False
    if mismatch is not None:  # same prefix up to here, so teacher-forced row p-1+mismatch applies
        row = ref_logits[p - 1 + mismatch]
        tie = abs(row[tokens[mismatch]].item() - row[ref_tokens[mismatch]].item()) <= tol.atol
    logits_max = diff.max().item() if g else 0.0
    if logits_max > tol.atol:
        why.append(
            f"max |Δlogit| {logits_max:.3g} > atol {tol.atol:g} (first at output token "
            f"{int((diff > tol.atol).nonzero()[0, 0])})"
        )
    if mismatch is not None and not tie:
        why.append(f"greedy output differs from transformers at token {mismatch}")
    if why:
        where = (
            f"first decoder layer past hidden_rtol {tol.hidden_rtol:g}: {first_layer}"
            if first_layer is not None
            else "no decoder layer past hidden_rtol: the drift is in the final norm / lm_head / sampling"
        )
        why.append(where)
    return RequestReport(
        index=index,
        prompt=prompt,
        num_prompt_tokens=p,
        tokens=tokens,
        ref_tokens=ref_tokens,
        first_mismatch=mismatch,
        mismatch_is_tie=tie,
        logits_max_abs=logits_max,
        kl_max=kl.max().item() if g else 0.0,
        kl_mean=kl.mean().item() if g else 0.0,
        top1_agreement=top1.mean().item() if g else 1.0,
        topk_overlap=overlap.mean().item() if g else 1.0,
        layer_rel_diff=layers,
        first_divergent_layer=first_layer,
        passed=not why,
        why=why,
    )


def validate(
    model: str,
    *,
    reference: str | None = None,
    prompts: list[str | list[int]] | None = None,
    max_tokens: int = 8,
    dtype: str = "float32",
    atol: float | None = None,
    hidden_rtol: float | None = None,
    topk: int = 5,
    snapshot_dir: str | None = None,
    **config: Any,
) -> dict[str, Any]:
    """Run the whole comparison; returns the report (see `RequestReport`)."""
    from axonserve.actors.snapshot import load_request
    from axonserve.neuron.model_source import resolve_model

    if max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    model_dir = resolve_model(model)
    ref_dir = resolve_model(reference) if reference else model_dir
    d_atol, d_rtol = default_tolerances(
        dtype,
        config.get("quantization") or "",
        config.get("kv_cache_dtype") or "auto",
        config.get("activation_quantization") or "",
    )
    tol = Tolerances(atol if atol is not None else d_atol, hidden_rtol if hidden_rtol is not None else d_rtol, topk)
    prompts = list(prompts or DEFAULT_PROMPTS)
    with tempfile.TemporaryDirectory(prefix="axonserve-validate-") as tmp:
        snap_dir = snapshot_dir or tmp
        run, runs = run_engine(model_dir, prompts, max_tokens, dtype, snap_dir, **config)
        ref_model = load_reference(ref_dir)
        reports = []
        for i, ((rid, ids, toks), prompt) in enumerate(zip(runs, prompts)):
            snap = load_request(snap_dir, rid, run)
            reports.append(compare(i, prompt if isinstance(prompt, str) else None, ids, toks, snap, ref_model, tol))
    num_layers = max((len(r.layer_rel_diff) for r in reports), default=0)
    per_layer = [max(r.layer_rel_diff[i] for r in reports) for i in range(num_layers)]
    firsts = [r.first_divergent_layer for r in reports if r.first_divergent_layer is not None]
    return {
        "model": model_dir,
        "reference": ref_dir,
        "dtype": dtype,
        "max_tokens": max_tokens,
        "tolerances": asdict(tol),
        "passed": all(r.passed for r in reports),
        "first_divergent_layer": min(firsts) if firsts else None,
        "layer_rel_diff": per_layer,
        "requests": [asdict(r) for r in reports],
    }


# --------------------------------------------------------------------------- output


def format_report(rep: dict[str, Any]) -> str:
    from axonserve.actors.snapshot import format_table

    tol = rep["tolerances"]
    rows = []
    for r in rep["requests"]:
        seq = (
            "yes"
            if r["first_mismatch"] is None
            else f"no@{r['first_mismatch']}" + (" (tie)" if r["mismatch_is_tie"] else "")
        )
        layer = "-" if r["first_divergent_layer"] is None else str(r["first_divergent_layer"])
        rows.append(
            [
                str(r["index"]),
                str(r["num_prompt_tokens"]),
                str(len(r["tokens"])),
                seq,
                f"{r['logits_max_abs']:.3g}",
                f"{r['kl_max']:.3g}",
                f"{r['top1_agreement']:.2f}",
                f"{r['topk_overlap']:.2f}",
                layer,
                "PASS" if r["passed"] else "FAIL",
            ]
        )
    out = [
        format_table(
            rows,
            [
                "prompt",
                "in",
                "out",
                "greedy_match",
                "max|dlogit|",
                "kl_max",
                "top1",
                f"top{tol['topk']}",
                "drift_layer",
                "status",
            ],
        )
    ]
    out.append("")
    layer_rows = [
        [str(i), f"{d:.3g}", "ok" if d <= tol["hidden_rtol"] else "DRIFT"] for i, d in enumerate(rep["layer_rel_diff"])
    ]
    out.append(format_table(layer_rows, ["layer", "max|dh|/max|h|", f"rtol {tol['hidden_rtol']:g}"]))
    out.append("")
    for r in rep["requests"]:
        for w in r["why"]:
            out.append(f"prompt {r['index']}: {w}")
    verdict = "PASS" if rep["passed"] else "FAIL"
    if rep["first_divergent_layer"] is not None:
        out.append(f"first decoder layer drifting past tolerance: {rep['first_divergent_layer']}")
    out.append(f"{verdict}: {len(rep['requests'])} prompts, atol {tol['atol']:g}, hidden_rtol {tol['hidden_rtol']:g}")
    return "\n".join(out)


def add_validate_parser(sub: Any) -> None:
    from axonserve.config import ACTIVATION_QUANTIZATIONS, KV_CACHE_DTYPES, QUANTIZATIONS

    p = sub.add_parser(
        "validate",
        help="compare axonserve's logits and hidden states with transformers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        nargs="?",
        default="SmolLM2-135M-Instruct",
        help="model directory, .gguf file, or SmolLM2-135M-Instruct (default)",
    )
    p.add_argument("--reference", default=None, help="reference checkpoint for transformers (default: MODEL)")
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="prompts: .json list, .jsonl, or text with one prompt per line (default: built-in set)",
    )
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per prompt")
    p.add_argument("--report", default=None, metavar="FILE", help="write the JSON report here")
    p.add_argument(
        "--atol",
        type=float,
        default=None,
        help="max |Δlogit| per token (default 1e-2 for float32, 1.0 for bfloat16, 3 with int8, 8 with int4, "
        "10 with fp8; a quantized KV cache: validate.KV_TOL)",
    )
    p.add_argument(
        "--hidden-rtol",
        type=float,
        default=None,
        help="max |Δhidden|/max|hidden| per layer (default 1e-3 for float32, 0.25 for bfloat16 and int8, "
        "0.5 with int4)",
    )
    p.add_argument("--topk", type=int, default=5, help="k for top-k agreement")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--quantization",
        "-q",
        default="",
        choices=["", *QUANTIZATIONS],
        help="serve the model weight-quantized (as `serve -q`): measures what the format costs",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="serve with this KV cache storage (as `serve --kv-cache-dtype`): measures what the format costs",
    )
    p.add_argument(
        "--activation-quantization",
        default="",
        choices=["", *ACTIVATION_QUANTIZATIONS],
        help="serve with int8 activations (as `serve --activation-quantization`): measures what they cost",
    )
    p.add_argument("--snapshot-dir", default=None, help="keep the engine's snapshots here (default: temporary)")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--log-format", default="console", choices=["console", "json"])
    p.set_defaults(func=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    """Exit status: 0 pass, 1 fail, 2 could not run (bad input, engine error)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        rep = validate(
            args.model,
            reference=args.reference,
            prompts=load_prompts(args.prompts),
            max_tokens=args.max_tokens,
            dtype=args.dtype,
            atol=args.atol,
            hidden_rtol=args.hidden_rtol,
            topk=args.topk,
            snapshot_dir=args.snapshot_dir,
            num_kv_blocks=args.num_kv_blocks,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            activation_quantization=args.activation_quantization,
            log_level=args.log_level,
            log_format=args.log_format,
        )
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(rep))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(rep, f, indent=1)
    sys.stdout.flush()
    return 0 if rep["passed"] else 1
