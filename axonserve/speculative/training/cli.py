"""`axonserve train-eagle` arguments; the heavy imports (torch, the trainer) wait until it runs."""

from __future__ import annotations

import argparse
import json


def tree_shapes(text: str) -> list[tuple[int, int, int]]:
    """'4x4x8,3x3x6' -> [(4, 4, 8), (3, 3, 6)]: depth x width x node budget, all >= 1."""
    try:
        shapes = [tuple(int(x) for x in t.split("x")) for t in text.split(",") if t]
    except ValueError:
        shapes = [()]
    if any(len(t) != 3 or min(t) < 1 for t in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected DEPTHxWIDTHxBUDGET[,...] with positive integers")
    return shapes


def add_train_eagle_parser(sub) -> None:
    p = sub.add_parser("train-eagle", help="self-distil an EAGLE draft head for a model (CPU, time-boxed)")
    p.add_argument("model", help="model name, .gguf file or directory")
    p.add_argument("--out", required=True, help="directory for the head (safetensors + eagle_config.json + report)")
    p.add_argument("--time-budget", type=float, default=900.0, help="seconds for generation + training")
    p.add_argument("--num-prompts", type=int, default=None, help="training prompts (each run greedy and sampled)")
    p.add_argument(
        "--first-prompt",
        type=int,
        default=0,
        help="start at this training prompt (a second data cache then holds other prompts than the first)",
    )
    p.add_argument("--num-eval-prompts", type=int, default=None, help="held-out prompts for acceptance")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (most frequent outputs)")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument(
        "--data-fraction",
        type=float,
        default=0.5,
        help="share of the budget for generating data and recording its features",
    )
    p.add_argument("--init", choices=["random", "last"], default="random", help="layer init: random or target's last")
    p.add_argument("--resume", default="", help="go on training the head in this directory (keeps its draft vocab)")
    p.add_argument("--ce-weight", type=float, default=0.1, help="weight of the token loss beside the feature loss")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--ttt-steps", type=int, default=1, help="chained steps trained per position (1: plain EAGLE-1)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-tokens", type=int, default=1024)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument(
        "--data-cache",
        default="",
        help="load generated data + features from here (.pt; comma-separated: "
        "their union) when it exists, else generate and save it there",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads here and in the engine (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mixed-precision", action="store_true", help="train in float32 even where bf16 is native")
    p.add_argument(
        "--tree-report",
        type=tree_shapes,
        default=[],
        metavar="DxWxB,...",
        help="also simulate tree drafting: depth x width x node budget shapes (minutes each)",
    )
    p.add_argument("--no-latency", action="store_true", help="skip the draft-step timing")
    p.set_defaults(func=cmd_train_eagle)


def cmd_train_eagle(args: argparse.Namespace) -> int:
    import torch

    from axonserve.speculative.training.train import TrainConfig, train_eagle

    engine = {}
    if args.threads:
        torch.set_num_threads(args.threads)
        engine["threads"] = args.threads
    cfg = TrainConfig(
        lr=args.lr,
        batch_tokens=args.batch_tokens,
        ttt_steps=args.ttt_steps,
        seed=args.seed,
        ce_weight=args.ce_weight,
        warmup_steps=args.warmup_steps,
        mixed_precision=not args.no_mixed_precision,
    )
    report = train_eagle(
        args.model,
        args.out,
        args.time_budget,
        args.num_prompts,
        args.draft_vocab,
        args.max_new_tokens,
        args.data_fraction,
        args.num_eval_prompts,
        init=args.init,
        cfg=cfg,
        data_cache=args.data_cache,
        max_steps=args.max_steps,
        latency=not args.no_latency,
        first_prompt=args.first_prompt,
        resume=args.resume,
        trees=tuple(args.tree_report),
        **engine,
    )
    print(json.dumps({k: report[k] for k in ("head_dir", "data", "val_top1", "acceptance") if k in report}, indent=1))
    return 0
