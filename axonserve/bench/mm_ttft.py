"""TTFT of image and text chats under a mixed load, with and without the encoder pool.

    python -m axonserve.bench.mm_ttft [--requests 48 --concurrency 8 --image-fraction 0.5]

No vision-language weights exist offline, so a random LLaVA is built (transformers' own
classes, saved as safetensors, SmolLM2's tokenizer plus `<image>`), with a vision tower big
enough that encoding costs something. Then `axonserve serve` runs once per
`--encoder-workers` value and the same request mix (seeded; a share of the images repeat)
is sent to each; per request kind the TTFT distribution is printed as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import tempfile
import time
from typing import Any

from axonserve.bench.servers import axonserve_spec, launch
from axonserve.bench.stats import distribution

# ViT-S/16-like tower at 224 px (196 image tokens); a 4-layer decoder
BENCH_VISION = dict(
    hidden_size=384, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=6, image_size=224, patch_size=16
)
BENCH_TEXT = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)


def make_random_llava(out_dir: str, tokenizer_dir: str, vision: dict, text: dict, seed: int = 0) -> str:
    """A random-weight LLaVA with a LlavaProcessor (the tokenizer plus an `<image>` token and a
    CLIPImageProcessor at the tower's size). Matrices N(0, 0.1) so greedy logits are well apart."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(["<image>"], special_tokens=True)
    image_id = tok.convert_tokens_to_ids("<image>")
    size, patch = vision["image_size"], vision["patch_size"]
    text = {
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "max_position_embeddings": 1024,
        **text,
        "vocab_size": len(tok) + 7,
        "model_type": "llama",
    }
    vision = {**vision, "model_type": "clip_vision_model", "projection_dim": vision["hidden_size"]}
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=(size // patch) ** 2,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    images = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tok.chat_template,
    ).save_pretrained(out_dir)
    return out_dir


def png_bytes(seed: int, size: tuple[int, int] = (256, 256)) -> bytes:
    """A random RGB PNG of `size` (width, height)."""
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def png_data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(seed)).decode()


def workload(n: int, image_fraction: float, repeat_fraction: float, seed: int) -> list[tuple[str, list]]:
    """(kind, content parts) per request; `repeat_fraction` of the image requests reuse an image."""
    rng = random.Random(seed)
    out, seen = [], []
    for i in range(n):
        words = " ".join(rng.choice(["red", "blue", "tree", "river", "cat", "house", "sky"]) for _ in range(12))
        if rng.random() < image_fraction:
            img = rng.choice(seen) if seen and rng.random() < repeat_fraction else 1000 + i
            seen.append(img)
            out.append(
                (
                    "image",
                    [
                        {"type": "text", "text": f"Describe this: {words}"},
                        {"type": "image_url", "image_url": {"url": png_data_url(img)}},
                    ],
                )
            )
        else:
            out.append(("text", [{"type": "text", "text": f"Tell me about {words}"}]))
    return out


async def run_load(base_url: str, reqs: list[tuple[str, list]], concurrency: int, max_tokens: int) -> dict:
    import httpx

    ttft: dict[str, list[float]] = {"image": [], "text": []}
    errors = 0
    sem = asyncio.Semaphore(concurrency)

    async def one(http: httpx.AsyncClient, kind: str, content: list) -> None:
        nonlocal errors
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        async with sem:
            t0 = time.perf_counter()
            async with http.stream("POST", base_url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    errors += 1
                    return
                first = None
                async for line in r.aiter_lines():
                    if (
                        first is None
                        and line.startswith("data: {")
                        and '"content":"' in line
                        and '"content":""' not in line
                    ):
                        first = time.perf_counter() - t0
                if first is not None:
                    ttft[kind].append(first)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(*(one(http, k, c) for k, c in reqs))
    return {
        "duration_s": round(time.perf_counter() - t0, 2),
        "errors": errors,
        **{f"ttft_{k}": distribution(v) for k, v in ttft.items()},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--image-fraction", type=float, default=0.5)
    p.add_argument("--repeat-fraction", type=float, default=0.25)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--encoder-workers", type=int, nargs="+", default=[0, 1])
    p.add_argument("--model-dir", default="", help="reuse a model made earlier (default: build one in a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from axonserve.neuron.model_source import resolve_model

    model = a.model_dir or make_random_llava(
        tempfile.mkdtemp(prefix="mm-bench-"), resolve_model(None), BENCH_VISION, BENCH_TEXT, a.seed
    )
    reqs = workload(a.requests, a.image_fraction, a.repeat_fraction, a.seed)
    report: dict[str, Any] = {
        "model": model,
        "cores": len(os.sched_getaffinity(0)),
        "requests": a.requests,
        "concurrency": a.concurrency,
        "image_fraction": a.image_fraction,
        "runs": {},
    }
    for n in a.encoder_workers:
        spec = axonserve_spec(
            model,
            [
                "--served-model-name",
                "m",
                "--encoder-workers",
                str(n),
                "--max-model-len",
                "1024",
                "--log-level",
                "warning",
            ],
        )
        with launch(spec) as srv:
            asyncio.run(run_load(srv.base_url, reqs[: a.concurrency], a.concurrency, a.max_tokens))  # warm-up
            report["runs"][f"encoder_workers={n}"] = asyncio.run(
                run_load(srv.base_url, reqs, a.concurrency, a.max_tokens)
            )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
