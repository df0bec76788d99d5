"""Tiny LLaVA through the real engine processes (supervisor, scheduler, worker, and with
`encoder_workers` the router and encoder pool): greedy output equals transformers'
LlavaForConditionalGeneration for single- and multi-image prompts batched with text-only
ones, and a repeated image is served from the encoder cache instead of being re-encoded."""

from __future__ import annotations

import asyncio

import pytest
from conftest import data_url, hf_llava_greedy, png_bytes

from axonserve.actors.supervisor import Supervisor
from axonserve.config import EngineConfig
from axonserve.frontends.client import AsyncEngineClient
from axonserve.multimodal.frontend import ImageInputs, take_images
from axonserve.protocol.messages import SamplingParams

N = 8


def chat(*parts) -> list[dict]:
    """One user message: str parts are text, bytes parts are images."""
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": data_url(p)}}
        for p in parts
    ]
    return [{"role": "user", "content": content}]


CASES = [
    chat("Describe ", png_bytes(1), " briefly."),
    chat("Compare ", png_bytes(2), " and ", png_bytes(3), "."),
    chat("Just text, no image at all."),
    chat("Again: ", png_bytes(1), " what is it?"),  # image 1 repeated: an encoder-cache hit
]


def swap_images(messages: list[dict], image: bytes) -> list[dict]:
    """The same messages with every image replaced by `image`."""
    return [
        {
            **m,
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}} if p.get("type") == "image_url" else p
                for p in m["content"]
            ],
        }
        for m in messages
    ]


def render(tokenizer, messages: list[dict], image_token: str) -> tuple[str, list[bytes]]:
    """The prompt text HF's processor gets (one image token per image) and the image bytes."""
    import base64

    flat, urls = take_images(messages, image_token)
    flat = [{**m, "content": "".join(p["text"] for p in m["content"])} for m in flat]
    text = tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    return text, [base64.b64decode(u.split(",", 1)[1]) for u in urls]


async def run_engine(config: EngineConfig, cases: list[list[dict]]):
    sup = Supervisor(config, frontend=False)
    await sup.start()
    client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
    try:
        images = ImageInputs.load(config.model, client.tokenizer.hf, config)
        assert images is not None
        params = SamplingParams(temperature=0.0, max_tokens=N, min_tokens=N)

        cached: list[int] = []

        async def one(i: int, messages: list[dict]) -> tuple[list[int], list[int]]:
            await asyncio.sleep(0.03 * i)  # later ones join while earlier ones decode
            msgs, urls = take_images(messages, images.image_token)
            ids = client.tokenizer.encode_chat(msgs)
            mm = None
            if urls:
                ids, mm = images.prepare(ids, urls)
            toks: list[int] = []
            async for out in client.generate(ids, params, images=mm):
                assert out.error is None, out.error
                toks.extend(out.token_ids)
            cached.append(out.num_cached_tokens)
            return ids, toks

        got = await asyncio.wait_for(asyncio.gather(*(one(i, c) for i, c in enumerate(cases))), 240)
        stats = await client.get_stats()
        # prefix cache: the same prompt with the same image hits, with another image it must not
        cached.clear()
        await one(0, cases[0])
        await one(0, swap_images(cases[0], png_bytes(99)))
        return got, stats, cached
    finally:
        client.close()
        await sup.stop("test done")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("encoders", [0, 2], ids=["in-worker", "encoder-pool"])
async def test_llava_greedy_matches_transformers(tiny_llava_dir, encoders):
    from transformers import AutoTokenizer

    config = EngineConfig(
        model=tiny_llava_dir,
        block_size=4,
        num_kv_blocks=400,
        max_num_batched_tokens=32,
        encoder_workers=encoders,
        log_level="warning",
        threads=1,
    )
    got, stats, (same_image, other_image) = await run_engine(config, CASES)
    tok = AutoTokenizer.from_pretrained(tiny_llava_dir)
    for (ids, toks), messages in zip(got, CASES):
        text, imgs = render(tok, messages, "<image>")
        want_ids, want = hf_llava_greedy(tiny_llava_dir, text, imgs, N)
        assert ids == want_ids  # placeholder expansion as LlavaProcessor's
        assert toks == want
    assert stats.mm_images == 4
    assert same_image > 0 and other_image == 0  # image hashes are part of the block hashes
    if encoders:
        assert stats.mm_cache_hits >= 1  # the repeated image was not encoded again
