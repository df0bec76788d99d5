"""Frontend side of images: OpenAI `image_url` content parts -> pixels, hashes, placeholders.

Images come as `data:` URLs (base64), or from http(s) only for hosts the server allows
(`--allowed-media-domains`). Each is size-checked, decoded with Pillow (undecodable or
unsupported formats are a 400), preprocessed by the model's own transformers image
processor, and hashed over its pixels: the hash keys the encoder cache and the prefix cache.

Hostile inputs are 400s, checked before the expensive step: the encoded size
(`--max-image-bytes`); the pixel count from the header, before decoding
(`--max-image-pixels`: a small PNG can declare 10000x10000); a request's decoded bytes
(width * height * channels, summed; `--max-image-decoded-bytes-per-request`), charged before
each image is decoded; only the first frame of an animation is decoded. URL fetches resolve
DNS here, refuse private, loopback, link-local and other non-public addresses unless
`--allow-private-image-urls`, connect to the checked address (no second lookup), follow no
redirects, stream the body up to `--max-image-bytes`, and finish within
`--image-fetch-timeout-s` for all of a request's URLs together (a total deadline, not a
per-read timeout). Fetch errors name a generic reason, never addresses, ports or exception text.
In the prompt each image becomes one image token, which is then expanded to the model's
number of image tokens; the engine gets the offsets of those runs with the pixels.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import hashlib
import http.client
import io
import ipaddress
import json
import os
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from axonserve.config import EngineConfig
from axonserve.protocol.codec import TensorRef
from axonserve.protocol.messages import MultiModalInput, ParamError

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")

log = structlog.get_logger(__name__)


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

    def __init__(
        self,
        model_dir: str,
        processor: Any,
        image_token: str,
        image_token_id: int,
        tokens_per_image: int,
        config: EngineConfig,
    ):
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
            raise ParamError(
                "messages",
                f"the prompt has {found} image tokens ({self.image_token}) for {len(urls)} "
                "images; do not write the image token in text",
            )
        budget = DecodeBudget(cfg.max_image_decoded_bytes_per_request)
        deadline = time.monotonic() + cfg.image_fetch_timeout_s  # all of this request's URL fetches
        images = [load_image(u, cfg, budget, deadline) for u in urls]
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
    return any(
        isinstance(p, dict) and p.get("type") in ("image_url", "image")
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
    )


# --------------------------------------------------------------------------- loading


class DecodeBudget:
    """A request's decoded-image memory: each image's cost is spent from its header, before it is
    decoded, so the image that would go over the budget is never decoded."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def spend(self, nbytes: int) -> None:
        if self.used + nbytes > self.limit:
            log.warning("image_refused", reason="decoded_budget", used=self.used, need=nbytes, limit=self.limit)
            raise ParamError(
                "messages",
                f"the request's images decode to more than {self.limit} bytes "
                "(--max-image-decoded-bytes-per-request): send fewer or smaller images",
            )
        self.used += nbytes


def decoded_bytes(img: Any) -> int:
    """What holding `img` decoded costs: width * height * bytes per pixel of its mode, at least 3
    (it is kept as RGB). Known from the header alone: PIL's `open` does not decode."""
    per_band = 4 if img.mode in ("I", "F") else 2 if img.mode.startswith("I;16") else 1
    return img.width * img.height * max(3, len(img.getbands()) * per_band)


