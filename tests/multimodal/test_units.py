"""The multimodal and KV-transfer pieces on their own: the scheduler's image checks (every
malformed input a reason, never a worker error), the router's byte-bounded feature cache,
placeholder rows of a flat batch, KV export/import across different block sizes, and the
CLIP tower + projector against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from axonserve.multimodal.router import FeatureCache
from axonserve.multimodal.scheduler import ImageSpec, check_images
from axonserve.multimodal.worker import RequestImages, batch_rows
from axonserve.neuron.kv_transfer import export_kv, import_kv
from axonserve.protocol import Codec, TensorRef
from axonserve.protocol.messages import MultiModalInput

SPEC = ImageSpec(image_token_id=9, tokens_per_image=4, image_size=8, hidden_size=6)


def frames_for(*arrays) -> list:
    return Codec.encode(MultiModalInput([], [], []), arrays)  # frame 0: a body, then the buffers


def test_check_images_accepts_a_well_formed_input():
    prompt = [1, 9, 9, 9, 9, 2, 9, 9, 9, 9]
    px = np.zeros((2, 3, 8, 8), np.float32)
    mm = MultiModalInput(["a", "b"], [1, 6], [4, 4], pixel_values=TensorRef(1, "float32", [2, 3, 8, 8]))
    why, frames = check_images(mm, prompt, frames_for(px), SPEC)
    assert why is None and len(frames["pixel_values"]) == px.nbytes


@pytest.mark.parametrize(
    "mm, why",
    [
        (MultiModalInput(["a"], [1], [3], pixel_values=TensorRef(1, "float32", [1, 3, 8, 8])), "placeholder tokens"),
        (MultiModalInput(["a"], [0], [4], pixel_values=TensorRef(1, "float32", [1, 3, 8, 8])), "image tokens"),
        (MultiModalInput(["a"], [1], [4], pixel_values=TensorRef(1, "float32", [1, 3, 9, 9])), "shape"),
        (MultiModalInput(["a"], [1], [4], pixel_values=TensorRef(2, "float32", [1, 3, 8, 8])), "missing"),
        (MultiModalInput(["a"], [1], [4], pixel_values=TensorRef(1, "int64", [1, 3, 8, 8])), "dtype"),
        (MultiModalInput(["a"], [1], [4]), "exactly one"),
        (MultiModalInput(["a", "b"], [1], [4], pixel_values=TensorRef(1, "float32", [1, 3, 8, 8])), "one hash"),
        (MultiModalInput(["a"], [1], [4], embeddings=TensorRef(1, "float32", [4, 6])), "bytes"),
    ],
)
def test_check_images_rejects_malformed_inputs(mm, why):
    prompt = [1, 9, 9, 9, 9, 2]
    msg, _ = check_images(mm, prompt, frames_for(np.zeros((1, 3, 8, 8), np.float32)), SPEC)
    assert msg is not None and why in msg


def test_text_only_model_refuses_images():
    mm = MultiModalInput(["a"], [1], [4], pixel_values=TensorRef(1, "float32", [1, 3, 8, 8]))
    why, _ = check_images(mm, [1, 9, 9, 9, 9], frames_for(np.zeros((1, 3, 8, 8), np.float32)), None)
    assert "does not accept images" in why


def test_feature_cache_is_lru_within_its_byte_budget():
    c = FeatureCache(250)
    for h in "abc":
        c.put(h, (bytes(100), [1, 25], "float32"))
    assert c.get("a") is None and c.get("b") and c.get("c")  # a evicted (oldest)
    c.get("b")
    c.put("d", (bytes(100), [1, 25], "float32"))
    assert c.get("c") is None and c.get("b") and c.size == 200  # c was least recently used
    c.put("huge", (bytes(1000), [10, 25], "float32"))
    assert c.get("huge") is None  # larger than the whole cache: not kept


def test_batch_rows_picks_the_chunk_positions_of_each_request():
    a = RequestImages(torch.tensor([2, 3, 4, 5]), torch.arange(4.0)[:, None])
    b = RequestImages(torch.tensor([0, 1]), torch.tensor([[10.0], [11.0]]))
    # a computes positions 4..7 at rows 0..3, b positions 0..2 at rows 4..6, a text request at 7
    rows, embeds = batch_rows([(a, 4, 4, 0), (b, 0, 3, 4), (None, 0, 1, 7)])
    assert rows.tolist() == [0, 1, 4, 5] and embeds[:, 0].tolist() == [2.0, 3.0, 10.0, 11.0]
    assert batch_rows([(a, 6, 2, 0), (None, 0, 3, 2)]) is None


def test_kv_moves_between_different_block_layouts():
    torch.manual_seed(0)
    layers, heads, dim, n = 2, 2, 4, 11
    src = [(torch.randn(8, 4, heads, dim), torch.randn(8, 4, heads, dim)) for _ in range(layers)]
    src_blocks = [5, 1, 7]  # 11 tokens in blocks of 4
    frames: list = []  # the runner's result tensors: frame i+1 of the message
    kv = export_kv(src, src_blocks, 4, n, "r", frames)
    assert kv.num_tokens == n and len(kv.blocks) == 3
    wire = Codec.encode(kv, frames)  # through the codec, as the bus carries it
    dst = [(torch.zeros(10, 8, heads, dim), torch.zeros(10, 8, heads, dim)) for _ in range(layers)]
    import_kv(dst, [9, 2], 8, kv, wire)  # 11 tokens in blocks of 8
    for (sk, sv), (dk, dv) in zip(src, dst):
        for p in range(n):
            s_slot, d_slot = (src_blocks[p // 4], p % 4), ([9, 2][p // 8], p % 8)
            assert torch.equal(sk[s_slot], dk[d_slot]) and torch.equal(sv[s_slot], dv[d_slot])
    with pytest.raises(ValueError):
        import_kv(dst, [9], 8, kv, wire)  # does not fit


def test_clip_tower_and_projector_match_transformers(tiny_llava_dir):
    from transformers import LlavaForConditionalGeneration

    from axonserve.multimodal.encoder import load_vision_encoder
    from axonserve.neuron.config import ModelConfig
    from axonserve.neuron.loader import load_model

    pixels = torch.randn(3, 3, 32, 32)
    hf = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir).eval()
    with torch.no_grad():
        want = torch.stack(
            list(
                hf.model.get_image_features(
                    pixels, vision_feature_layer=-2, vision_feature_select_strategy="default"
                ).pooler_output
            )
        )
        full = load_model(ModelConfig.from_dir(tiny_llava_dir), torch.float32, progress=False)
        vision = load_vision_encoder(tiny_llava_dir, torch.float32)
        assert vision.language_model is None
        for model in (full, vision):
            torch.testing.assert_close(model.encode_images(pixels), want, rtol=1e-5, atol=1e-5)


def test_worker_image_cache_encodes_each_image_once_within_its_budget():
    from axonserve.multimodal.worker import ImageEncoderCache

    class Tower:
        calls = 0

        def encode_images(self, px):
            Tower.calls += len(px)
            return px.flatten(1)[:, None, :4].repeat(1, 2, 1)  # [n, 2 tokens, 4]: 32 bytes each

    cache = ImageEncoderCache(Tower(), torch.float32, capacity_bytes=64)
    px = torch.arange(3 * 4.0).view(3, 4)
    out = cache.encode(["a", "b", "a"], px)
    assert Tower.calls == 2 and torch.equal(out[0], out[2])  # "a" twice in one request: once
    cache.encode(["c"], px[:1])
    assert list(cache.cache) == ["a", "c"] and cache.size == 64  # "b" (least recent) evicted


def test_snapshot_capture_finds_the_decoder_layers(tiny_llava_dir):
    from axonserve.neuron.config import ModelConfig
    from axonserve.neuron.loader import load_model
    from axonserve.neuron.snapshot import decoder_layers

    model = load_model(ModelConfig.from_dir(tiny_llava_dir), torch.float32, progress=False)
    assert decoder_layers(model) == list(model.language_model.model.layers)
