"""Scheduler-side checks of a request's images (no torch: frames stay raw buffers).

A malformed multimodal input must be a 400 for that request, never a worker step error
(which would fail the whole engine), so everything the worker will rely on is checked
here: placeholder runs inside the prompt and made of the image token, one run per image of
the model's length, and frames whose byte size matches their declared shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from axonserve.protocol.codec import ref_frame
from axonserve.protocol.messages import MultiModalInput


@dataclass(frozen=True)
class ImageSpec:
    """What the served model expects (measured by the workers, sent in `Configure`)."""

    image_token_id: int
    tokens_per_image: int
    image_size: int
    hidden_size: int

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> "ImageSpec | None":
        if "image_token_id" not in info:
            return None
        return cls(
            int(info["image_token_id"]), int(info["image_tokens"]), int(info["image_size"]), int(info["hidden_size"])
        )


def check_images(
    mm: MultiModalInput, prompt: list[int], frames: list[Any], spec: ImageSpec | None
) -> tuple[str | None, dict[str, memoryview]]:
    """(why the images are unusable or None, their frames by MultiModalInput field)."""
    if spec is None:
        return "this model does not accept images (it is not a vision-language model)", {}
    n = len(mm.hashes)
    if n == 0 or len(mm.offsets) != n or len(mm.lengths) != n:
        return "multimodal input needs one hash, offset and length per image", {}
    end = 0
    for o, k in zip(mm.offsets, mm.lengths):
        if k != spec.tokens_per_image:
            return f"each image takes {spec.tokens_per_image} placeholder tokens, not {k}", {}
        if o < end or o + k > len(prompt) or any(t != spec.image_token_id for t in prompt[o : o + k]):
            return "image placeholder runs must be image tokens inside the prompt, in order, not overlapping", {}
        end = o + k
    if (mm.pixel_values is None) == (mm.embeddings is None):
        return "multimodal input needs exactly one of pixel values and embeddings", {}
    out: dict[str, memoryview] = {}
    if mm.pixel_values is not None:
        want, ref, name = [n, 3, spec.image_size, spec.image_size], mm.pixel_values, "pixel_values"
    else:
        want, ref, name = [n * spec.tokens_per_image, spec.hidden_size], mm.embeddings, "embeddings"
    if list(ref.shape) != want:  # type: ignore[union-attr]
        return f"{name} has shape {ref.shape}, expected {want}", {}  # type: ignore[union-attr]
    buf = ref_frame(ref, frames)  # type: ignore[arg-type]
    if isinstance(buf, str):
        return buf, {}
    out[name] = buf
    return None, out