def load_image(url: str, cfg: EngineConfig, budget: DecodeBudget | None = None, deadline: float | None = None) -> Any:
    """A decoded RGB PIL image from a data: URL or an allowed http(s) URL; ParamError otherwise.

    The pixel count (`cfg.max_image_pixels`) and the request's decode budget are checked from the
    header before any pixel is decoded; of an animated GIF/PNG/WebP only the first frame is
    decoded. `deadline` (time.monotonic()) bounds fetching; None: image_fetch_timeout_s from now."""
    data = _image_bytes(url, cfg, deadline)
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as img:
            w, h = img.size
            if w <= 0 or h <= 0:
                raise ParamError("messages", "image has no pixels")
            if w * h > cfg.max_image_pixels:
                log.warning("image_refused", reason="pixels", width=w, height=h, limit=cfg.max_image_pixels)
                raise ParamError(
                    "messages",
                    f"image is {w}x{h} pixels; at most {cfg.max_image_pixels} pixels allowed (--max-image-pixels)",
                )
            if budget is not None:
                budget.spend(decoded_bytes(img))
            img.load()  # the current (first) frame only: other frames of an animation are never decoded
            return img.convert("RGB")
    except ParamError:
        raise
    except Image.DecompressionBombError:  # PIL's own guard (2x Image.MAX_IMAGE_PIXELS), past ours if raised
        log.warning("image_refused", reason="decompression_bomb")
        raise ParamError("messages", "image has too many pixels (--max-image-pixels)") from None
    except Exception as e:  # noqa: BLE001 - untrusted bytes: whatever the decoder raises is a bad image
        raise ParamError(
            "messages", f"cannot decode the image (supported formats: {', '.join(FORMATS)}): {type(e).__name__}"
        ) from None


def _image_bytes(url: str, cfg: EngineConfig, deadline: float | None = None) -> bytes:
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
        data = _fetch(url, cfg, deadline)
    if len(data) > limit:
        raise ParamError("messages", f"image is larger than {limit} bytes")
    if not data:
        raise ParamError("messages", "image is empty")
    return data


# --------------------------------------------------------------------------- fetching http(s) URLs

_CHUNK = 64 * 1024
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # well-known NAT64 prefix: the last 32 bits are an IPv4 address
_DNS = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="image-dns")  # getaddrinfo has no timeout


class _FetchFailed(Exception):
    """A fetch failure; its text (a short, generic reason) is what the client sees."""


