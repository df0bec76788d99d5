"""Frontend side of images: OpenAI `image_url` content parts -> pixels, hashes, placeholders.

Images come as `data:` URLs (base64), or from http(s) only for hosts the server allows
(`--allowed-media-domains`). Each is size-checked, decoded with Pillow (undecodable or
unsupported formats are a 400), preprocessed by the model's own transformers image
processor, and hashed over its pixels: the hash keys the encoder cache and the prefix cache.
In the prompt each image becomes one image token, which is then expanded to the model's
number of image tokens; the engine gets the offsets of those runs with the pixels.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np

from axonserve.config import EngineConfig
from axonserve.protocol.codec import TensorRef
from axonserve.protocol.messages import MultiModalInput, ParamError

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
MAX_PIXELS = 64 * 2**20  # decompression-bomb guard: decoded width * height
FETCH_TIMEOUT_S = 10.0


@dataclass
class PromptImages:
    """A prompt's images, ready for `AddRequest.mm` (pixels travel as one extra frame)."""

    hashes: list[str]
    offsets: list[int]
    lengths: list[int]
    pixel_values: np.ndarray  # float32 [images, 3, H, W]

    def wire(self) -> tuple[MultiModalInput, list[Any]]:
        px = np.ascontiguousarray(self.pixel_values, dtype=np.float32)
        ref = TensorRef(1, "float32", list(px.shape))
        return MultiModalInput(self.hashes, self.offsets, self.lengths, pixel_values=ref), [px]


class ImageInputs:
    """The served model's image handling; `load` returns None for a text-only model."""

    def __init__(self, model_dir: str, processor: Any, image_token: str, image_token_id: int, tokens_per_image: int,
                 config: EngineConfig):
        self.model_dir, self.processor = model_dir, processor
        self.image_token, self.image_token_id, self.tokens_per_image = image_token, image_token_id, tokens_per_image
        self.config = config

    @classmethod
    def load(cls, model_dir: str, tokenizer: Any, config: EngineConfig | None = None) -> "ImageInputs | None":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            mc = json.load(f)
        vc = mc.get("vision_config")
        if not vc:
            return None
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(model_dir)
        token_id = int(mc.get("image_token_index", mc.get("image_token_id", -1)))
        token = tokenizer.convert_ids_to_tokens(token_id)
        strategy = mc.get("vision_feature_select_strategy", "default")
        n = (vc["image_size"] // vc["patch_size"]) ** 2 + (strategy == "full")
        return cls(model_dir, processor, token, token_id, n, config or EngineConfig(model=model_dir))

    def prepare(self, ids: list[int], urls: list[str]) -> tuple[list[int], PromptImages]:
        """Load and preprocess the images; expand each image token of `ids` into its run."""
        cfg = self.config
        if len(urls) > cfg.max_images_per_request:
            raise ParamError("messages", f"at most {cfg.max_images_per_request} images per request, got {len(urls)}")
        found = sum(1 for t in ids if t == self.image_token_id)
        if found != len(urls):
            raise ParamError("messages", f"the prompt has {found} image tokens ({self.image_token}) for {len(urls)} "
                                         "images; do not write the image token in text")
        images = [load_image(u, cfg) for u in urls]
        pixels = self.processor(images=images, return_tensors="np")["pixel_values"]
        hashes = [hashlib.sha256(p.tobytes()).hexdigest()[:32] for p in pixels]
        out, offsets = [], []
        for t in ids:
            if t == self.image_token_id:
                offsets.append(len(out))
                out.extend([t] * self.tokens_per_image)
            else:
                out.append(t)
        return out, PromptImages(hashes, offsets, [self.tokens_per_image] * len(urls), pixels)


def take_images(messages: list[dict[str, Any]], image_token: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages with each image part replaced by the image token (as text), and the image URLs."""
    urls: list[str] = []
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if not isinstance(url, str) or not url:
                        raise ParamError("messages", "an image_url content part needs image_url.url")
                    urls.append(url)
                    parts.append({"type": "text", "text": image_token})
                else:
                    parts.append(part)
            m = {**m, "content": parts}
        out.append(m)
    return out, urls


def has_images(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(p, dict) and p.get("type") in ("image_url", "image")
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])


# --------------------------------------------------------------------------- loading


def load_image(url: str, cfg: EngineConfig) -> Any:
    """A decoded RGB PIL image from a data: URL or an allowed http(s) URL; ParamError otherwise."""
    data = _image_bytes(url, cfg)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as img:
            if img.width * img.height > MAX_PIXELS:
                raise ParamError("messages", f"image is {img.width}x{img.height} pixels; at most {MAX_PIXELS} allowed")
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        if isinstance(e, ParamError):
            raise
        raise ParamError("messages", f"cannot decode the image (supported formats: {', '.join(FORMATS)}): "
                                     f"{type(e).__name__}") from None


def _image_bytes(url: str, cfg: EngineConfig) -> bytes:
    limit = cfg.max_image_bytes
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64") or not head[5:].startswith("image/"):
            raise ParamError("messages", "image data URLs must look like data:image/<format>;base64,<data>")
        if len(payload) > limit * 4 // 3 + 4:
            raise ParamError("messages", f"image is larger than {limit} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ParamError("messages", "image data URL is not valid base64") from None
    else:
        scheme = urllib.parse.urlsplit(url).scheme
        if scheme not in ("http", "https"):
            raise ParamError("messages", f"image URL scheme {scheme!r} is not supported; use data: or http(s)")
        data = _fetch(url, cfg)
    if len(data) > limit:
        raise ParamError("messages", f"image is larger than {limit} bytes")
    if not data:
        raise ParamError("messages", "image is empty")
    return data


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect could lead off the allowed hosts: it is an error instead."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        raise urllib.error.HTTPError(req.full_url, code, "redirects are not followed for image URLs", headers, fp)


_OPENER = urllib.request.build_opener(_NoRedirect)


def _fetch(url: str, cfg: EngineConfig) -> bytes:
    host = urllib.parse.urlsplit(url).hostname or ""
    allowed = cfg.allowed_media_domains
    if not allowed:
        raise ParamError("messages", "image URLs are not fetched by this server: send the image as a data: URL, "
                                     "or start the server with --allowed-media-domains HOST")
    if "*" not in allowed and host not in allowed:
        raise ParamError("messages", f"image host {host!r} is not in --allowed-media-domains")
    try:
        with _OPENER.open(url, timeout=FETCH_TIMEOUT_S) as r:
            data = r.read(cfg.max_image_bytes + 1)
    except (OSError, ValueError) as e:
        raise ParamError("messages", f"cannot fetch the image from {host}: {type(e).__name__}: {e}") from None
    return data