def is_public_address(addr: str) -> bool:
    """Whether an IP address is globally routable unicast: not private, loopback, link-local,
    multicast, reserved, unspecified or shared (CGNAT), nor an IPv6 form embedding such an IPv4
    address (IPv4-mapped, 6to4, NAT64)."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_public_address(str(ip.ipv4_mapped))
        embedded = ip.sixtofour or (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None)
        if embedded is not None and not is_public_address(str(embedded)):
            return False
        if ip.is_site_local:
            return False
    return ip.is_global and not (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved or ip.is_unspecified
    )


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _FetchFailed("timed out")
    return left


def _resolve(host: str, port: int, deadline: float, allow_private: bool) -> str:
    """The address to connect to: the first resolved one that may be fetched from."""
    job = _DNS.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    try:
        infos = job.result(timeout=_remaining(deadline))
    except TimeoutError:
        job.cancel()
        raise _FetchFailed("timed out") from None
    except (OSError, ValueError):  # ValueError: UnicodeError (IDNA), NUL bytes
        raise _FetchFailed("the host name could not be resolved") from None
    addrs = [str(info[4][0]) for info in infos]
    for addr in addrs:
        if allow_private or is_public_address(addr):
            return addr
    log.warning("image_refused", reason="private_address", host=host, addresses=addrs)
    raise _FetchFailed(
        "the host resolves to a private, loopback or link-local address, which this server "
        "does not fetch from (--allow-private-image-urls)"
    )


class _Watchdog:
    """Shuts the connection's socket down at the deadline, so that a blocked read (a server
    dripping headers or body byte by byte within every per-read timeout) returns."""

    def __init__(self, deadline: float):
        self._lock = threading.Lock()
        self._fd, self._done, self.fired = -1, False, False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            if self.fired:
                raise _FetchFailed("timed out")
            self._fd = sock.fileno()

    def _fire(self) -> None:
        with self._lock:  # stop() holds it before the socket is closed: the fd is still ours
            self.fired = True
            if self._done or self._fd < 0:
                return
            s = socket.socket(fileno=self._fd)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                s.detach()

    def stop(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._done = True


def _fetch(url: str, cfg: EngineConfig, deadline: float | None = None) -> bytes:
    """GET an image from an allowed host: DNS resolved here and each address checked, the checked
    address connected to (the URL's host still names the Host header and TLS SNI/certificate),
    no redirects, everything (DNS, connect, TLS, headers, body) within `deadline`, and the body
    read in chunks up to max_image_bytes. Failures are 400s with a generic reason."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if not host:
        raise ParamError("messages", "image URL has no host")
    allowed = cfg.allowed_media_domains
    if not allowed:
        raise ParamError(
            "messages",
            "image URLs are not fetched by this server: send the image as a data: URL, "
            "or start the server with --allowed-media-domains HOST",
        )
    if "*" not in allowed and host not in allowed:
        raise ParamError("messages", f"image host {host!r} is not in --allowed-media-domains")
    if deadline is None:
        deadline = time.monotonic() + cfg.image_fetch_timeout_s
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ParamError("messages", "image URL has an invalid port") from None
    try:
        addr = _resolve(host, port, deadline, cfg.allow_private_image_urls)
        return _get(parts, host, port, addr, cfg.max_image_bytes, deadline)
    except _FetchFailed as e:
        raise ParamError("messages", f"could not fetch image: {e}") from None


def _get(parts: urllib.parse.SplitResult, host: str, port: int, addr: str, limit: int, deadline: float) -> bytes:
    def connect_checked(_address: Any, timeout: Any, source_address: Any = None) -> socket.socket:
        sock = socket.create_connection((addr, port), _remaining(deadline), source_address)
        try:
            watchdog.watch(sock)
        except _FetchFailed:
            sock.close()
            raise
        return sock

    watchdog = _Watchdog(deadline)
    conn: http.client.HTTPConnection | None = None
    r = None
    try:
        if parts.scheme == "https":  # SNI and the certificate check use `host`, the URL's
            conn = http.client.HTTPSConnection(
                host, port, timeout=_remaining(deadline), context=ssl.create_default_context()
            )
        else:
            conn = http.client.HTTPConnection(host, port, timeout=_remaining(deadline))
        conn._create_connection = connect_checked  # type: ignore[attr-defined] # the checked address, no 2nd lookup
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Accept": "image/*", "User-Agent": "axonserve", "Connection": "close"})
        sock = conn.sock  # the response keeps it open (the connection lets go of it when the response will close)
        assert sock is not None
        sock.settimeout(_remaining(deadline))
        r = conn.getresponse()
        if 300 <= r.status < 400:
            raise _FetchFailed("redirects are not followed for image URLs")
        if r.status != 200:
            raise _FetchFailed(f"HTTP status {r.status}")
        length = r.getheader("Content-Length", "")
        if length.strip().isdigit() and int(length) > limit:
            raise ParamError("messages", f"image is larger than {limit} bytes")
        body = bytearray()
        while len(body) <= limit and not r.isclosed():  # closed: the whole Content-Length was read
            sock.settimeout(_remaining(deadline))
            chunk = r.read(min(_CHUNK, limit + 1 - len(body)))
            if not chunk:
                break
            body += chunk
        if watchdog.fired:
            raise _FetchFailed("timed out")
        if len(body) > limit:
            log.warning("image_refused", reason="fetched_size", host=host, limit=limit)
            raise ParamError("messages", f"image is larger than {limit} bytes")
        return bytes(body)
    except ParamError:
        raise
    except _FetchFailed as e:
        log.warning("image_fetch_failed", host=host, reason=str(e))
        raise
    except Exception as e:  # noqa: BLE001 - sockets, TLS, HTTP parsing: a generic reason, no details echoed
        timed_out = watchdog.fired or isinstance(e, TimeoutError)
        reason = (
            "timed out"
            if timed_out
            else "TLS failed"
            if isinstance(e, ssl.SSLError)
            else "invalid URL"
            if isinstance(e, http.client.InvalidURL)
            else "bad HTTP response"
            if isinstance(e, http.client.HTTPException)
            else "connection failed"
        )
        log.warning("image_fetch_failed", host=host, reason=reason, error=repr(e))
        raise _FetchFailed(reason) from None
    finally:
        watchdog.stop()
        if r is not None:
            r.close()
        if conn is not None:
            conn.close()
